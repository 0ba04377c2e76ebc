"""Files of a step folder or a run folder, opened as files: a regular file named in its folder, or refused.

A step folder someone shared (or a damaged one) may hold anything under a file's name: a symbolic link out of the
folder (``.metadata -> /dev/zero`` grew a reader to 2.5 GB in 12 s), a FIFO (a reader blocks in ``open`` for ever), a
name the file system refuses (300 characters, a link loop). Here a file is opened without following a link
(``O_NOFOLLOW``) and without blocking (``O_NONBLOCK``: a FIFO opens at once), then ``fstat`` on the open descriptor
says what it is: a regular file no larger than the cap its format implies, or a one-line refusal naming it. Every
``OSError`` becomes one line naming the file. Torch-free (layout and the jobs' status.json use it).
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

from shardlab.errors import CheckpointError, UnsafeCheckpointError

MiB = 2**20


def describe_os_error(path: Path, error: OSError) -> str:
    """An OSError on ``path`` as the end of one line: what happened, never the raw traceback's repr."""
    if error.errno == errno.ELOOP:
        return "is a symbolic link (or a loop of them), not a regular file of its folder"
    if error.errno == errno.ENAMETOOLONG:
        return "has a name longer than the file system allows"
    reason = error.strerror or type(error).__name__
    return f"is unreadable ({reason})"


def open_regular(path: Path, *, max_bytes: int | None = None) -> tuple[int, int]:
    """An open descriptor of ``path`` and its size: a regular file, not a link, at most ``max_bytes`` long.
    FileNotFoundError passes through (callers name what was missing); anything else is a CheckpointError, or an
    UnsafeCheckpointError for a link, a device, a FIFO or a file past its format's cap."""
    path = Path(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise
    except OSError as e:
        kind = UnsafeCheckpointError if e.errno == errno.ELOOP else CheckpointError
        raise kind(f"{_shown(path)} {describe_os_error(path, e)}; refused") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UnsafeCheckpointError(f"{_shown(path)} is not a regular file ({_kind(st.st_mode)}); refused")
        if max_bytes is not None and st.st_size > max_bytes:
            raise UnsafeCheckpointError(
                f"{_shown(path)} holds {st.st_size} bytes, more than the {max_bytes} its format allows; refused"
            )
        return fd, st.st_size
    except BaseException:
        os.close(fd)
        raise


def read_regular(path: Path, *, max_bytes: int) -> bytes:
    """The whole of ``path``, read through ``open_regular`` (so never more than ``max_bytes``)."""
    fd, size = open_regular(path, max_bytes=max_bytes)
    try:
        return read_at(fd, path, 0, size)
    finally:
        os.close(fd)


def read_at(fd: int, path: Path, offset: int, length: int) -> bytes:
    """``length`` bytes of the open file ``fd`` from ``offset``; a CheckpointError naming ``path`` if it holds fewer
    (cut short since its size was checked) or the read fails."""
    chunks, done = [], 0
    try:
        while done < length:
            chunk = os.pread(fd, min(length - done, 64 * MiB), offset + done)
            if not chunk:
                raise CheckpointError(f"{_shown(path)} ends at byte {offset + done}, before the {offset + length} read")
            chunks.append(chunk)
            done += len(chunk)
    except OSError as e:
        raise CheckpointError(f"{_shown(path)} {describe_os_error(path, e)}") from None
    return b"".join(chunks)


def read_into(fd: int, path: Path, offset: int, buffer: bytearray) -> None:
    """Fill ``buffer`` from the open file ``fd`` at ``offset`` (no copy beside it); errors as ``read_at``."""
    view, done = memoryview(buffer), 0
    try:
        while done < len(buffer):
            n = os.preadv(fd, [view[done : done + 64 * MiB]], offset + done)
            if not n:
                raise CheckpointError(
                    f"{_shown(path)} ends at byte {offset + done}, before the {offset + len(buffer)} read"
                )
            done += n
    except OSError as e:
        raise CheckpointError(f"{_shown(path)} {describe_os_error(path, e)}") from None


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket")):  # fmt: skip
        if test(mode):
            return name
    return "not a file"


def _shown(path: Path) -> str:
    """A path in a message: a long name is cut, so the line stays one readable line."""
    text = str(path)
    return text if len(text) <= 300 and text.isprintable() else repr(text[:300]) + "..."
