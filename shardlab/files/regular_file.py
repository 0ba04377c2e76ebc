"""Untrusted files opened as files: a regular file, or a one-line refusal saying what the path is instead.

The project's rule for a file someone else may have put there (a step folder someone shared, a run's lock, a corpus, a
model.pretrained file): read it as a file, no symlink out of its folder, no FIFO or device, bounded size, linear time.
Such a path may hold anything under a file's name: a symbolic link out of the folder (``.metadata -> /dev/zero`` grew
a reader to 2.5 GB in 12 s), a FIFO (a reader blocks in ``open`` for ever), a socket, a name the file system refuses
(300 characters, a link loop). ``open_file`` is the one place that opens such a path: without following a link
(``O_NOFOLLOW``) and without blocking (``O_NONBLOCK``: a FIFO opens at once), then ``fstat`` on the open descriptor
says what it is: a regular file no larger than the caller's cap, or ``NotAFile`` naming what it is (``kind_of``, the
one namer of a file's kind). A file the user named outright may be reached through a link (``follow_links``): the link
is resolved first, optionally kept inside a ``root`` folder (a corpus), and the real path opened the same way;
``read_file`` reads a file whole, capped (the run lock), ``read_small_file`` a small file of such a folder (a Hugging
Face model folder's JSON). ``stat_file`` probes a path with the same refusals without opening it. Callers word the
refusal in their own error type (the run lock's NotALock, the corpus's DataError, model.pretrained's CheckpointError);
a step folder's files use the CheckpointError API below it (``open_regular``, ``read_regular``, ``read_at``).
Torch-free: layout, the jobs' lock and status.json and the corpus workers import it, from shardlab.files, the floor
below all of them.
"""

from __future__ import annotations

import errno
import json
import os
import stat
from pathlib import Path

from shardlab.errors import CheckpointError, UnsafeCheckpointError

MiB = 2**20
LINK = "a symbolic link"
"""``NotAFile.kind`` of a link that was not followed (or that leads out of its root)."""


class NotAFile(Exception):
    """``path`` was not opened as a file: ``kind`` says what it is ("a FIFO", "a folder", LINK); ``size`` (with
    ``cap``) is set for a regular file past the cap, ``real`` (with ``root``) for a link leading out of its root.
    ``str()`` is a one-line reason, the end of a sentence that starts with the path."""

    def __init__(self, path: Path, kind: str, *, size: int | None = None, cap: int | None = None,
                 real: Path | None = None, root: Path | None = None) -> None:  # fmt: skip
        self.path, self.kind, self.size, self.cap, self.real, self.root = Path(path), kind, size, cap, real, root
        super().__init__(self.reason)

    @property
    def reason(self) -> str:
        if self.real is not None:
            return f"is a link to {self.real}, outside {self.root}"
        if self.size is not None:
            return f"holds {self.size} bytes, more than the {self.cap} allowed"
        return f"is {self.kind}, not a regular file"


