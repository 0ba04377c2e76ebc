"""What a run lock file says, and how it is read and worded: the one place that knows its format.

A lock names its holder (a JSON object: job id and restart count, host, pid, the pid's start time, a token, since
when); this job's own identity across requeues is ``current_restart`` with shardlab.distributed.env's ``current_job``.
The file is read as a file and nothing else (``read_lock``: never through a symlink, never waiting on a FIFO, a
regular file of at most MAX_LOCK_BYTES); content naming no holder is malformed (``holder_of`` answers None,
``malformed`` words the refusal). A holder's fields are untrusted text: ``field`` keeps them to one printable line.

shardlab.jobs.run_lock judges and changes locks by these; shardlab.jobs.run_folders reads a lock above a checkpoint
folder to say whose folder it is.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
from pathlib import Path
from typing import Any

from shardlab.files.regular_file import LINK, NotAFile, read_file

LOCK_FILE = "run.lock"
MAX_LOCK_BYTES = 4096
"""A lock is a few hundred bytes of JSON: more is not a lock, and is not read past this."""


# ---- who this job is -------------------------------------------------------------------------------------------------
def current_restart() -> int:
    """Which incarnation of the job this is: Slurm counts requeues (unset before the first), torchrun its restarts."""
    for key in ("SLURM_RESTART_COUNT", "TORCHELASTIC_RESTART_COUNT"):
        with contextlib.suppress(ValueError):
            return int(os.environ.get(key, ""))
    return 0


# ---- the file, read as a file ----------------------------------------------------------------------------------------
class NotALock(OSError):
    """A lock path that holds no lock file: a symlink, a FIFO, a device, a folder, or a file over MAX_LOCK_BYTES."""


def read_lock(path: Path) -> tuple[bytes, int]:
    """A lock's bytes and its heartbeat (its mtime), from one open file: the same file's both, however its name
    moves, and fresh on NFS (opening a file revalidates the attributes that a stat by name may take from a cache).
    Opened as a file and nothing else (shardlab.files.regular_file): never through a symlink, never waiting on a
    FIFO's writer, a regular file only, at most MAX_LOCK_BYTES read (however it grows after its fstat); anything
    else raises NotALock saying what it is."""
    try:
        data, info = read_file(path, max_bytes=MAX_LOCK_BYTES)
    except NotAFile as e:
        code = errno.EFBIG if e.size is not None else errno.ELOOP if e.kind == LINK else errno.EINVAL
        raise NotALock(code, f"{_what(e)}, not a lock file") from None
    return data, info.st_mtime_ns


def _what(refused: NotAFile) -> str:
    return f"over {MAX_LOCK_BYTES} bytes" if refused.size is not None else refused.kind


def read_lock_or_none(path: Path) -> tuple[bytes, int] | None:
    try:
        return read_lock(path)
    except OSError:
        return None


def holder_of(data: bytes) -> dict[str, Any] | None:
    """The holder a lock's bytes name, or None if they are not a lock (shardlab writes a JSON object with a string
    token, whole: anything else was written by something else, or by a creator without hard links, mid-write)."""
    try:
        holder = json.loads(data)
    except (ValueError, RecursionError):
        return None
    return holder if isinstance(holder, dict) and isinstance(holder.get("token"), str) else None


def malformed(path: Path, why: str, data: bytes = b"") -> str:
    """The refusal of a lock that is not one: its path, what it is, the start of its content, the fix."""
    excerpt = f": {data[:60]!r}{'...' if len(data) > 60 else ''}" if data or not why else ""
    return (
        f"{path} is malformed ({why or 'not a JSON object naming a holder'}{excerpt}); shardlab creates its locks "
        f"whole, so this job cannot tell whose it is and leaves it alone: remove it if no job uses {path.parent}, "
        "then start again"
    )


# ---- a holder in words -----------------------------------------------------------------------------------------------
def field(holder: dict[str, Any], key: str) -> str:
    """A holder's field for a message: one line, at most 64 characters (a lock's content is not trusted)."""
    value = holder.get(key)
    text = "?" if value is None else "".join(c if c.isprintable() else "?" for c in str(value))
    return text[:64]


def who(holder: dict[str, Any]) -> str:
    job = f"job {field(holder, 'job')}" if holder.get("job") else "a job"
    restart = f", restart {holder['restart']}" if holder.get("job") and type(holder.get("restart")) is int else ""
    return f"{job} (host {field(holder, 'host')}, pid {field(holder, 'pid')}{restart})"


def lost_line(path: Path, holder: dict[str, Any]) -> str:
    """What happened, as the new holder's lock records it: who, and since when by that job's own host's clock (never
    compared with this host's)."""
    since = (
        f"since {field(holder, 'since')} by its host's clock"
        if holder.get("since")
        else "since a time it does not record"
    )
    return (
        f"the lock of {path.parent} was taken over by {who(holder)}, which holds it {since}; this job no longer "
        "writes, publishes or prunes there"
    )
