"""One run directory, one writer: a lock file that keeps a second job out of a run in use.

``run.lock`` in the run directory names its holder (job id and restart count, host, pid, the pid's start time, and
since when it holds the lock, a wall time for people). Its content is written once, when the lock is created, and never
again: the heartbeat is the file's mtime, which the holder touches every HEARTBEAT_S seconds from a daemon thread after
checking that the lock still names this job. (A beat that rewrote the file could undo a takeover: had another job taken
the lock over between the beat's check and its write, say while the beat stalled a lease long on a hung NFS mount,
the write put the stale holder's lock back over the new one, and the job that took over rightly was the one to stop.
A touch that lands on the new holder's lock that way is harmless, as that job is alive, and the next beat finds the
lock names another job: the one that took over keeps it.) A start that finds the lock held refuses in one line naming
the other job, unless the holder is known to be gone:

- it is an earlier incarnation of this very job: the same job id with a lower restart count (Slurm's
  SLURM_RESTART_COUNT, torchrun's TORCHELASTIC_RESTART_COUNT), on whatever node; the scheduler never runs two
  incarnations of one job at once. Another step or process of the same allocation (the same job id, the same
  restart count) is just another job;
- its holder was on this host and that process is gone (or the pid now belongs to another process): known at once;
- its holder is on another host and the lock (its bytes and its mtime) does not change for LEASE_S, timed on this
  process's own monotonic clock while it watches the lock (a live holder's next beat refuses the start). The wall
  clocks of two hosts are never compared, the mtime with no clock at all: a holder whose clock is skewed is judged by
  whether its heartbeat moves, not by when.

A new lock is created whole, holder and all (a hard link of a written file), so no job ever reads it empty, and only by
that exclusive create. A lock is judged without holding anything, and changed (created, a stale one removed, released)
only under a flock'ed guard file beside it, and only if it is still the very lock judged (its bytes and mtime) or still
absent; a stale one is renamed aside, compared again, and removed. Of any number of starters, one creates the lock and
the others, each in its turn, find a lock other than the one they judged and judge again. A start that is refused
writes nothing: it reads the lock, and creates files only when the lock is absent or stale.

The lock file is read as a file: never through a symlink, never waiting on a FIFO, a regular file of at most
MAX_LOCK_BYTES (shardlab.jobs.lock_holder, which knows the file's format and words its holder). A lock that is not one
(such a path, or content naming no holder) is malformed: the start is refused naming the file and its content, and the
file is left alone (shardlab cannot tell whose it is).

Held by global rank 0 of a job (the launcher process of local ranks), from before Hydra writes the run's record
(shardlab.cli.preflight) until the job ends, when it is renamed aside and removed only if it still names this job. The
heartbeat survives a lock it cannot read or find for a while (a passing NFS error, another starter renaming it aside to
compare): it tries again, and gives the lock up only when the file names another holder. Then ``lost()`` says why
(who took the folder, and since when by that job's clock), and the trainer stops at the next step saving nothing;
``lost_now()`` reads the files again, for the checkpoint manager to ask immediately before each publish and prune.

A checkpoint folder outside the run is locked at its real path, and refused if it lies in another run's folder
(``another_runs_folder``); system folders and ``~`` are refused by the pre-flight and again here (both rules are
shardlab.jobs.run_folders').

Here: the lease (``RunLock``: judge, take over, create, beat, release, under a guard), the locks of this process's
runs (``take``, ``lost``, ``lost_now``) and the follower of a spawned rank. The pid check, the heartbeat's touch and
its watch are shardlab.files.liveness.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from shardlab.distributed.env import current_job
from shardlab.errors import ConfigError, RunFolderInUse
from shardlab.files.liveness import HeartbeatWatch, process_alive, process_start, touch
from shardlab.jobs.lock_holder import (
    LOCK_FILE,
    NotALock,
    current_restart,
    field,
    holder_of,
    lost_line,
    malformed,
    read_lock,
    read_lock_or_none,
    who,
)
from shardlab.jobs.run_folders import (  # the pre-flight's rules and words
    another_runs_folder,
    checkpoint_folder_outside,
    folder_errors,
    writable_dir_problem,
)

HEARTBEAT_S = 30.0
"""How often the holder touches its lock (having checked that the lock is still its own)."""
LEASE_S = 300.0
"""How long a watcher must see another host's heartbeat unchanged before it takes the lock over: ten missed
heartbeats, so a slow shared file system or a loaded node never loses a live job its lock."""
TAKEOVER_TRIES = 5
UNREADABLE_WAIT_S = 0.2
MISSING_BEATS = 3
"""Beats in a row that find the lock gone before the holder creates it again (exclusively: a job that took it over
since keeps it): a lock renamed aside for a moment by a starter comparing it comes back by itself."""
PID_MAX = 1 << 22
"""Linux's largest pid (/proc/sys/kernel/pid_max at most): a lock naming another is no live process of this host."""
GUARD_FILE = ".run.lock.guard"
"""Beside the lock while a starter changes it (creates it, or removes a stale one), flock'ed: starters change the lock
one at a time (see ``_guard``)."""
GUARD_WAIT_S = 60.0
"""How long a starter waits for another starter's change of the lock (a few file operations) before it gives up."""
HOLDER_ENV = "SHARDLAB_RUN_LOCKS"
"""Set by the holder for the ranks it spawns: the locks' paths and tokens, so rank 0 can tell whether they were lost."""


