"""What the corpus readers share: a corpus file (``Source``), a piece read from it (``Block``), an optional package
asked for by name (``require``), and the one way a corpus file is opened (``open_regular``).

A leaf: shardlab_tasks/lm/corpus/corpus.py (text and JSONL, and finding the files) and
shardlab_tasks/lm/corpus/columnar.py (Parquet and Arrow) both import it, and it imports neither, so the two readers
never need each other. Nothing here imports torch.

A corpus file is opened as a file, never as whatever the name points at (shardlab.files.regular_file, the one
place that opens an untrusted file): the link it may be is resolved and must stay inside the corpus folder
(``Source.root``), it is opened without blocking (a FIFO would wait for a writer for ever) and must then be a regular
file (``/dev/zero`` would never end); here every refusal and OSError becomes one DataError line naming it.
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass
from pathlib import Path

from shardlab.errors import DataError
from shardlab.files import regular_file
from shardlab.files.regular_file import NotAFile

COLUMNAR_SUFFIXES = {".parquet": "parquet", ".arrow": "arrow"}
EXTRA = "pip install 'shardlab[corpora]'"
FIX_LINK = "copy the file into the corpus folder, or point data.path at it"


@dataclass(frozen=True)
class Source:
    path: Path
    rel: str
    """Path relative to the corpus root: what the train/valid split hashes, so it survives moving the corpus."""
    format: str = "text"
    """text (the file is one document), jsonl (a line is one), parquet or arrow (a row is one)."""
    compression: str = ""
    """gz or zst for a compressed text or JSONL file ('' otherwise; Parquet and Arrow compress inside)."""
    root: Path | None = None
    """The corpus folder a link among its files may not leave (None: a file list shardlab made, e.g. the stdlib's)."""

    @property
    def records(self) -> bool:
        """Whether the file holds one document per line or row (not one document in all)."""
        return self.format != "text"

    @property
    def columnar(self) -> bool:
        return self.format in COLUMNAR_SUFFIXES.values()

    @property
    def split_key(self) -> str:
        """What the train/valid split hashes (with the line or row number of a record): the relative path less a
        compression suffix, so compressing a file keeps its split; a Parquet or Arrow file's as if it were the JSONL
        file of the same name, so a corpus converted between those formats keeps its validation documents."""
        rel = self.rel[: self.rel.rfind(".")] if self.compression else self.rel
        return rel[: rel.rfind(".")] + ".jsonl" if self.columnar else rel


@dataclass
class Block:
    source: Source
    index: int
    """Block number within its file (0 first)."""
    first_line: int
    """1-based number of the block's first line (a Parquet or Arrow file's: first row), for split keys and errors."""
    data: bytes
    """The block's bytes (text, or JSONL lines); empty for Parquet and Arrow, whose documents are in ``texts``."""
    last: bool = False
    """The file's final block: a text file's document ends here."""
    texts: list[str] | None = None
    """The documents of a Parquet or Arrow block, one per row."""
    size: int = -1
    """Bytes of text the block holds (-1: len(data))."""

    def __post_init__(self) -> None:
        if self.size < 0:
            self.size = len(self.data)


def require(module: str, what: str):
    """``module`` imported, or a one-line DataError naming the files that need it and the extra that installs it."""
    try:
        return importlib.import_module(module)
    except ImportError:
        package = module.split(".")[0]
        raise DataError(f"data.path: {what} needs the {package} package, which is not installed: {EXTRA}") from None


def refused(path: Path, refusal: NotAFile) -> DataError:
    """A corpus file that shardlab.files.regular_file would not open, as the one line that names it."""
    if refusal.real is not None:
        return DataError(f"{path} is a link to {refusal.real}, outside the corpus folder {refusal.root}; {FIX_LINK}")
    return DataError(f"{path} is {refusal.kind}, not a regular file; a corpus holds files: remove it from data.path")


def identity_of(path: Path, root: Path | None) -> tuple[int, int]:
    """(device, inode) of a corpus file, checked as ``open_regular`` opens it (a link in it resolved, and kept
    inside ``root``): a file reached by two names is one file."""
    try:
        st = regular_file.stat_file(path, root=root, follow_links=True)
    except NotAFile as e:
        raise refused(path, e) from None
    except OSError as e:
        raise DataError(f"{path}: cannot be read ({e.strerror or e}); check it, or remove it from data.path") from None
    return st.st_dev, st.st_ino


def open_regular(path: Path, root: Path | None = None) -> int:
    """A file descriptor of the regular file ``path`` (a link in it resolved, and kept inside ``root``), opened
    without blocking: anything else is a one-line DataError naming it. The caller closes it."""
    try:
        return regular_file.open_file(path, root=root, follow_links=True)[0]
    except NotAFile as e:
        raise refused(path, e) from None
    except OSError as e:
        raise DataError(
            f"{path}: cannot be opened ({e.strerror or e}); check it, or remove it from data.path"
        ) from None


def open_file(path: Path, root: Path | None = None):
    """``path`` opened for reading in binary as ``open_regular`` opens it (a buffered file object)."""
    return os.fdopen(open_regular(path, root), "rb")


def regular_path(path: Path, root: Path | None = None) -> Path:
    """The real path of ``path`` once ``open_regular`` accepts it: for readers that open a path themselves (pyarrow,
    to memory-map it)."""
    os.close(open_regular(path, root))
    try:
        return regular_file.real_path(path, root)
    except NotAFile as e:  # a link in it re-pointed out of the folder since it was opened: the same one line
        raise refused(path, e) from None


def read_small(path: Path, root: Path | None, cap: int) -> str:
    """A small UTF-8 file of the corpus (a dataset's state.json), opened as ``open_regular`` opens it; more than
    ``cap`` bytes is refused."""
    with open_file(path, root) as f:
        try:
            data = f.read(cap + 1)
        except OSError as e:
            raise DataError(f"{path}: cannot be read ({e.strerror or e}); check it") from None
    if len(data) > cap:
        raise DataError(f"{path} holds more than {cap:,} bytes, more than such a file ever does; remove it")
    return data.decode("utf-8", errors="replace")
