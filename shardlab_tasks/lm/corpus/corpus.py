"""Corpus inputs, read as a stream of ~1 MB blocks: text files, JSONL, Parquet and Arrow files, directories and globs
of them, text and JSONL compressed with gzip or zstd.

A text file is one document; it is read in blocks cut at line ends, so one 50 GB file streams like many small ones.
A JSONL file holds one document per line (the ``text_field`` of each JSON object); its blocks hold whole lines.
A Parquet or Arrow file (shardlab_tasks/lm/corpus/columnar.py) holds one document per row (the column ``text_field``).
What the readers share (Source, Block, how a file is opened) is in shardlab_tasks/lm/corpus/sources.py; docs/corpora.md
says what a corpus reader refuses ("What a corpus reader refuses"). Nothing here imports torch or tokenizers: worker
processes import this module and stay light; pyarrow and zstandard (the ``corpora`` extra) are imported only when a
corpus has such files.
"""

from __future__ import annotations

import fnmatch
import functools
import gzip
import io
import json
import os
import re
import zlib
from collections.abc import Iterator
from pathlib import Path

from shardlab.errors import DataError
from shardlab_tasks.lm.corpus import columnar
from shardlab_tasks.lm.corpus.sources import COLUMNAR_SUFFIXES, Block, Source, identity_of, open_file, require

__all__ = ["Block", "Source", "check_sources", "find_sources", "glob_root", "iter_texts", "jsonl_text", "read_blocks"]

TEXT_SUFFIXES = {".txt", ".md", ".rst", ".py", ".text", ".json", ".csv", ".tex", ".html", ".c", ".h", ""}
JSONL_SUFFIXES = {".jsonl", ".ndjson"}
COMPRESSIONS = {".gz": "gz", ".zst": "zst", ".zstd": "zst"}
GLOB_CHARS = "*?["
BLOCK_BYTES = 1 << 20
"""Bytes read per block: large enough to amortize a worker round trip, small enough that blocks in flight stay MBs."""
MAX_RECORD_BYTES = 1 << 28
"""The longest record (JSONL line) a reader holds, 256 MiB: a longer one is refused naming its file and line, since
it is held whole to be parsed (a 4 MB .jsonl.gz can hold a 4 GiB line); data.max_corpus_mb, when lower, ends it
first."""
FIX_FIELD = "name the text field with data.text_field (shardlab-preprocess: --text-field)"


def _format_of(path: Path) -> tuple[str, str] | None:
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
    if not path.exists() and not path.is_symlink() and any(c in str(path) for c in GLOB_CHARS):
        root = glob_root(path)
        matches = _glob(root, path.relative_to(root).parts)
        if not matches:
            raise DataError(f"data.path: {path} matches no file; check the pattern (** matches folders at any depth)")
        files = [f for m, folder in matches for f in (_files_under(m, root) if folder else [m])]
        return root, sorted(dict.fromkeys(files))
    if not path.exists():
        raise DataError(
            f"data.path: {path} does not exist; give a text, JSONL, Parquet or Arrow file,"
            " or a directory or glob of them"
        )
    return (path, _files_under(path, path)) if path.is_dir() else (path.parent, [path])


def _entries(folder: Path, depth: int = -1) -> Iterator[tuple[Path, bool]]:
    """(path, whether it is a folder) of everything below ``folder`` down to ``depth`` more levels (-1: all). A link
    to a folder is neither listed nor followed, so a link loop or a link to a parent folder reads no file twice."""
    stack = [(folder, depth)]
    while stack:
        current, left = stack.pop()
        try:
            with os.scandir(current) as listing:
                entries = [(Path(e.path), e.is_dir(follow_symlinks=False), e.is_symlink()) for e in listing]
        except OSError as e:
            raise DataError(
                f"{current}: cannot be listed ({e.strerror or e}); check it, or remove it from data.path"
            ) from None
        for entry, is_folder, is_link in entries:
            if is_link and os.path.isdir(entry):
                continue  # a link to a folder: not followed (docs/corpora.md, "What a corpus reader refuses")
            yield entry, is_folder
            if is_folder and left != 0:
                stack.append((entry, left - 1))


