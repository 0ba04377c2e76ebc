"""Corpus inputs, read as a stream of ~1 MB blocks: text files, JSONL, Parquet and Arrow files, directories and globs
of them, text and JSONL compressed with gzip or zstd.

A text file is one document; it is read in blocks cut at line ends, so one 50 GB file streams like many small ones.
A JSONL file holds one document per line (the ``text_field`` of each JSON object); its blocks hold whole lines.
A Parquet or Arrow file (tasks/lm/columnar.py) holds one document per row (the column ``text_field``).
Nothing here imports torch or tokenizers: worker processes import this module and stay light; pyarrow and
zstandard (the ``corpora`` extra) are imported only when a corpus has such files.
"""

from __future__ import annotations

import glob
import gzip
import io
import json
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from shardlab.errors import DataError

TEXT_SUFFIXES = {".txt", ".md", ".rst", ".py", ".text", ".json", ".csv", ".tex", ".html", ".c", ".h", ""}
JSONL_SUFFIXES = {".jsonl", ".ndjson"}
COLUMNAR_SUFFIXES = {".parquet": "parquet", ".arrow": "arrow"}
COMPRESSIONS = {".gz": "gz", ".zst": "zst", ".zstd": "zst"}
GLOB_CHARS = "*?["
BLOCK_BYTES = 1 << 20
"""Bytes read per block: large enough to amortize a worker round trip, small enough that blocks in flight stay MBs."""
FIX_FIELD = "name the text field with data.text_field (tools/preprocess_lm.py: --text-field)"


@dataclass(frozen=True)
class Source:
    path: Path
    rel: str
    """Path relative to the corpus root: what the train/valid split hashes, so it survives moving the corpus."""
    format: str = "text"
    """text (the file is one document), jsonl (a line is one), parquet or arrow (a row is one)."""
    compression: str = ""
    """gz or zst for a compressed text or JSONL file ('' otherwise; Parquet and Arrow compress inside)."""

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


def _kind(path: Path) -> tuple[str, str] | None:
    """(format, compression) for a corpus file name, or None when it is no corpus file."""
    compression = COMPRESSIONS.get(path.suffix.lower(), "")
    suffix = Path(path.stem).suffix.lower() if compression else path.suffix.lower()
    if suffix in COLUMNAR_SUFFIXES and not compression:
        return COLUMNAR_SUFFIXES[suffix], ""
    if suffix in JSONL_SUFFIXES:
        return "jsonl", compression
    if suffix in TEXT_SUFFIXES:
        return "text", compression
    return None


def glob_root(path: Path) -> Path:
    """The folder a glob pattern starts in (``/data/*/train-*.parquet``: ``/data``); ``path`` itself if no glob."""
    parts = path.parts
    plain = next((i for i, part in enumerate(parts) if any(c in part for c in GLOB_CHARS)), len(parts))
    return Path(*parts[:plain]) if plain < len(parts) else path


def _candidates(path: Path) -> tuple[Path, list[Path]]:
    """(the corpus root, the files under data.path, sorted): a file, a directory's files, or a glob's matches."""
    if not path.exists() and any(c in str(path) for c in GLOB_CHARS):
        matches = sorted(Path(p) for p in glob.glob(str(path), recursive=True))
        if not matches:
            raise DataError(f"data.path: {path} matches no file; check the pattern (** matches folders at any depth)")
        files = [f for m in matches for f in ([m] if m.is_file() else _files_under(m))]
        return glob_root(path), sorted(dict.fromkeys(files))
    if not path.exists():
        raise DataError(
            f"data.path: {path} does not exist; give a text, JSONL, Parquet or Arrow file,"
            " or a directory or glob of them"
        )
    return (path, _files_under(path)) if path.is_dir() else (path.parent, [path])


def _files_under(folder: Path) -> list[Path]:
    """A folder's files, sorted; in a folder holding a dataset saved by ``datasets``, only its Arrow files (its
    state.json and dataset_info.json describe it and are no text to train on)."""
    from tasks.lm import columnar

    datasets: dict[Path, list[Path] | None] = {}
    files = []
    for p in sorted(p for p in folder.rglob("*") if p.is_file() and not p.name.startswith(".")):
        if p.parent not in datasets:
            datasets[p.parent] = columnar.dataset_files(p.parent)
        if datasets[p.parent] is None or p in datasets[p.parent]:
            files.append(p)
    return files


