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
that exclusive create. Taking over a stale lock removes it first, and only the very file judged stale (renamed aside,
which keeps its mtime, and compared with the bytes and mtime judged): of two jobs that take over at once, however far
apart, one removes it and the other moves nothing or puts back what it moved, and then only one creates the new lock;
the other finds that job alive and refuses. A start that is refused writes nothing: it reads the lock, and creates files
only when the lock is absent or stale.

Held by global rank 0 of a job (the launcher process of local ranks), from before Hydra writes the run's record
(shardlab.jobs.preflight) until the job ends, when it is renamed aside and removed only if it still names this job. The
heartbeat survives a lock it cannot read or find for a while (a passing NFS error, another starter renaming it aside to
compare): it tries again, and gives the lock up only when the file names another holder. Then ``lost()`` says why, and
the trainer stops at the next step with a save.

The pid check, the heartbeat's touch and its watch are shared with the corpus cache's lock (tasks/lm/cache_lock.py).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from shardlab.distributed.env import current_job
from shardlab.errors import ConfigError, RunFolderInUse

LOCK_FILE = "run.lock"
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
HOLDER_ENV = "SHARDLAB_RUN_LOCKS"
"""Set by the holder for the ranks it spawns: the locks' paths and tokens, so rank 0 can tell whether they were lost."""


# ---- shared with tasks/lm/cache_lock.py: is a holder alive? ----------------------------------------------------------
def process_start(pid: int) -> str | None:
    """When ``pid`` started (clock ticks since boot, from /proc), so a reused pid is told from the holder."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def process_alive(pid: int, started: str | None = None) -> bool:
    """Whether process ``pid`` of this host runs, and is the one that started at ``started`` (if known)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # someone else's process: it exists
    return started is None or process_start(pid) in (None, started)


def touch(path: Path) -> None:
    """A heartbeat: a new mtime for ``path``, the wall time or a second past its mtime now, whichever is later, so
    that it changes even where the file system keeps whole seconds or this host's clock stepped back. Watchers look
    for the change, never compare it with a clock."""
    beat = max(time.time_ns(), os.stat(path).st_mtime_ns + 1_000_000_000)
    os.utime(path, ns=(beat, beat))


class HeartbeatWatch:
    """How long a holder's heartbeat (a lock's mtime, with its bytes for the run lock) has stayed the same, on this
    process's monotonic clock (never the holder's wall clock, which may run on another host, skewed): a watcher that
    sees it change knows the holder is alive."""

    def __init__(self) -> None:
        self.value: Any = None
        self.since: float | None = None
        self.changed = False
        """Whether the value changed after this watch first saw it."""

    def see(self, value: Any) -> float:
        """Seconds ``value`` has been seen unchanged (0 when it is new or changed)."""
        now = time.monotonic()
        if self.since is None or value != self.value:
            self.changed = self.since is not None
            self.value, self.since = value, now
        return now - self.since


# ---- who this job is -------------------------------------------------------------------------------------------------
def current_restart() -> int:
    """Which incarnation of the job this is: Slurm counts requeues (unset before the first), torchrun its restarts."""
    for key in ("SLURM_RESTART_COUNT", "TORCHELASTIC_RESTART_COUNT"):
        with contextlib.suppress(ValueError):
            return int(os.environ.get(key, ""))
    return 0


def _read_lock(path: Path) -> tuple[bytes, int]:
    """A lock's bytes and its heartbeat (its mtime), from one open file: the same file's both, however its name
    moves, and fresh on NFS (opening a file revalidates the attributes that a stat by name may take from a cache)."""
    with open(path, "rb") as f:
        return f.read(), os.fstat(f.fileno()).st_mtime_ns