def _glob(root: Path, pattern: tuple[str, ...]) -> list[tuple[Path, bool]]:
    """(match, whether it is a folder) for a glob pattern of path parts below ``root``, sorted, as ``glob.glob`` with
    recursive ``**`` finds them (wildcards skip names that start with a dot), but never through a link to a folder."""

    def component(name: str, part: str) -> bool:
        return (part.startswith(".") or not name.startswith(".")) and fnmatch.fnmatchcase(name, part)

    def matches(parts: tuple[str, ...]) -> bool:
        @functools.cache
        def at(i: int, j: int) -> bool:  # parts[i:] match pattern[j:]
            if j == len(pattern):
                return i == len(parts)
            if pattern[j] == "**":
                return at(i, j + 1) or (i < len(parts) and not parts[i].startswith(".") and at(i + 1, j))
            return i < len(parts) and component(parts[i], pattern[j]) and at(i + 1, j + 1)

        return at(0, 0)

    depth = -1 if "**" in pattern else len(pattern) - 1  # without **, no match lies deeper than the pattern
    return sorted((p, folder) for p, folder in _entries(root, depth) if matches(p.relative_to(root).parts))


def _files_under(folder: Path, root: Path) -> list[Path]:
    """A folder's files, sorted; in a folder holding a dataset saved by ``datasets``, only its Arrow files (its
    state.json and dataset_info.json describe it and are no text to train on)."""
    datasets: dict[Path, list[Path] | None] = {}
    files = []
    for p in sorted(p for p, is_folder in _entries(folder) if not is_folder and not p.name.startswith(".")):
        if p.parent not in datasets:
            datasets[p.parent] = columnar.dataset_files(p.parent, root)
        if datasets[p.parent] is None or p in datasets[p.parent]:
            files.append(p)
    return files


def find_sources(path: Path) -> list[Source]:
    """Corpus files under ``path`` (a file, a directory or a glob), sorted; raises DataError naming the path if there
    are none, or naming the extra to install when they need a package that is not installed. A file reached twice
    (a link to another corpus file, a hard link) is read once, where it comes first."""
    root, candidates = _candidates(path)
    sources, seen = [], set()
    for p in candidates:
        explicit = p == path  # a file named explicitly is read as text whatever its name, and where its link leads
        kind = _format_of(p) or (("text", "") if explicit else None)
        if kind is None:
            continue
        source = Source(p, str(p.relative_to(root)), *kind, root=None if explicit else root)
        identity = identity_of(p, source.root)
        if identity in seen:
            continue
        seen.add(identity)
        if source.columnar:
            require("pyarrow", f"{p} (a {kind[0].capitalize()} file)")  # here: before any reading
            sources.append(source)
        elif _looks_like_text(source):
            sources.append(source)
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
    for source in sources:
        if source.columnar:
            columnar.check(source, field)


class ZstdReader:
    """A .zst file's text, decompressed frame by frame. zstandard's own stream_reader returns what it has when the
    file ends inside a frame, so a truncated download would pass for a shorter corpus; this one raises EOFError then
    (as gzip does), and OSError for bytes that are not zstd."""

    CHUNK = 1 << 16
    """Compressed bytes fed at once: text expands ~3-10x, so each step decompresses well under a block."""

    def __init__(self, file, zstd) -> None:
        """``file``: the .zst file, opened (closed with this reader); ``zstd``: the zstandard module."""
        self.zstd, self.file = zstd, file
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


def _open(source: Source) -> io.BufferedIOBase | gzip.GzipFile | ZstdReader:
    """The file's bytes, decompressed, from a file opened as a file (shardlab_tasks/lm/corpus/sources.py: no FIFO,
    device or link out of the corpus folder); closed by the caller."""
    zstd = require("zstandard", f"{source.path} (a zstd file)") if source.compression == "zst" else None
    f = open_file(source.path, source.root)
    if zstd is not None:
        return ZstdReader(f, zstd)
    if not source.compression:
        return f
    unzipped = gzip.GzipFile(fileobj=f, mode="rb")
    unzipped.myfileobj = f  # what GzipFile closes with itself when it opened the file by name
    return unzipped


def _looks_like_text(source: Source) -> bool:
    with _open(source) as f:
        try:
            head = f.read(4096)
        except (OSError, EOFError, zlib.error) as e:
            raise DataError(f"{source.path}: {_damage(e, source.compression, 0)}; {FIX_DAMAGED}") from None
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
    if not compression:
        return f"cannot be read ({getattr(error, 'strerror', None) or error}), {where}"
    if isinstance(error, EOFError):
        return f"the file is cut short: it ends inside a compressed stream, {where}"
    return f"damaged: not readable as {'gzip' if compression == 'gz' else 'zstd'} ({error}), {where}"


def _read(f, source: Source, size: int, whole_lines: int) -> bytes:
    try:
        return f.read(size)
    except (OSError, EOFError, zlib.error) as e:  # gzip's BadGzipFile is an OSError
        raise DataError(f"{source.path}: {_damage(e, source.compression, whole_lines)}; {FIX_DAMAGED}") from None


