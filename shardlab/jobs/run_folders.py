"""Where a run may write, and whether it can: the refusals of a run or checkpoint folder (a system folder, ``~`` that
Hydra leaves unexpanded, ``..`` out of the run folder) and the probe that a folder can be made and written in.

The pre-flight (shardlab.cli.preflight) asks them before anything is written; the run lock (``run_lock.take``) asks
``folder_errors`` again for a sweep point and a caller that composed its own config, and words a folder it cannot
make with ``writable_dir_problem``. Light (no torch, no Hydra), as the lock is.
"""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path, PurePath

from shardlab.jobs.lock_holder import LOCK_FILE, holder_of, read_lock, who


def checkpoint_dir_error(checkpoint_dir: str) -> str | None:
    """checkpoint.dir climbing out of the run folder with ``..`` (``../shared``, ``../../elsewhere``): every run of
    a sweep or of a task would resolve it to the same folder, where they would resume, save and prune each other's
    checkpoints while each holds only its own folder's lock. Refused. A folder named outright (an absolute path, a
    scratch file system) is a deliberate choice and gets its own lock (shardlab.jobs.run_lock.take)."""
    path = PurePath(str(checkpoint_dir))
    if path.is_absolute() or ".." not in path.parts:
        return None
    inside = PurePath("run")
    for part in path.parts:  # sub/../ckpt stays inside: only a path that leaves the run folder is refused
        inside = inside.parent if part == ".." else inside / part
        if inside == PurePath("."):
            return (
                f"checkpoint.dir={checkpoint_dir} leaves the run folder through '..', where other runs would share its "
                "checkpoints; use a folder inside the run (the default: checkpoint.dir=checkpoints), an absolute path "
                "for a folder of this run's own, or another hydra.run.dir"
            )
    return None


SYSTEM_PREFIXES = (
    *("/bin", "/boot", "/dev", "/etc", "/lib", "/lib32", "/lib64", "/libx32", "/proc", "/run", "/sbin", "/sys"),
    *("/usr", "/var/cache", "/var/lib", "/var/lock", "/var/log", "/var/mail", "/var/run", "/var/spool"),
)
"""The system's own folders: refused as a run or checkpoint folder, and every folder below them."""
SYSTEM_FOLDERS = ("/", "/home", "/media", "/mnt", "/opt", "/root", "/srv", "/tmp", "/var")
"""Refused themselves (folders below them are where runs live), as is the user's home folder itself."""


def system_folder_error(key: str, path: str | os.PathLike) -> str | None:
    """The refusal of a run or checkpoint folder that is a system folder: the root, the home folder itself, one of
    SYSTEM_FOLDERS, or anything at or below SYSTEM_PREFIXES, by the path as named and by its real path (``/var/run``
    is ``/run``). A run there would write its lock, record and checkpoints among the system's files, and prune
    ``step_*`` folders there; as root nothing would stop it."""
    named = Path(os.path.abspath(path))
    home = Path(os.path.expanduser("~")).resolve()
    for place in dict.fromkeys((named, named.resolve())):
        below = next((p for p in SYSTEM_PREFIXES if place.is_relative_to(p)), None)
        if below or str(place) in SYSTEM_FOLDERS or place == home:
            what = f"inside the system folder {below}" if below and str(place) != below else "a system folder itself"
            if place == home and not below and str(place) not in SYSTEM_FOLDERS:
                what = "the home folder itself"
            return (
                f"{key}={path} is {place}, {what}: a run writes its lock, record and checkpoints in its folders and "
                "prunes step_* folders there; choose a folder of its own (e.g. runs/... or a scratch folder)"
            )
    return None


def folder_errors(run_dir: str | os.PathLike, checkpoint_dir: str) -> list[str]:
    """What the pre-flight refuses of where a run writes, before anything is written: a system folder as the run's
    or the checkpoint folder (``system_folder_error``), and ``~`` in checkpoint.dir (Hydra does not expand it, so
    the files would go to ``<run>/~/...``)."""
    if str(checkpoint_dir).startswith("~"):
        return [
            f"checkpoint.dir={checkpoint_dir} starts with '~', which Hydra leaves as it is (a folder named '~' in the "
            "run folder); write the folder out, e.g. checkpoint.dir=${oc.env:HOME}/ck"
        ]
    checkpoint = Path(run_dir) / checkpoint_dir
    # The checkpoint folder usually lies inside the run folder: one line is enough.
    found = system_folder_error("hydra.run.dir", run_dir) or system_folder_error("checkpoint.dir", checkpoint)
    return [found] if found else []