def find_sources(path: Path) -> list[Source]:
    """Corpus files under ``path`` (a file, a directory or a glob), sorted; raises DataError naming the path if there
    are none, or naming the extra to install when they need a package that is not installed."""
    root, candidates = _candidates(path)
    sources = []
    for p in candidates:
        kind = _kind(p)
        if kind is None and p == path:
            kind = ("text", "")  # a file named explicitly is read as text whatever its name
        if kind is None:
            continue
        if kind[0] in COLUMNAR_SUFFIXES.values():
            from tasks.lm import columnar

            columnar.require("pyarrow", f"{p} (a {kind[0].capitalize()} file)")  # here: before any reading
            sources.append(Source(p, str(p.relative_to(root)), *kind))
        elif _looks_like_text(p, kind[1]):
            sources.append(Source(p, str(p.relative_to(root)), *kind))
    if not sources:
        raise DataError(
            f"data.path: {path} holds no text files (looked for {', '.join(sorted(TEXT_SUFFIXES - {''}))}, "
            f"{', '.join(sorted(JSONL_SUFFIXES))}, their .gz and .zst, .parquet, .arrow, and extensionless files of "
            "UTF-8 text); point it at your corpus"
        )
    return sources


def check_sources(sources: list[Source], field: str) -> None:
    """Refuse, in one line naming the file, a Parquet or Arrow file that cannot be opened or lacks the text column:
    before preprocessing starts, not hours into it (a damaged page inside a file is found when it is read)."""
    from tasks.lm import columnar

    for source in sources:
        if source.columnar:
            columnar.check(source, field)


class ZstdReader:
    """A .zst file's text, decompressed frame by frame. zstandard's own stream_reader returns what it has when the
    file ends inside a frame, so a truncated download would pass for a shorter corpus; this one raises EOFError then
    (as gzip does), and OSError for bytes that are not zstd."""

    CHUNK = 1 << 16
    """Compressed bytes fed at once: text expands ~3-10x, so each step decompresses well under a block."""

    def __init__(self, path: Path) -> None:
        from tasks.lm.columnar import require

        self.zstd = require("zstandard", f"{path} (a zstd file)")
        self.file = open(path, "rb")  # noqa: SIM115 (closed in close())
        self.dctx = self.zstd.ZstdDecompressor()
        self.frame = None  # the decompressobj of the frame being read; None between frames
        self.pending = b""  # compressed bytes past the end of the last frame, fed next
        self.out = bytearray()
        self.done = False
        self.error: Exception | None = None  # met while text before it was still to hand out: raised next read

    def _decompress_more(self) -> None:
        data, self.pending = self.pending or self.file.read(self.CHUNK), b""
        if not data:
            if self.frame is not None:
                raise EOFError("the file ends inside a zstd frame")
            self.done = True
            return
        if self.frame is None:
            self.frame = self.dctx.decompressobj()
        try:
            self.out += self.frame.decompress(data)
        except self.zstd.ZstdError as e:
            raise OSError(str(e)) from None
        if self.frame.eof:  # a file may hold several frames (pzstd, appended shards): go on with the next
            self.pending, self.frame = self.frame.unused_data, None

    def read(self, size: int = -1) -> bytes:
        if self.error is not None and not self.out:
            raise self.error
        while not self.done and self.error is None and (size < 0 or len(self.out) < size):
            try:
                self._decompress_more()
            except (EOFError, OSError) as e:
                if not self.out:
                    raise
                self.error = e  # hand out the text before the damage first, so the error can say which line it follows
        size = len(self.out) if size < 0 else size
        data = bytes(self.out[:size])
        del self.out[:size]
        return data

    def close(self) -> None:
        self.file.close()

    def __enter__(self) -> ZstdReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _open(path: Path, compression: str) -> io.BufferedIOBase | ZstdReader:
    if compression == "zst":
        return ZstdReader(path)
    return gzip.open(path, "rb") if compression else open(path, "rb")  # noqa: SIM115 (closed by the caller)


