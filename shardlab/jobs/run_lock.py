"""One run directory, one writer: a lock file that keeps a second job out of a run in use.

``run.lock`` in the run directory names its holder (job id, host, pid, the pid's start time) and a heartbeat that the
holder refreshes every HEARTBEAT_S seconds from a daemon thread. A start that finds the lock held refuses in one line
naming the other job, unless the lock is stale:

- it is this job's own: the same Slurm job id (a requeued job, perhaps on another node, whose previous run was killed
  before it could release the lock; Slurm never runs two incarnations of one job at once), or this very process;
- its holder was on this host and that process is gone (or the pid now belongs to another process);
- its heartbeat is older than LEASE_S: the holder's node died or lost the file system.

A new lock is created whole, holder and all (a hard link of a written file), so no job ever reads it empty, and only
by that exclusive create. Taking over a stale lock removes it first, and only the very file judged stale (renamed
aside and compared with what was judged): of two jobs that take over at once, however far apart, one removes it and
the other moves nothing or puts back what it moved, and then only one creates the new lock; the other finds that job
alive and refuses. Held by global rank 0 of a job (the launcher process of local ranks); released when the job ends,
including on a stop signal and its requeue.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from pathlib import Path
from typing import Any

from shardlab.errors import RunFolderInUse

LOCK_FILE = "run.lock"
HEARTBEAT_S = 30.0
"""How often the holder refreshes its heartbeat."""
LEASE_S = 300.0
"""A heartbeat older than this marks a holder as dead (its node went down); ten missed heartbeats, so a slow shared
file system or a loaded node never loses a live job its lock."""
TAKEOVER_TRIES = 5
UNREADABLE_WAIT_S = 0.2


def current_job() -> str | None:
    """The scheduler's id for this job, the same on every requeue: Slurm's (one per array task), submitit's local
    one, or torchrun's rendezvous id (elastic restarts keep it; its default "none" names nothing)."""
    for key in ("SLURM_JOB_ID", "SUBMITIT_LOCAL_JOB_ID"):
        if os.environ.get(key):
            return os.environ[key]
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    return f"torchelastic-{run_id}" if run_id and run_id != "none" else None


def _process_start(pid: int) -> str | None:
    """When ``pid`` started (clock ticks since boot, from /proc), so a reused pid is told from the holder."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _read_or_empty(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError:
        return b""


def _alive(pid: int, started: str | None) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # someone else's process: it exists
    return started is None or _process_start(pid) in (None, started)


class RunLock:
    def __init__(self, run_dir: Path) -> None:
        self.path = Path(run_dir) / LOCK_FILE
        self.me = {
            "job": current_job(),
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "pid_start": _process_start(os.getpid()),
            "token": f"{socket.gethostname()}:{os.getpid()}:{time.time_ns()}",
        }
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ---- acquire / release --------------------------------------------------------------------------------------
    def acquire(self) -> None:
        """Hold the lock, taking over a stale one; RunFolderInUse naming the holder otherwise."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        for _ in range(TAKEOVER_TRIES):
            if self._create():
                break
            holder, judged = self._read_judged()
            if holder is not None and (reason := self._live_holder(holder)):
                raise RunFolderInUse(reason) from None
            self._remove_if_unchanged(judged)  # stale, ours or unreadable: away with it, then create ours
        else:  # each try found a new stale lock: something keeps writing dead holders' locks here
            raise RunFolderInUse(f"{self.path} changed under every one of {TAKEOVER_TRIES} takeovers; {self._fix()}")
        self._thread = threading.Thread(target=self._beat, name="shardlab-run-lock", daemon=True)
        self._thread.start()

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self.held():
            self.path.unlink(missing_ok=True)

    def held(self) -> bool:
        """Whether the lock still names this process (another job may have taken it over, e.g. after our node froze
        past the lease)."""
        holder = self._read()
        return holder is not None and holder.get("token") == self.me["token"]

    # ---- helpers ------------------------------------------------------------------------------------------------
    def _read(self) -> dict[str, Any] | None:
        try:
            return json.loads(self.path.read_text())
        except (OSError, ValueError):
            return None

    def _read_judged(self) -> tuple[dict[str, Any] | None, bytes | None]:
        """The lock's holder (None if unreadable) and the bytes it was read from (None if the lock is gone; empty if
        it cannot be read at all). A lock that does not parse is read again after a moment: where hard links are
        missing, a lock is written after its exclusive create, and its creator may be writing it now."""
        for pause in (UNREADABLE_WAIT_S, 0.0):
            try:
                raw = self.path.read_bytes()
            except FileNotFoundError:
                return None, None
            except OSError:
                return None, b""
            try:
                return json.loads(raw), raw
            except ValueError:
                time.sleep(pause)
        return None, raw

    def _remove_if_unchanged(self, judged: bytes | None) -> None:
        """Remove the lock if it is still the file judged stale (the same bytes: a live holder's heartbeat rewrites
        it, and a new lock names another holder; an inode number would not do, as a removed file's is reused at
        once). It is renamed aside, atomically, so that of several jobs taking over only one gets it; a file another
        job created or beat since was moved by mistake and goes back (unless a third job created a lock meanwhile,
        whose lock then stands)."""
        if judged is None:
            return  # already gone: the next try creates it
        aside = self.path.with_name(f".{LOCK_FILE}.{os.getpid()}.{time.time_ns()}.stale")
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return  # another job removed it first
        try:
            if judged and _read_or_empty(aside) != judged:
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

    def _write(self) -> None:
        os.replace(self._written_tmp(), self.path)

    def _written_tmp(self) -> Path:
        """A temporary file beside the lock holding this job's details and a fresh heartbeat."""
        tmp = self.path.with_name(f".{LOCK_FILE}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({**self.me, "heartbeat": time.time()}))
        return tmp

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            if not self.held():
                print(f"[run] WARNING: {self.path} was taken over by another job; this job no longer holds it",
                      flush=True)  # fmt: skip
                return
            try:
                self._write()
            except OSError:
                pass  # a passing file-system error: the next beat tries again, well within the lease

    def _live_holder(self, holder: dict[str, Any]) -> str | None:
        """Why ``holder`` still holds the lock, as the one-line refusal; None if the lock is stale or ours."""
        if self.me["job"] is not None and holder.get("job") == self.me["job"]:
            return None  # this job's previous incarnation (a requeue), on whatever node
        if holder.get("host") == self.me["host"]:
            if holder.get("pid") == self.me["pid"] or not _alive(int(holder.get("pid", -1)), holder.get("pid_start")):
                return None
        age = time.time() - float(holder.get("heartbeat", 0))
        if age > LEASE_S:
            return None
        return self._describe(holder, f"last heartbeat {age:.0f} s ago")

    def _describe(self, holder: dict[str, Any], detail: str) -> str:
        job = f"job {holder['job']}" if holder.get("job") else "a job"
        return (
            f"{self.path.parent} is in use by {job} (host {holder.get('host', '?')}, pid {holder.get('pid', '?')}, "
            f"{detail}); {self._fix()}"
        )

    def _fix(self) -> str:
        return (
            f"wait for it to end or stop it, or choose another hydra.run.dir (a lock whose heartbeat is older than "
            f"{LEASE_S:.0f} s is taken over; delete {self.path} if that job is surely gone)"
        )