def writable_dir_problem(path: Path, attempts: int = 20, keep: bool = False) -> str | None:
    """Why ``path`` cannot be created as a directory and written in, or None; leaves the filesystem as it was, unless
    ``keep``: then the directories it made stay.

    Every rank of a job checks the same run directory at once, and one rank's clean-up may remove a directory
    another has just made or found: "no such file or directory" (under /proc the answer) and "file exists" are tried
    again."""
    problem = None
    for _ in range(attempts):
        problem, vanished = _writable_dir_problem(path, keep)
        if not vanished:
            break
    return problem


def _writable_dir_problem(path: Path, keep: bool) -> tuple[str | None, bool]:
    """One try of writable_dir_problem: (the problem or None, whether a directory was missing that may come back)."""
    missing = []
    existing = path
    while True:
        try:  # one stat per path: an exists() then an is_dir() may see another rank remove and remake it between
            mode = existing.stat().st_mode
            break
        except (FileNotFoundError, NotADirectoryError):
            missing.append(existing)
            existing = existing.parent
    if not stat.S_ISDIR(mode):
        return f"{existing} is a file, not a directory", False
    step = "creating it"
    try:
        path.mkdir(parents=True, exist_ok=True)
        step = "writing a file in it"
        fd, probe = tempfile.mkstemp(prefix=".shardlab-write-test-", dir=path)  # a name no other rank uses
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        # Path.mkdir(exist_ok=True) says "exists" where the directory went between its mkdir and its is_dir
        return f"{step} failed: {e.strerror or e}", isinstance(e, (FileNotFoundError, FileExistsError))
    finally:
        for created in [] if keep else missing:  # deepest first; one another process filled meanwhile stays
            try:
                created.rmdir()
            except OSError:
                break
    return None, False


# ---- a checkpoint folder outside the run -----------------------------------------------------------------------------
def checkpoint_folder_outside(run_dir: Path, checkpoint_dir: str) -> Path | None:
    """The checkpoint folder by its real path (symlinks followed) when that lies outside the run folder's real path
    (an absolute path, or a link elsewhere): it gets its own lock there, so two runs never share it, whatever path
    each names it by. None when the run's lock covers it. (``~`` is refused by the pre-flight,
    folder_errors: Hydra leaves it as it is, so the files and the lock would read it differently.)"""
    run = Path(run_dir).expanduser().absolute().resolve()
    folder = (run / checkpoint_dir).resolve()
    return None if folder.is_relative_to(run) else folder


def another_runs_folder(folder: Path) -> str | None:
    """Why checkpoint folder ``folder`` (a real path outside this run's folder) belongs to another run: it or a
    folder above it is a run folder (``.hydra/`` or ``status.json``) or is locked by another job (a ``run.lock``
    above it; its own is judged by ``acquire``, which takes a dead holder's or an earlier incarnation's over).
    Refused in one line naming that job: its saves would prune that run's checkpoints, and that run's lock does not
    cover a folder it never locks. None if no such folder is found."""
    for place in [folder, *folder.parents]:
        if place.parent == place:  # the file system's root: not a run folder (refused as one by the pre-flight)
            return None
        lock = place / LOCK_FILE
        marks = [m for m in (".hydra", "status.json") if os.path.lexists(place / m)]
        if place != folder and os.path.lexists(lock):
            try:
                holder = holder_of(read_lock(lock)[0])
                whose = who(holder) if holder else "a malformed lock"
            except OSError as e:
                whose = f"a lock that cannot be read ({e.strerror})"
            return f"{place} is locked by {whose} ({lock})"
        if marks:
            return f"{place} is another run's folder (it holds {' and '.join(marks)})"
    return None
