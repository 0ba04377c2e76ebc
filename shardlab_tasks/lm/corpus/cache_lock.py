"""One writer per preprocessed corpus: the first process to want a cache directory builds it; the others wait for its
completion marker (meta.json) and reuse it, however many processes, ranks or jobs ask at once.

The lock is filelock's SoftFileLease on a file beside the cache directory: a marker created with O_EXCL (atomic on
local filesystems and NFS v3+) holding its writer's host, pid and a claim token, which its heartbeat thread touches
every HEARTBEAT_S. A lock is stale - and the next process takes the work over - when its writer is gone: on the same
host, its pid no longer runs (or now names a process that started at another time); from another host, its marker has
not changed for STALE_S by the waiter's own clock (clocks of different hosts are never compared). An O_EXCL marker
rather than flock because flock is not there on every shared filesystem (Lustre without -o flock) and an NFS v3 flock
of a lost node is held until it reboots. Each filesystem has its own lock, so with node-local caches every node has
one writer. A writer whose build fails leaves its error beside the cache (``<cache>.failed``) for the processes that
were waiting for it.

The lock saves work; it is not what keeps a cache whole. binarize writes into a private temporary directory and
publishes it with one rename, which fails when the directory is already there: in the rare race where two processes
both judge a lock stale and both build, the first rename wins and the second keeps the first one's files.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
from collections.abc import Callable, Iterator
from pathlib import Path

from filelock import OwnerRecord, SoftFileLease, Timeout

from shardlab.errors import DataError
from shardlab.files.durable import write_json_atomic
from shardlab.files.regular_file import MiB, NotAFile, read_json_file

HEARTBEAT_S = 5.0
"""How often a writer touches its lock."""
STALE_S = 60.0
"""A lock whose marker a waiter has not seen change for this long belongs to a writer that died (or a lost node).
Every process that wants one cache must agree on it: filelock refuses a lease of another duration."""
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
    lease = _lease(out)
    waited: dict[str, OwnerRecord] = {}  # the writers seen holding the lock, by claim token
    holder, announced = None, False
    while not _done(out):
        holder = _note_holder(lease, waited)
        try:
            lease.acquire(timeout=POLL_S)
        except Timeout:
            if holder is not None and not announced:
                say(f"waiting for {holder.hostname} pid {holder.pid}, which is preprocessing {out}")
                announced = True
            continue
        except OSError as e:
            raise _unwritable(lock_path(out), e) from None
        _build_holding(out, build, lease, waited, holder)
        return


def _lease(out: Path) -> SoftFileLease:
    lock = lock_path(out)
    try:
        lock.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise _unwritable(lock, e) from None
    return SoftFileLease(lock, lease_duration=STALE_S, heartbeat_interval=min(HEARTBEAT_S, STALE_S / 3))


def _unwritable(lock: Path, e: OSError) -> DataError:
    return DataError(
        f"data.cache_dir: cannot write {lock} to preprocess the corpus there ({e.strerror or e}); choose a "
        "writable data.cache_dir (shardlab-preprocess: --cache-dir)"
    )


def _done(out: Path) -> bool:
    return (out / "meta.json").is_file()


@contextlib.contextmanager
def _holding(out: Path, lease: SoftFileLease) -> Iterator[None]:
    """Hold the acquired lease for the build, and release it however the build ends; a build that raises (not an
    interrupt: the waiters take over then, as from a writer that died) leaves its error for the waiters, under the
    lease's claim token, which is how they know it is their writer's."""
    token = lease.token
    try:
        yield
    except Exception as e:
        note = {"host": socket.gethostname(), "pid": os.getpid(), "token": token,
                "error": str(e) if isinstance(e, DataError) else f"{type(e).__name__}: {e}"}  # fmt: skip
        with contextlib.suppress(OSError):
            write_json_atomic(failure_path(out), note)
        raise
    finally:
        lease.release()


def _note_holder(lease: SoftFileLease, waited: dict[str, OwnerRecord]) -> OwnerRecord | None:
    """The writer holding the lock now, if any, noted among those this process waited for."""
    owner = lease.owner  # None when free, or its marker is still being written
    if owner is None or owner.token is None:
        return None
    waited.setdefault(owner.token, owner)
    return owner


def _build_holding(
    out: Path, build: Callable[[], None], lease: SoftFileLease, waited: dict, holder: OwnerRecord | None
) -> None:
    """With the lease acquired: stop with the error of a writer this process waited for, or build (unless that writer
    finished meanwhile); ``holder``, when set, is a writer filelock judged gone and took the lock from."""
    try:
        _raise_if_a_writer_failed(out, waited)
    except DataError:
        lease.release()
        raise
    with _holding(out, lease):
        if not _done(out):  # finished between our check and our lock
            if holder is not None:
                _took_over(out, holder, lease)
            build()
            failure_path(out).unlink(missing_ok=True)


LOCK_MAX_BYTES = MiB
"""A failure note is a line of JSON (host, pid, token, a message); more is not one shardlab wrote."""


def _raise_if_a_writer_failed(out: Path, waited: dict[str, OwnerRecord]) -> None:
    """Raise the error of a writer this process waited for, when its build failed. A FIFO, a device, a link or a file
    past the cap under the note's name is refused (a FIFO blocked the reader for ever): DataError, naming it."""
    if not waited:
        return
    note = failure_path(out)
    try:
        failure = read_json_file(note, max_bytes=LOCK_MAX_BYTES)
    except NotAFile as e:
        raise DataError(f"{note} {e.reason}; delete it (it is no note shardlab wrote)") from None
    except (OSError, ValueError):
        return
    if isinstance(failure, dict) and failure.get("token") in waited:
        raise DataError(
            f"preprocessing {out} failed in {failure.get('host')} pid {failure.get('pid')}, which this process "
            f"waited for: {failure.get('error')}"
        )


def _took_over(out: Path, writer: OwnerRecord, lease: SoftFileLease) -> None:
    """The writer this process waited for let go of the lock without finishing or failing: filelock judged it gone
    (its pid on this host, or its heartbeat from another) and gave the lock to this process. Remove its temporary
    directory, which binarize names by its host and pid."""
    mine = lease.owner
    same_host = mine is not None and mine.hostname == writer.hostname
    why = "its process is gone" if same_host else f"no heartbeat for {STALE_S:.0f} s"
    print(f"preprocessing of {out} by {writer.hostname} pid {writer.pid} stopped ({why}); taking it over", flush=True)
    host = socket.gethostname() if same_host else writer.hostname.split("?pidns-")[0]  # filelock's namespace mark
    for tmp in out.parent.glob(temp_prefix(out, host, writer.pid) + "*"):
        shutil.rmtree(tmp, ignore_errors=True)
