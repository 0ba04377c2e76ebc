"""One writer per preprocessed corpus: the first process to want a cache directory builds it; the others wait for its
completion marker (meta.json) and reuse it, however many processes, ranks or jobs ask at once.

The lock is a file beside the cache directory, created with O_EXCL (atomic on local filesystems and NFS v3+), holding
its writer's host and pid; the writer touches it every few seconds. A lock is stale - and the next process takes the
work over - when its writer is gone: on the same host, its pid no longer runs (or now names a process that started at
another time); from another host, its heartbeat has not moved for STALE_S by the waiter's own clock (clocks of different
hosts are never compared). The touch and both checks are shardlab.jobs.run_lock's, shared with the run folder's lock.
Each filesystem has its own lock, so with node-local caches every node has one writer. A writer whose build fails leaves
its error beside the cache (``<cache>.failed``) for the processes that were waiting for it.

The lock saves work; it is not what keeps a cache whole. binarize writes into a private temporary directory and
publishes it with one rename, which fails when the directory is already there: in the rare race where two processes
both judge a lock stale and both build, the first rename wins and the second keeps the first one's files.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from shardlab.errors import DataError
from shardlab.files.durable import write_json_atomic
from shardlab.files.liveness import HeartbeatWatch, process_alive, process_start, touch
from shardlab.files.regular_file import MiB, NotAFile, read_json_file

HEARTBEAT_S = 5.0
"""How often a writer touches its lock."""
STALE_S = 60.0
"""A lock whose heartbeat a waiter has not seen move for this long belongs to a writer that died (or a lost node)."""
POLL_S = 0.5


def lock_path(out: Path) -> Path:
    return out.with_name(out.name + ".lock")


def failure_path(out: Path) -> Path:
    """The last failed build's writer and error, which the processes that waited for that writer stop with."""
    return out.with_name(out.name + ".failed")


def temp_prefix(out: Path, host: str | None = None, pid: int | None = None) -> str:
    """The name prefix of a writer's temporary directory, so a writer taking over can remove a dead one's."""
    return f"{out.name}.tmp-{host or socket.gethostname()}-{pid or os.getpid()}-"


def build_once(out: Path, build: Callable[[], None], say: Callable[[str], None] = print) -> None:
    """Make sure ``out`` holds a finished cache (``out/meta.json``): build it here with ``build()``, or wait for the
    process already building it. A build that raises leaves no lock behind, and a note of its error: the processes
    that were waiting for it raise that error too (each would otherwise build again in turn and fail the same way,
    ranks x the build's time), while a process that comes later builds again."""
    while not _done(out):
        with _acquire(out) as mine:
            if mine:
                if not _done(out):  # finished between our check and our lock
                    build()
                    failure_path(out).unlink(missing_ok=True)
                return
        owner, stale = _wait_for_writer(out, say)
        if stale is not None:
            _break(out, owner, stale)
        # else the writer finished or failed: check again, and take the lock if it is free


def _done(out: Path) -> bool:
    return (out / "meta.json").is_file()


@contextlib.contextmanager
def _acquire(out: Path) -> Iterator[bool]:
    """Yields True holding the lock (heartbeat running, lock removed on exit), or False when another process holds
    it."""
    lock = lock_path(out)
    try:
        lock.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        yield False
        return
    except OSError as e:
        raise DataError(
            f"data.cache_dir: cannot write {lock} to preprocess the corpus there ({e.strerror or e}); choose a "
            "writable data.cache_dir (shardlab-preprocess: --cache-dir)"
        ) from None
    token = {"host": socket.gethostname(), "pid": os.getpid(), "pid_start": process_start(os.getpid()),
             "started": time.time()}  # fmt: skip
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps(token))
    stop = threading.Event()
    beat = threading.Thread(target=_heartbeat, args=(lock, stop), daemon=True, name="cache-lock-heartbeat")
    beat.start()
    try:
        yield True
    except Exception as e:  # not an interrupt: the waiters take over then, as from a writer that died
        note = {**token, "error": str(e) if isinstance(e, DataError) else f"{type(e).__name__}: {e}"}
        with contextlib.suppress(OSError):
            write_json_atomic(failure_path(out), note)
        raise
    finally:
        stop.set()
        beat.join()
        if _read(lock) == token:  # never remove a lock that a process taking over from us now holds
            lock.unlink(missing_ok=True)


def _heartbeat(lock: Path, stop: threading.Event) -> None:
    while not stop.wait(HEARTBEAT_S):
        with contextlib.suppress(OSError):
            touch(lock)


LOCK_MAX_BYTES = MiB
"""A lock or failure note is a line of JSON (host, pid, a message); more is not one shardlab wrote."""


def _read(lock: Path) -> dict | None:
    """The lock's (or failure note's) JSON object through the one reader; None when gone or still being written by
    its creator. A FIFO, a device, a link or a file past the cap under its name is refused (a FIFO blocked the reader
    for ever): DataError, naming it."""
    try:
        owner = read_json_file(lock, max_bytes=LOCK_MAX_BYTES)
    except NotAFile as e:
        raise DataError(f"{lock} {e.reason}; delete it (it is no lock shardlab wrote)") from None
    except (OSError, ValueError):
        return None
    return owner if isinstance(owner, dict) else None


def _wait_for_writer(out: Path, say: Callable[[str], None]) -> tuple[dict, str | None]:
    """Wait while the lock's writer is alive: returns (its owner, None) when the lock is gone or the cache finished,
    (owner, why) once the writer is judged dead; raises the writer's error when its build failed."""
    lock = lock_path(out)
    watch, owner, announced = HeartbeatWatch(), {}, False
    while not _done(out):
        try:
            beat = lock.stat().st_mtime_ns
        except FileNotFoundError:
            failure = _read(failure_path(out)) or {}
            if owner and all(failure.get(k) == owner.get(k) for k in ("host", "pid", "started")):
                raise DataError(
                    f"preprocessing {out} failed in {owner.get('host')} pid {owner.get('pid')}, which this process "
                    f"waited for: {failure.get('error')}"
                ) from None
            break
        owner = _read(lock) or {}
        if owner.get("host") == socket.gethostname() and isinstance(owner.get("pid"), int):
            if not process_alive(owner["pid"], owner.get("pid_start")):  # a reused pid is not the writer
                return owner, "its process is gone"
        if watch.see(beat) > STALE_S:  # the mtime the writer touches, timed on this process's clock
            return owner, f"no heartbeat for {STALE_S:.0f} s"
        if not announced and owner:
            say(f"waiting for {owner.get('host')} pid {owner.get('pid')}, which is preprocessing {out}")
            announced = True
        time.sleep(POLL_S)
    return owner, None


def _break(out: Path, owner: dict, why: str) -> None:
    """Set a dead writer's lock aside (one rename: of several waiters only one succeeds) and remove its temporary
    directory."""
    lock = lock_path(out)
    aside = lock.with_name(f"{lock.name}.stale-{socket.gethostname()}-{os.getpid()}")
    try:
        os.rename(lock, aside)
    except FileNotFoundError:
        return  # another waiter took it over first
    aside.unlink(missing_ok=True)
    print(
        f"preprocessing of {out} by {owner.get('host')} pid {owner.get('pid')} stopped ({why}); taking it over",
        flush=True,
    )
    if owner.get("host") and owner.get("pid"):
        for tmp in out.parent.glob(temp_prefix(out, owner["host"], owner["pid"]) + "*"):
            shutil.rmtree(tmp, ignore_errors=True)