def kind_of(mode: int) -> str:
    """What a path is, in words, from its ``st_mode`` (an lstat's: a link is named too): the one namer of a kind."""
    kinds = ((stat.S_ISREG, "a regular file"), (stat.S_ISLNK, LINK), (stat.S_ISDIR, "a folder"),
             (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
             (stat.S_ISBLK, "a block device"))  # fmt: skip
    return next((name for test, name in kinds if test(mode)), "not a file")


def real_path(path: Path, root: Path | None = None) -> Path:
    """``path`` with its links resolved, which must lie inside ``root`` when one is given (the rule for a link among a
    corpus's files: followed while it stays in the folder); NotAFile (``real`` set) when it leads out."""
    real = Path(os.path.realpath(path))
    if root is not None and not real.is_relative_to(os.path.realpath(root)):
        raise NotAFile(path, LINK, real=real, root=root)
    return real


def open_file(
    path: Path, *, max_bytes: int | None = None, follow_links: bool = False, root: Path | None = None
) -> tuple[int, os.stat_result]:
    """An open read-only descriptor of the regular file ``path`` and its fstat; the caller closes it. A link is not
    followed (NotAFile, LINK), unless ``follow_links`` or ``root``: then it is resolved first (``real_path``) and the
    real path opened, so a loop or a link put there since is an OSError. A path that is something else, or a file
    over ``max_bytes``, raises NotAFile; an OSError the path's kind does not explain (missing, unreadable, a name too
    long) passes through for the caller to word."""
    follow = follow_links or root is not None
    target = real_path(path, root) if follow else Path(path)
    try:
        fd = os.open(target, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        kind = _kind_by_name(target)  # a socket cannot be opened at all, a link not without following it
        if kind is not None and not (follow and kind == LINK):
            raise NotAFile(path, kind) from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise NotAFile(path, kind_of(st.st_mode))
        if max_bytes is not None and st.st_size > max_bytes:
            raise NotAFile(path, kind_of(st.st_mode), size=st.st_size, cap=max_bytes)
    except BaseException:
        os.close(fd)
        raise
    return fd, st


def stat_file(
    path: Path, *, max_bytes: int | None = None, follow_links: bool = False, root: Path | None = None
) -> os.stat_result:
    """The lstat of the regular file ``path``, with ``open_file``'s keywords and refusals, WITHOUT opening it: a probe
    for a reader that opens the file by name itself (safetensors, pyarrow) or later (a shard's size). Opening costs
    ~3x an lstat locally and more round trips on NFS/Lustre, and would open what a shared folder names before it is
    refused; the real read goes through ``open_file``, whose fstat checks again what the file has become since."""
    follow = follow_links or root is not None
    target = real_path(path, root) if follow else Path(path)
    st = os.lstat(target)
    if follow and stat.S_ISLNK(st.st_mode):  # realpath leaves a link only in a loop (or one made since): as O_NOFOLLOW
        raise OSError(errno.ELOOP, os.strerror(errno.ELOOP), str(path))
    if not stat.S_ISREG(st.st_mode):
        raise NotAFile(path, kind_of(st.st_mode))
    if max_bytes is not None and st.st_size > max_bytes:
        raise NotAFile(path, kind_of(st.st_mode), size=st.st_size, cap=max_bytes)
    return st


SMALL_FILE_MAX_BYTES = 16 * MiB
"""The cap of ``read_small_file``: a model folder's JSON (config.json, tokenizer_config.json, a safetensors index)."""


def read_file(path: Path, *, max_bytes: int, follow_links: bool = False) -> tuple[bytes, os.stat_result]:
    """The whole of the regular file ``path`` and its fstat, opened as ``open_file`` opens it and read no further than
    ``max_bytes`` (a file grown past the cap since its fstat is refused too, NotAFile with ``size``). NotAFile and
    OSError pass through for the caller to word."""
    fd, st = open_file(path, max_bytes=max_bytes, follow_links=follow_links)
    try:
        chunks, held = [], 0
        # Asked for no more than the file said it holds (+1 to see it grew) and 64 MiB at a time: os.read allocates
        # what it is asked for, so asking for the cap put a 1 GiB buffer behind every 1 KiB tokenizer.json read.
        while chunk := os.read(fd, min(max_bytes + 1 - held, max(st.st_size + 1 - held, 1 << 16), 64 * MiB)):
            chunks.append(chunk)
            held += len(chunk)
            if held > max_bytes:
                raise NotAFile(path, kind_of(st.st_mode), size=held, cap=max_bytes)
        return b"".join(chunks), st
    finally:
        os.close(fd)


def read_small_file(path: Path, *, max_bytes: int = SMALL_FILE_MAX_BYTES) -> bytes:
    """The whole of a small file of a folder the user named (a Hugging Face model folder), as ``read_file`` reads it:
    links followed, as a Hugging Face cache's snapshots/ link into its blobs/ (a sibling folder: no root), but the
    target must be a regular file of at most ``max_bytes``."""
    return read_file(path, max_bytes=max_bytes, follow_links=True)[0]


def read_json_file(path: Path, *, max_bytes: int, follow_links: bool = False) -> object:
    """The JSON value of the regular file ``path``, read as ``read_file`` reads it (a cache's plan, record or manifest,
    a tokenizer_config.json): NotAFile, OSError and ValueError (not JSON, not UTF-8) pass through for the caller to
    word."""
    return json.loads(read_file(path, max_bytes=max_bytes, follow_links=follow_links)[0])


def read_json_or_none(path: Path, *, max_bytes: int = SMALL_FILE_MAX_BYTES) -> object | None:
    """The JSON value of a small file an earlier shardlab process wrote (a run folder's tracker ids, a rank's error
    note, an autotune decision, a cache of measured rates), or None when it cannot be read as one: missing, not a
    regular file (a FIFO is not waited on, a link is not followed), past ``max_bytes``, or not JSON. For readers whose
    answer to a damaged file is "as if absent"."""
    try:
        return read_json_file(path, max_bytes=max_bytes)
    except (NotAFile, OSError, ValueError):
        return None


def _kind_by_name(path: Path) -> str | None:
    """The kind of what ``path`` names itself (not followed), if it is no regular file; None if it cannot be told."""
    try:
        mode = os.lstat(path).st_mode
    except OSError:
        return None
    return None if stat.S_ISREG(mode) else kind_of(mode)


# ---- a step folder's files: CheckpointError on any refusal -----------------------------------------------------------
LINK_IN_FOLDER = "is a symbolic link (or a loop of them), not a regular file of its folder"


def describe_os_error(path: Path, error: OSError) -> str:
    """An OSError on ``path`` as the end of one line: what happened, never the raw traceback's repr."""
    if error.errno == errno.ELOOP:
        return LINK_IN_FOLDER
    if error.errno == errno.ENAMETOOLONG:
        return "has a name longer than the file system allows"
    reason = error.strerror or type(error).__name__
    return f"is unreadable ({reason})"


def open_regular(path: Path, *, max_bytes: int | None = None) -> tuple[int, int]:
    """An open descriptor of ``path`` and its size, as ``open_file`` opens it (no link followed). FileNotFoundError
    passes through (callers name what was missing); anything else is a CheckpointError, or an UnsafeCheckpointError
    for a link, a device, a FIFO or a file past its format's cap."""
    try:
        fd, st = open_file(path, max_bytes=max_bytes)
    except FileNotFoundError:
        raise
    except NotAFile as e:
        raise UnsafeCheckpointError(f"{_shown(path)} {_refusal(e)}; refused") from None
    except OSError as e:
        kind = UnsafeCheckpointError if e.errno == errno.ELOOP else CheckpointError
        raise kind(f"{_shown(path)} {describe_os_error(path, e)}; refused") from None
    return fd, st.st_size


def _refusal(e: NotAFile) -> str:
    if e.size is not None:
        return f"holds {e.size} bytes, more than the {e.cap} its format allows"
    if e.kind == LINK:
        return LINK_IN_FOLDER
    return f"is not a regular file ({e.kind})"


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


def _shown(path: Path) -> str:
    """A path in a message: a long name is cut, so the line stays one readable line."""
    text = str(path)
    return text if len(text) <= 300 and text.isprintable() else repr(text[:300]) + "..."