def _pieces(f, source: Source, block_bytes: int, budget: int) -> Iterator[bytes | int]:
    """The file's bytes in pieces of about ``block_bytes`` cut at line ends (text without line ends: between
    characters), each byte copied a bounded number of times however long a line is; or, last, the number of bytes
    read into a record that ``budget`` (> 0: the most the caller reads) ends inside, so it is not read to its end."""
    line, read, held, parts = 1, 0, 0, []  # parts: what was read of a line not yet ended (held bytes)
    while True:
        data = _read(f, source, block_bytes, line - 1)
        if data and source.records and b"\n" not in data:  # inside a long record: kept apart, joined when it ends
            parts.append(data)
            held += len(data)
            if budget and read + held > budget:
                yield held
                return
            if held > MAX_RECORD_BYTES:
                raise DataError(
                    f"{source.path}:{line}: a record longer than {MAX_RECORD_BYTES >> 20} MiB, the longest a corpus "
                    "reader holds; split it into documents, or set data.max_corpus_mb to stop before it"
                )
            continue
        buf = b"".join([*parts, data])
        cut = len(buf) if not data else (buf.rfind(b"\n") + 1 or _utf8_cut(buf))
        if cut:
            yield buf[:cut]
            read += cut
            line += buf.count(b"\n", 0, cut)
        parts, held = ([buf[cut:]], len(buf) - cut) if cut < len(buf) else ([], 0)
        if not data:
            return


def read_blocks(
    source: Source, block_bytes: int = BLOCK_BYTES, text_field: str = "text", budget: int = 0
) -> Iterator[Block]:
    """The file's blocks, each ending at a line end (text without line ends: at a character boundary); a Parquet or
    Arrow file's hold whole rows (``text_field``: their text column). ``budget`` > 0: the most bytes the caller will
    read (data.max_corpus_mb less what it read before); where it ends inside a record, the file ends with an empty
    block whose ``size`` is what was read of that record (left out: half a JSON line is no document)."""
    if source.columnar:
        yield from columnar.read_blocks(source, text_field, block_bytes)
        return
    index, line, pending = 0, 1, None
    with _open(source) as f:
        for piece in _pieces(f, source, block_bytes, budget):
            if pending is not None:
                yield pending
            if isinstance(piece, int):
                pending = Block(source, index, line, b"", size=piece)
            else:
                pending = Block(source, index, line, piece)
                index, line = index + 1, line + piece.count(b"\n")
    if pending is not None:
        pending.last = True
        yield pending


SURROGATES = re.compile("[\ud800-\udfff]")
"""What JSON's \\ud800-\\udfff escapes decode to when unpaired: no UTF-8 has them, so no tokenizer encodes them."""


def _names(keys) -> str:
    """A record's keys for an error line: the first ten, each on one line."""
    keys = list(keys)
    names = ", ".join(SURROGATES.sub("\ufffd", json.dumps(k, ensure_ascii=False)[1:-1][:80]) for k in keys[:10])
    return names + (f" and {len(keys) - 10:,} more" if len(keys) > 10 else "")


def jsonl_text(line: bytes, path: Path, n: int, field: str) -> str:
    """The text of one JSONL record; a line that is not JSON or lacks the field is a DataError naming file:line. An
    unpaired surrogate escape becomes U+FFFD, as a byte that is not UTF-8 does in a text file."""
    try:
        record = json.loads(line)
    except (ValueError, RecursionError) as e:  # RecursionError: nesting deeper than the parser's stack
        why = (str(e).splitlines() or [type(e).__name__])[0]
        raise DataError(f"{path}:{n}: not a JSON object ({why}); fix or delete the line") from None
    if not isinstance(record, dict) or field not in record:
        keys = _names(record) if isinstance(record, dict) else type(record).__name__
        raise DataError(f"{path}:{n}: no {field!r} field (found: {keys}); {FIX_FIELD}")
    text = record[field]
    if not isinstance(text, str):
        raise DataError(f"{path}:{n}: field {field!r} is a {type(text).__name__}, not a string; fix the line")
    return text if text.isascii() or not SURROGATES.search(text) else SURROGATES.sub("\ufffd", text)


def iter_texts(sources: list[Source], text_field: str, max_bytes: int) -> Iterator[str]:
    """Document texts (a text file's in ~1 MB blocks) from the start of the corpus, up to ``max_bytes`` of input."""
    read = 0
    for source in sources:
        for block in read_blocks(source, text_field=text_field, budget=max_bytes - read):
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