class RunLock:
    """``run.lock`` in one folder: ``acquire`` (or RunFolderInUse), a heartbeat thread while held, ``release``.
    Runs use ``take``, which also locks a checkpoint folder outside the run."""

    def __init__(self, run_dir: Path, say=print, key: str = "hydra.run.dir") -> None:
        self.path = Path(run_dir) / LOCK_FILE
        self.say = say
        self.key = key
        """The setting that names the folder, for a folder that cannot be made."""
        self.me = {
            "job": current_job(),
            "restart": current_restart(),
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "pid_start": process_start(os.getpid()),
            "token": f"{socket.gethostname()}:{os.getpid()}:{time.time_ns()}",
        }
        self.lost: str | None = None
        """Why this job no longer holds the lock (another job's lock replaced it), once the heartbeat is sure."""
        self._made: list[Path] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ---- acquire / release --------------------------------------------------------------------------------------
    def acquire(self) -> None:
        """Hold the lock, taking over one whose holder is gone; RunFolderInUse naming the holder otherwise. The lock is
        judged outside the guard (watching another host's heartbeat takes minutes) and changed inside it, only if it
        is still the lock judged (or still absent)."""
        self._make_parents()
        watch, announced, takeovers = HeartbeatWatch(), False, 0
        while True:
            holder, judged = self._read_judged()
            if judged is not None:
                live, reason = self._judge(holder)
                if live:
                    raise RunFolderInUse(reason) from None
                if reason is not None:  # another host's: watched until it changes (live) or the lease passes
                    unchanged = watch.see(judged)
                    if watch.changed:
                        raise RunFolderInUse(self._describe(holder, "its heartbeat moved while this job watched it"))
                    if unchanged < LEASE_S:
                        if not announced:
                            self.say(f"[run] {reason}", flush=True)
                            announced = True
                        time.sleep(min(1.0, LEASE_S / 20))
                        continue
            with self._guard():  # one starter at a time: the others find a lock other than the one they judged
                if read_lock_or_none(self.path) == judged:  # still the stale lock judged (or still none)
                    if judged is not None:
                        self._remove_if_unchanged(judged)
                    if self._create():
                        break
            takeovers += 1
            if takeovers > TAKEOVER_TRIES:  # something keeps writing dead holders' locks here
                raise RunFolderInUse(f"{self.path} changed under each of {TAKEOVER_TRIES} takeovers; {self._fix()}")
        self._thread = threading.Thread(target=self._beat, name="shardlab-run-lock", daemon=True)
        self._thread.start()

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        # Renamed aside and checked there, not checked and then removed by name: a takeover that came between the check
        # and the removal would lose the job that took over its lock. A lock that cannot be moved now is left to the
        # next start, which judges it like any other (this process is gone by then).
        with contextlib.suppress(OSError, RunFolderInUse), self._guard():
            self._remove_aside_if(lambda aside: _owner(aside, self.me["token"])[0] == "ours")
        for folder in reversed(self._made):  # a start refused later (a path check) leaves no empty folder behind
            with contextlib.suppress(OSError):
                folder.rmdir()

    def held(self) -> bool:
        """Whether the lock file names this process now (False also while it cannot be read)."""
        return _owner(self.path, self.me["token"])[0] == "ours"

    def taken_over(self) -> bool:
        """Whether another job surely holds the lock now (its lock replaced ours); a lock that cannot be read or
        found for a moment is not that."""
        if self.lost is None:
            state, holder = _owner(self.path, self.me["token"])
            if state == "theirs":
                self.lost = lost_line(self.path, holder or {})
        return self.lost is not None

    # ---- helpers ------------------------------------------------------------------------------------------------
    def _make_parents(self) -> None:
        missing = [p for p in [self.path.parent, *self.path.parent.parents] if not p.exists()]
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            problem = writable_dir_problem(self.path.parent) or e.strerror or str(e)
            raise ConfigError(
                f"{self.key}: cannot create or write {self.path.parent} ({problem}); choose a writable directory"
            ) from None
        self._made = list(reversed(missing))

    def _read_judged(self) -> tuple[dict[str, Any], tuple[bytes, int] | None]:
        """The lock's holder and what it is judged by: the bytes it was read from and its mtime, the holder's
        heartbeat (({}, None) if there is no lock). The rule for a lock that is not one: a path that is not a regular
        file (a symlink, a FIFO, ...) or over MAX_LOCK_BYTES, or content that names no holder still after two more
        reads (0.4 s: where hard links are missing, a lock is written after its exclusive create, and its creator may
        be writing it now), is refused as malformed in one line (``_malformed``), never judged nor removed: shardlab
        cannot tell whose it is. One that cannot be read (an OSError) is tried a few times, then refused too."""
        error: OSError | None = None
        seen = (b"", 0)
        for pause in (UNREADABLE_WAIT_S, UNREADABLE_WAIT_S, 0.0):
            try:
                seen = read_lock(self.path)
            except FileNotFoundError:
                return {}, None
            except NotALock as e:
                raise RunFolderInUse(malformed(self.path, e.strerror)) from None
            except OSError as e:
                error = e
                time.sleep(pause)
                continue
            holder = holder_of(seen[0])
            if holder is not None:
                return holder, seen
            error = None
            time.sleep(pause)
        if error is not None:
            raise RunFolderInUse(f"cannot read {self.path} ({error.strerror or error}); {self._fix()}")
        raise RunFolderInUse(malformed(self.path, "", seen[0]))

    def _judge(self, holder: dict[str, Any]) -> tuple[bool, str | None]:
        """(True, the refusal) for a holder known alive; (False, None) for one known gone (or this process);
        (False, what this job waits for) for another host's holder, judged by watching its heartbeat."""
        pid = holder.get("pid")
        if holder.get("token") == self.me["token"] or self._earlier_incarnation(holder):
            return False, None  # this job's previous incarnation (a requeue), on whatever node
        if holder.get("host") == self.me["host"] and type(pid) is int:
            if not 0 < pid <= PID_MAX:  # no process of this host has it
                return False, None
            if pid == self.me["pid"] or not process_alive(pid, holder.get("pid_start")):
                return False, None
            return True, self._describe(holder, "alive on this host")
        return False, (
            f"{self.path.parent} is held by {who(holder)}; its host is not this one, so this job watches the "
            f"lock: it is refused as soon as the heartbeat moves, and takes the folder over if the heartbeat stays "
            f"unchanged for {LEASE_S:.0f} s by this host's clock"
        )

    def _earlier_incarnation(self, holder: dict[str, Any]) -> bool:
        """The same job id with a lower restart count: a requeue of the holder itself. The same job id with the same
        count is another step or process of the allocation, refused like any other job."""
        restart = holder.get("restart")
        return (
            self.me["job"] is not None
            and holder.get("job") == self.me["job"]
            and isinstance(restart, int)
            and restart < self.me["restart"]
        )

    def _remove_if_unchanged(self, judged: tuple[bytes, int]) -> None:
        """Remove the lock if it is still the file judged stale (the same bytes and mtime: a live holder's heartbeat
        touches it, and a new lock names another holder; an inode number would not do, as a removed file's is reused
        at once). It is renamed aside, atomically, so that of several jobs taking over only one gets it (a rename keeps
        the mtime); a file another job created or beat since was moved by mistake and goes back (unless a third job
        created a lock meanwhile, whose lock then stands)."""
        self._remove_aside_if(lambda aside: read_lock_or_none(aside) == judged)

    def _remove_aside_if(self, still: Callable[[Path], bool]) -> None:
        """Rename the lock aside and remove it if ``still(the file moved)``, else put it back."""
        aside = self.path.with_name(f".{LOCK_FILE}.{os.getpid()}.{time.time_ns()}.stale")
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return  # another job removed it first
        try:
            if not still(aside):
                self._put_back(aside)
        finally:
            aside.unlink(missing_ok=True)

    def _put_back(self, aside: Path) -> None:
        try:
            os.link(aside, self.path)  # unless a lock exists again (its holder beat, or a third job created one)
        except FileExistsError:
            pass
        except OSError:  # no hard links here: a rename, which would replace a lock made in between
            if not self.path.exists():
                os.rename(aside, self.path)

    @contextlib.contextmanager
    def _guard(self) -> Iterator[None]:
        """Hold GUARD_FILE's flock while this process changes the lock (creates it, removes a stale one, releases
        it). Of starters that judged the same stale lock, or found none, the first to get the guard changes it; each
        of the others finds, in its turn, a lock other than the one it judged and judges again, however long it
        paused between judging and acting. (With the rename-aside check alone, a third starter could create a lock
        while a second's put-back was pending, and that put-back's clean-up removed the first's live lock.) flock
        holds on local file systems, NFS (v4, and v3 with lockd: Linux maps flock onto its byte-range locks), Lustre
        mounted with ``-o flock`` and GPFS; where a file system refuses it, this says so once and goes on with the
        rename-aside check alone, which keeps two starters apart, not three. The kernel lets go of a dead process's
        flock; the file is removed by the process holding it before it lets go (a waiter that then holds a removed
        file's flock opens the file again), so it stays only where a process died inside the guard."""
        guard = self.path.with_name(GUARD_FILE)
        deadline = time.monotonic() + GUARD_WAIT_S
        while True:
            try:
                fd = os.open(guard, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
            except OSError as e:
                raise RunFolderInUse(f"cannot open {guard} ({e.strerror or e}); {self._fix()}") from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                os.close(fd)
                if e.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                    self._no_flock(e)
                    break
                if e.errno not in (errno.EAGAIN, errno.EWOULDBLOCK) or time.monotonic() > deadline:
                    raise RunFolderInUse(
                        f"{self.path.parent}: another process has been changing its lock for {GUARD_WAIT_S:.0f} s "
                        f"(it holds {guard}); {self._fix()}"
                    ) from None
                time.sleep(0.01)
                continue
            if _same_file(fd, guard):
                try:
                    yield
                finally:
                    with contextlib.suppress(OSError):
                        os.unlink(guard)
                    os.close(fd)
                return
            os.close(fd)  # its holder removed it as it let go: open the one there now
        yield  # no flock on this file system

    def _no_flock(self, error: OSError) -> None:
        if not getattr(self, "_said_no_flock", False):
            self._said_no_flock = True
            self.say(
                f"[run] WARNING: {self.path.parent}'s file system has no flock ({error.strerror}): starters are kept "
                "apart by the lock's exclusive create and rename-aside check alone, which is safe for two starting at "
                "once, not three or more",
                flush=True,
            )

    def _create(self) -> bool:
        """Create the lock already holding this job's details, or return False if it exists. A hard link of a written
        file creates it whole in one step (atomic on local file systems and NFS): a lock created empty and written
        after let a job starting at the same moment read it empty, take it for stale, and hold it too. Where the
        file system has no hard links, an exclusive create and a write, with that window."""
        tmp = self._written_tmp()
        try:
            os.link(tmp, self.path)
            return True
        except FileExistsError:
            return False
        except OSError:  # no hard links here
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                return False
            with os.fdopen(fd, "w") as f:
                f.write(tmp.read_text())
            return True
        finally:
            tmp.unlink(missing_ok=True)

    def _written_tmp(self) -> Path:
        """A temporary file beside the lock holding this job's details and since when it holds the lock (a wall time
        for people: watchers never compare it with their own clock)."""
        tmp = self.path.with_name(f".{LOCK_FILE}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({**self.me, "since": time.strftime("%Y-%m-%d %H:%M:%S %z")}))
        return tmp

    def _beat(self) -> None:
        """Every HEARTBEAT_S: check that the lock names this job, then touch it. The file is never written: had
        another job taken the lock over between the check and the touch, the touch lands on that job's lock (it is
        alive, so that tells watchers nothing false), and the next check finds the lock is another job's."""
        missing = 0
        while not self._stop.wait(HEARTBEAT_S):
            state, holder = _owner(self.path, self.me["token"])
            if state == "theirs":  # sure: a whole lock naming another holder
                self.lost = lost_line(self.path, holder or {})
                self.say(f"[run] {self.lost}", flush=True)
                return
            missing = missing + 1 if state == "missing" else 0
            try:
                if state == "ours":
                    touch(self.path)
                elif missing >= MISSING_BEATS:
                    with self._guard():
                        self._create()  # exclusively: the next beat reads whose it is
            except (OSError, RunFolderInUse):
                pass  # a passing file-system error: the next beat tries again, well within the lease
            # "unreadable" or missing for a moment: touched again once it reads as ours

    def _describe(self, holder: dict[str, Any], detail: str) -> str:
        job = f"job {field(holder, 'job')}" if holder.get("job") else "a job"
        where = f"host {field(holder, 'host')}, pid {field(holder, 'pid')}"
        return f"{self.path.parent} is in use by {job} ({where}, {detail}); {self._fix()}"

    def _fix(self) -> str:
        return (
            f"wait for it to end or stop it, or choose another hydra.run.dir (another host's lock is taken over once "
            f"its heartbeat stays unchanged for {LEASE_S:.0f} s; delete {self.path} if that job is surely gone)"
        )


def _same_file(fd: int, path: Path) -> bool:
    try:
        return os.fstat(fd).st_ino == os.stat(path, follow_symlinks=False).st_ino
    except FileNotFoundError:
        return False


def _owner(path: Path, token: str) -> tuple[str, dict[str, Any] | None]:
    """("ours" | "theirs" | "missing" | "unreadable", the holder read): "theirs" only for a whole lock naming
    another token, the one answer that means the lock is lost. Read as ``_read_lock`` reads: a symlink, a FIFO or
    content that names no holder is "unreadable"."""
    try:
        data, _ = read_lock(path)
    except FileNotFoundError:
        return "missing", None
    except OSError:
        return "unreadable", None
    holder = holder_of(data)
    if holder is None:
        return "unreadable", None
    return ("ours" if holder["token"] == token else "theirs"), holder


# ---- the locks of this process's runs --------------------------------------------------------------------------------
_held: dict[Path, list[RunLock]] = {}
_watched: dict[Path, _Follower] = {}


def _key(run_dir: Path) -> Path:
    return Path(run_dir).expanduser().absolute()


def take(run_dir: Path, checkpoint_dir: str | None = None) -> list[RunLock]:
    """The locks of a run (its folder's, and its checkpoint folder's when that lies outside, by its real path),
    held by this process: taken now, or the ones this process took already (the pre-flight takes them before Hydra
    writes the run's record; run_job then finds them held). A checkpoint folder inside another run's folder, or in
    one another job's lock covers, is refused (ConfigError) before any lock is taken."""
    key = _key(run_dir)
    if key in _held:
        return _held[key]
    if where := folder_errors(key, checkpoint_dir if checkpoint_dir is not None else "."):
        raise ConfigError("; ".join(where))
    locks = [RunLock(key)]
    outside = checkpoint_folder_outside(key, checkpoint_dir) if checkpoint_dir is not None else None
    if outside is not None:
        if theirs := another_runs_folder(outside):
            real = "" if Path(checkpoint_dir) == outside else f" is {outside},"
            raise ConfigError(
                f"checkpoint.dir={checkpoint_dir}{real} inside another run's folder: {theirs}; its saves "
                "would prune that run's checkpoints. Use a folder of this run's own (the default: "
                "checkpoint.dir=checkpoints, or an absolute path no other run uses)"
            )
        locks.append(RunLock(outside, key="checkpoint.dir"))
    taken: list[RunLock] = []
    try:
        for lock in locks:
            lock.acquire()
            taken.append(lock)
    except BaseException:
        for lock in reversed(taken):
            lock.release()
        raise
    _held[key] = locks
    # The ranks this process spawns next follow exactly these locks (not an enclosing job's: a run started from
    # within another would otherwise stop when that one lost its folder).
    os.environ[HOLDER_ENV] = json.dumps({str(lock.path.absolute()): lock.me["token"] for lock in locks})
    return locks


def release(run_dir: Path) -> None:
    locks = _held.pop(_key(run_dir), [])
    for lock in reversed(locks):
        lock.release()
    if locks:
        os.environ.pop(HOLDER_ENV, None)


def release_all() -> None:
    for key in list(_held):
        release(key)


def taken_over(run_dir: Path) -> bool:
    """Whether another job surely holds one of this run's locks now (read from the files, not the last beat)."""
    return any(lock.taken_over() for lock in _held.get(_key(run_dir), []))


def lost(run_dir: Path) -> str | None:
    """Why this run lost its lock, or None: from the locks this process holds, or, in a rank spawned by the
    holder, from a thread that follows the holder's lock files. Cheap enough to ask at every step."""
    key = _key(run_dir)
    if key in _held:
        return next((lock.lost for lock in _held[key] if lock.lost), None)
    if key not in _watched:
        _watched[key] = _Follower()
    return _watched[key].lost


def lost_now(run_dir: Path) -> str | None:
    """Why this process may no longer write into the run's folders, read from the lock files now (not from the last
    beat): another job's lock is there. Asked immediately before every publish and prune (the checkpoint manager),
    by rank 0: the holder reads its locks, a rank the holder spawned the files it named (HOLDER_ENV). None also
    where no lock is held (a dry run, a tool, a test's bare trainer) and while a lock cannot be read or found for a
    moment (an NFS error, a starter comparing it): only another holder's whole lock means the folder is lost."""
    key = _key(run_dir)
    if key in _held:
        return next((lock.lost for lock in _held[key] if lock.taken_over()), None)
    for path, token in _spawned_locks().items():
        state, holder = _owner(Path(path), token)
        if state == "theirs":
            return lost_line(Path(path), holder or {})
    return None


def hands_off_line(run_dir: Path, step: int, newest: Path | None) -> str:
    """Why a run that lost its folder stopped at ``step``, and what it dropped: the folder is the new holder's, which
    goes on from its own checkpoints (``newest`` is this run's last); no save is kept elsewhere (docs/checkpoints.md,
    "Who may write a folder"). The same words on every rank, whichever one is reported."""
    since = f"since {newest.name}" if newest is not None else "of this run"
    return f"{lost_reason(run_dir)}; stopped at step {step} and saved nothing: its steps {since} are dropped"


def lost_reason(run_dir: Path) -> str:
    """Why the run lost its lock, in the same words on every rank once the ranks agreed it did: rank 0 (or the
    holder that spawned it) knows; another rank reads whom the lock file names now (the run folder is shared: every
    rank saves its shards there)."""
    reason = lost(run_dir)
    if reason:
        return reason
    files = [(Path(p), t) for p, t in _spawned_locks().items()] or [(_key(run_dir) / LOCK_FILE, "")]
    for path, token in files:
        state, holder = _owner(path, token)
        if state == "theirs":
            return lost_line(path, holder or {})
    return f"the lock of {run_dir} was taken over by another job"


def _spawned_locks() -> dict[str, str]:
    with contextlib.suppress(ValueError):
        locks = json.loads(os.environ.get(HOLDER_ENV) or "{}")
        if isinstance(locks, dict):
            return locks
    return {}


class _Follower:
    """In a rank its launcher spawned, the launcher's locks of this run (named in HOLDER_ENV), read every
    HEARTBEAT_S: ``lost`` once a file names another holder."""

    def __init__(self) -> None:
        self.lost: str | None = None
        self.locks = {Path(p): t for p, t in _spawned_locks().items()}  # only the current run's: released ones leave
        if self.locks:
            threading.Thread(target=self._follow, name="shardlab-run-lock-follower", daemon=True).start()

    def _follow(self) -> None:
        while self.lost is None:
            time.sleep(HEARTBEAT_S)
            for path, token in self.locks.items():
                state, holder = _owner(path, token)
                if state == "theirs":
                    self.lost = lost_line(path, holder or {})