def _read_lock_or_none(path: Path) -> tuple[bytes, int] | None:
    try:
        return _read_lock(path)
    except OSError:
        return None


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
        """Hold the lock, taking over one whose holder is gone; RunFolderInUse naming the holder otherwise."""
        self._make_parents()
        watch, announced, takeovers = HeartbeatWatch(), False, 0
        while True:
            holder, judged = self._read_judged()
            if judged is None:  # no lock: create ours (another job may create one first: then judge that one)
                if self._create():
                    break
            else:
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
                self._remove_if_unchanged(judged)  # stale: away with it, then create ours
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
        with contextlib.suppress(OSError):
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
                self.lost = _lost_line(self.path, holder or {})
        return self.lost is not None

    # ---- helpers ------------------------------------------------------------------------------------------------
    def _make_parents(self) -> None:
        missing = [p for p in [self.path.parent, *self.path.parent.parents] if not p.exists()]
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            from shardlab.jobs.checks import writable_dir_problem  # its words for why (the path checks' own)

            problem = writable_dir_problem(self.path.parent) or e.strerror or str(e)
            raise ConfigError(
                f"{self.key}: cannot create or write {self.path.parent} ({problem}); choose a writable directory"
            ) from None
        self._made = list(reversed(missing))

    def _read_judged(self) -> tuple[dict[str, Any], tuple[bytes, int] | None]:
        """The lock's holder ({} if it does not parse) and what it is judged by: the bytes it was read from and its
        mtime, the holder's heartbeat (None if the lock is gone). A
        lock that does not parse is read again after a moment: where hard links are missing, a lock is written after
        its exclusive create, and its creator may be writing it now; one that cannot be read is tried a few times,
        then the start is refused (a live holder's lock is never removed unread)."""
        error: OSError | None = None
        seen = (b"", 0)
        for pause in (UNREADABLE_WAIT_S, UNREADABLE_WAIT_S, 0.0):
            try:
                seen = _read_lock(self.path)
            except FileNotFoundError:
                return {}, None
            except OSError as e:
                error = e
                time.sleep(pause)
                continue
            try:
                holder = json.loads(seen[0])
                return (holder if isinstance(holder, dict) else {}), seen
            except ValueError:
                error = None
                time.sleep(pause)
        if error is not None:
            raise RunFolderInUse(f"cannot read {self.path} ({error.strerror or error}); {self._fix()}")
        return {}, seen

    def _judge(self, holder: dict[str, Any]) -> tuple[bool, str | None]:
        """(True, the refusal) for a holder known alive; (False, None) for one known gone (or this process);
        (False, what this job waits for) for another host's holder, judged by watching its heartbeat."""
        pid = holder.get("pid")
        if holder.get("token") == self.me["token"] or self._earlier_incarnation(holder):
            return False, None  # this job's previous incarnation (a requeue), on whatever node
        if holder.get("host") == self.me["host"] and isinstance(pid, int):
            if pid == self.me["pid"] or not process_alive(pid, holder.get("pid_start")):
                return False, None
            return True, self._describe(holder, "alive on this host")
        return False, (
            f"{self.path.parent} is held by {_who(holder)}; its host is not this one, so this job watches the "
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
        self._remove_aside_if(lambda aside: _read_lock_or_none(aside) == judged)

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
                self.lost = _lost_line(self.path, holder or {})
                self.say(f"[run] {self.lost}", flush=True)
                return
            missing = missing + 1 if state == "missing" else 0
            try:
                if state == "ours":
                    touch(self.path)
                elif missing >= MISSING_BEATS:
                    self._create()  # exclusively: the next beat reads whose it is
            except OSError:
                pass  # a passing file-system error: the next beat tries again, well within the lease
            # "unreadable" or missing for a moment: touched again once it reads as ours

    def _describe(self, holder: dict[str, Any], detail: str) -> str:
        job = f"job {holder['job']}" if holder.get("job") else "a job"
        return (
            f"{self.path.parent} is in use by {job} (host {holder.get('host', '?')}, pid {holder.get('pid', '?')}, "
            f"{detail}); {self._fix()}"
        )

    def _fix(self) -> str:
        return (
            f"wait for it to end or stop it, or choose another hydra.run.dir (another host's lock is taken over once "
            f"its heartbeat stays unchanged for {LEASE_S:.0f} s; delete {self.path} if that job is surely gone)"
        )


def _who(holder: dict[str, Any]) -> str:
    job = f"job {holder['job']}" if holder.get("job") else "a job"
    return f"{job} (host {holder.get('host', '?')}, pid {holder.get('pid', '?')})"


def _lost_line(path: Path, holder: dict[str, Any]) -> str:
    return (
        f"the lock of {path.parent} was taken over by {_who(holder)} while this job ran (its heartbeat did not "
        f"reach the file for {LEASE_S:.0f} s, or the lock was deleted)"
    )


def _owner(path: Path, token: str) -> tuple[str, dict[str, Any] | None]:
    """("ours" | "theirs" | "missing" | "unreadable", the holder read): "theirs" only for a whole lock naming
    another token, the one answer that means the lock is lost."""
    try:
        holder = json.loads(path.read_bytes())
    except FileNotFoundError:
        return "missing", None
    except (OSError, ValueError):
        return "unreadable", None
    if not isinstance(holder, dict):
        return "unreadable", None
    return ("ours" if holder.get("token") == token else "theirs"), holder


# ---- the locks of this process's runs --------------------------------------------------------------------------------
_held: dict[Path, list[RunLock]] = {}
_watched: dict[Path, _Follower] = {}


def _key(run_dir: Path) -> Path:
    return Path(run_dir).expanduser().absolute()


def checkpoint_folder_outside(run_dir: Path, checkpoint_dir: str) -> Path | None:
    """The checkpoint folder when it lies outside the run folder (an absolute path or a link elsewhere): it gets
    its own lock, so two runs never share it. None when the run's lock covers it."""
    run = _key(run_dir)
    folder = run / Path(checkpoint_dir).expanduser()
    try:
        folder.resolve().relative_to(run.resolve())
        return None
    except ValueError:
        return folder


def take(run_dir: Path, checkpoint_dir: str | None = None) -> list[RunLock]:
    """The locks of a run (its folder's, and its checkpoint folder's when that lies outside), held by this
    process: taken now, or the ones this process took already (the pre-flight takes them before Hydra writes the
    run's record; run_job then finds them held)."""
    key = _key(run_dir)
    if key in _held:
        return _held[key]
    locks = [RunLock(key)]
    outside = checkpoint_folder_outside(key, checkpoint_dir) if checkpoint_dir is not None else None
    if outside is not None:
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
            return _lost_line(path, holder or {})
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
                    self.lost = _lost_line(path, holder or {})