def _looks_like_text(path: Path, compression: str) -> bool:
    try:
        with _open(path, compression) as f:
            head = f.read(4096)
    except (OSError, EOFError, zlib.error) as e:
        if compression:  # its name says corpus: a damaged archive is an error, not a file to skip in silence
            raise DataError(f"{path}: {_damage(e, compression, 0)}; {FIX_DAMAGED}") from None
        return False
    if not head.strip() or b"\0" in head:
        return False
    try:
        head.decode("utf-8")
    except UnicodeDecodeError as e:
        return e.start > len(head) - 4  # a multi-byte character cut by the 4 KiB window is fine
    return True


def _utf8_cut(buf: bytes) -> int:
    """The length of the longest prefix of ``buf`` that ends on a whole UTF-8 character."""
    for back in range(1, min(4, len(buf)) + 1):
        byte = buf[-back]
        if byte & 0xC0 == 0x80:  # a continuation byte: look further back for its lead byte
            continue
        if byte >= 0xC0:  # a lead byte: keep its character only if all its bytes are here
            need = 2 if byte < 0xE0 else 3 if byte < 0xF0 else 4
            return len(buf) if back >= need else len(buf) - back
        break
    return len(buf)


FIX_DAMAGED = "download or compress it again, or remove it from data.path"


def _damage(error: BaseException, compression: str, whole_lines: int) -> str:
    """What is wrong with a compressed file, from the error its reader raised, and where."""
    where = f"after line {whole_lines:,} of its text" if whole_lines else "before the end of its first line"
    if isinstance(error, EOFError):
        return f"the file is cut short: it ends inside a compressed stream, {where}"
    return f"damaged: not readable as {'gzip' if compression == 'gz' else 'zstd'} ({error}), {where}"


def read_blocks(source: Source, block_bytes: int = BLOCK_BYTES, text_field: str = "text") -> Iterator[Block]:
    """The file's blocks, each ending at a line end (text without line ends: at a character boundary); a Parquet or
    Arrow file's hold whole rows (``text_field``: their text column)."""
    if source.columnar:
        from tasks.lm import columnar

        yield from columnar.read_blocks(source, text_field, block_bytes)
        return
    index, line, carry, pending = 0, 1, b"", None
    with _open(source.path, source.compression) as f:
        while True:
            try:
                data = f.read(block_bytes)
            except (OSError, EOFError, zlib.error) as e:  # gzip's BadGzipFile is an OSError
                whole_lines = line - 1 + carry.count(b"\n")
                raise DataError(
                    f"{source.path}: {_damage(e, source.compression, whole_lines)}; {FIX_DAMAGED}"
                ) from None
            buf = carry + data
            if not data:
                cut = len(buf)
            else:
                cut = buf.rfind(b"\n") + 1
                if cut == 0:
                    if source.records:  # a record is never split: keep reading to the end of its line
                        carry = buf
                        continue
                    cut = _utf8_cut(buf)
            if cut:
                if pending is not None:
                    yield pending
                pending = Block(source, index, line, buf[:cut])
                index += 1
                line += buf.count(b"\n", 0, cut)
            carry = buf[cut:]
            if not data:
                break
    if pending is not None:
        pending.last = True
        yield pending


def jsonl_text(line: bytes, path: Path, n: int, field: str) -> str:
    """The text of one JSONL record; a line that is not JSON or lacks the field is a DataError naming file:line."""
    try:
        record = json.loads(line)
    except ValueError as e:
        raise DataError(f"{path}:{n}: not a JSON object ({e}); fix or delete the line") from None
    if not isinstance(record, dict) or field not in record:
        keys = ", ".join(map(str, record)) if isinstance(record, dict) else type(record).__name__
        raise DataError(f"{path}:{n}: no {field!r} field (found: {keys}); {FIX_FIELD}")
    text = record[field]
    if not isinstance(text, str):
        raise DataError(f"{path}:{n}: field {field!r} is a {type(text).__name__}, not a string; fix the line")
    return text


def iter_texts(sources: list[Source], text_field: str, max_bytes: int) -> Iterator[str]:
    """Document texts (a text file's in ~1 MB blocks) from the start of the corpus, up to ``max_bytes`` of input."""
    read = 0
    for source in sources:
        for block in read_blocks(source, text_field=text_field):
            if block.texts is not None:
                yield from block.texts
            elif source.records:
                for n, line in enumerate(block.data.splitlines(), start=block.first_line):
                    if line.strip():
                        yield jsonl_text(line, source.path, n, text_field)
            else:
                yield block.data.decode("utf-8", errors="replace")
            read += block.size
            if read >= max_bytes:
                return
