"""Corpus inputs, read as a stream of ~1 MB blocks: text files, directories of them, JSONL, any of them gzipped.

A text file is one document; it is read in blocks cut at line ends, so one 50 GB file streams like many small ones.
A JSONL file holds one document per line (the ``jsonl_field`` of each JSON object); its blocks hold whole lines.
Nothing here imports torch or tokenizers: worker processes import this module and stay light.
"""

from __future__ import annotations

import gzip
import io
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from shardlab.errors import DataError

TEXT_SUFFIXES = {".txt", ".md", ".rst", ".py", ".text", ".json", ".csv", ".tex", ".html", ".c", ".h", ""}
JSONL_SUFFIXES = {".jsonl", ".ndjson"}
BLOCK_BYTES = 1 << 20
"""Bytes read per block: large enough to amortize a worker round trip, small enough that blocks in flight stay MBs."""


@dataclass(frozen=True)
class Source:
    path: Path
    rel: str
    """Path relative to the corpus root: what the train/valid split hashes, so it survives moving the corpus."""
    jsonl: bool
    gzipped: bool

    @property
    def split_key(self) -> str:
        """What the train/valid split hashes: the relative path, less .gz, so compressing a file keeps its split."""
        return self.rel[: -len(".gz")] if self.gzipped else self.rel


@dataclass
class Block:
    source: Source
    index: int
    """Block number within its file (0 first)."""
    first_line: int
    """1-based line number of the block's first line, for error messages."""
    data: bytes
    last: bool = False
    """The file's final block: a text file's document ends here."""


def _kind(path: Path) -> tuple[bool, bool] | None:
    """(jsonl, gzipped) for a corpus file name, or None when it is no corpus file."""
    gzipped = path.suffix.lower() == ".gz"
    inner = Path(path.stem) if gzipped else path
    suffix = inner.suffix.lower()
    if suffix in JSONL_SUFFIXES:
        return True, gzipped
    if suffix in TEXT_SUFFIXES:
        return False, gzipped
    return None


def find_sources(path: Path) -> list[Source]:
    """Corpus files under ``path`` (or ``path`` itself), sorted; raises DataError naming the path if there are none."""
    if not path.exists():
        raise DataError(f"data.path: {path} does not exist; give a text or JSONL file, or a directory of them")
    root = path if path.is_dir() else path.parent
    candidates = (
        [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file() and not p.name.startswith("."))
    )
    sources = []
    for p in candidates:
        kind = _kind(p)
        if kind is None and p == path:
            kind = (False, False)  # a file named explicitly is read as text whatever its name
        if kind is not None and _looks_like_text(p, kind[1]):
            sources.append(Source(p, str(p.relative_to(root)), *kind))
    if not sources:
        raise DataError(
            f"data.path: {path} holds no text files (looked for {', '.join(sorted(TEXT_SUFFIXES - {''}))}, "
            f"{', '.join(sorted(JSONL_SUFFIXES))}, their .gz, and extensionless files of UTF-8 text); "
            "point it at your corpus"
        )
    return sources


def _open(path: Path, gzipped: bool) -> io.BufferedIOBase:
    return gzip.open(path, "rb") if gzipped else open(path, "rb")  # noqa: SIM115 (closed by the caller)


def _looks_like_text(path: Path, gzipped: bool) -> bool:
    try:
        with _open(path, gzipped) as f:
            head = f.read(4096)
    except (OSError, EOFError, gzip.BadGzipFile):
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


def read_blocks(source: Source, block_bytes: int = BLOCK_BYTES) -> Iterator[Block]:
    """The file's blocks, each ending at a line end (text without line ends: at a character boundary)."""
    index, line, carry, pending = 0, 1, b"", None
    with _open(source.path, source.gzipped) as f:
        while True:
            data = f.read(block_bytes)
            buf = carry + data
            if not data:
                cut = len(buf)
            else:
                cut = buf.rfind(b"\n") + 1
                if cut == 0:
                    if source.jsonl:  # a record is never split: keep reading to the end of its line
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
        raise DataError(
            f"{path}:{n}: no {field!r} field (found: {keys}); "
            "name the text field with data.jsonl_field (tools/preprocess_lm.py: --jsonl-field)"
        )
    text = record[field]
    if not isinstance(text, str):
        raise DataError(f"{path}:{n}: field {field!r} is a {type(text).__name__}, not a string; fix the line")
    return text


def iter_texts(sources: list[Source], jsonl_field: str, max_bytes: int) -> Iterator[str]:
    """Document texts (a text file's in ~1 MB blocks) from the start of the corpus, up to ``max_bytes`` of input."""
    read = 0
    for source in sources:
        for block in read_blocks(source):
            if source.jsonl:
                for n, line in enumerate(block.data.splitlines(), start=block.first_line):
                    if line.strip():
                        yield jsonl_text(line, source.path, n, jsonl_field)
            else:
                yield block.data.decode("utf-8", errors="replace")
            read += len(block.data)
            if read >= max_bytes:
                return
