"""Stream a corpus into train.bin / valid.bin token files over worker processes, in bounded memory, atomically.

The main process reads ~1 MB blocks (decompressing, and decoding Parquet and Arrow record batches) and writes tokens
in order; workers decode, parse JSONL and tokenize. At most a
few blocks per worker are in flight, so memory does not grow with the corpus. Output goes to a temporary directory,
is fsynced, and is renamed into place only when complete: a killed run never leaves a cache that looks finished.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing as mp
import os
import shutil
import sys
import tempfile
import time
from collections import deque
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np

from shardlab.checkpoint.layout import fsync_path
from shardlab.errors import DataError
from tasks.lm.cache_lock import temp_prefix
from tasks.lm.corpus import check_sources, jsonl_text, read_blocks
from tasks.lm.sources import Block, Source
from tasks.lm.tokenizer import Tokenizer, load_tokenizer, token_dtype

FORMAT_VERSION = 2
"""2: meta.json records the token dtype (uint16 or uint32) and the tokenizer's fingerprint. 1 (uint16) still reads."""
SEGMENT_CHARS = 1 << 16
"""Tokenize text in ~64 KB pieces cut at line ends: the tokenizers library encodes those ~40% faster than 1 MB."""
IN_FLIGHT_PER_WORKER = 3


def is_valid_document(relative_path: str, valid_percent: float) -> bool:
    digest = int.from_bytes(hashlib.sha1(relative_path.encode()).digest()[:4], "little")
    return digest % 10_000 < valid_percent * 100


def _segments(text: str) -> Iterator[str]:
    start = 0
    while start < len(text):
        end = text.rfind("\n", start, start + SEGMENT_CHARS) + 1 if len(text) - start > SEGMENT_CHARS else len(text)
        end = end if end > start else min(start + SEGMENT_CHARS, len(text))
        yield text[start:end]
        start = end


def _encode_text(tokenizer: Tokenizer, text: str) -> np.ndarray:
    return tokenizer.encode_array(list(_segments(text)) if tokenizer.splits_cleanly else [text])


def encode_block(tokenizer: Tokenizer, block: Block, valid_percent: float, text_field: str, dtype) -> tuple:
    """(train tokens, valid tokens) of one block; a document's end-of-document token goes with its last tokens."""
    eod = np.array([tokenizer.eod], dtype=dtype)
    parts: dict[str, list[np.ndarray]] = {"train": [], "valid": []}
    src = block.source
    if block.texts is not None:  # Parquet or Arrow rows: split by row number, as the same JSONL file's lines
        for n, text in enumerate(block.texts, start=block.first_line):
            split = "valid" if is_valid_document(f"{src.split_key}:{n}", valid_percent) else "train"
            parts[split] += [_encode_text(tokenizer, text), eod]
    elif not src.records:
        key = src.split_key if block.index == 0 else f"{src.split_key}#{block.index}"
        split = "valid" if is_valid_document(key, valid_percent) else "train"
        parts[split].append(_encode_text(tokenizer, block.data.decode("utf-8", errors="replace")))
        if block.last:
            parts[split].append(eod)
    else:
        for n, line in enumerate(block.data.splitlines(), start=block.first_line):
            if not line.strip():
                continue
            text = jsonl_text(line, src.path, n, text_field)
            split = "valid" if is_valid_document(f"{src.split_key}:{n}", valid_percent) else "train"
            parts[split] += [_encode_text(tokenizer, text), eod]
    return tuple(np.concatenate(p).astype(dtype, copy=False) if p else np.zeros(0, dtype) for p in parts.values())


# ---- worker processes --------------------------------------------------------------------------------------------
_worker: dict = {}


def _init_worker(tokenizer_spec: str, eod_token: str | None, valid_percent: float, field: str, dtype: str) -> None:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # parallelism comes from the processes; no threads on top
    _worker.update(tok=load_tokenizer(tokenizer_spec, eod_token), vp=valid_percent, field=field, dtype=np.dtype(dtype))


def _work(block: Block) -> tuple:
    return encode_block(_worker["tok"], block, _worker["vp"], _worker["field"], _worker["dtype"])


def _encoded(blocks: Iterable[Block], tokenizer: Tokenizer, vp: float, field: str, dtype, workers: int):
    """(train, valid) tokens of each block in input order, with at most a few blocks per worker in memory."""
    if workers <= 0:
        for b in blocks:
            yield encode_block(tokenizer, b, vp, field, dtype)
        return
    ctx = mp.get_context("spawn")  # not fork: the parent may hold torch's and the tokenizers' threads
    with ctx.Pool(workers, _init_worker, (tokenizer.name, tokenizer.eod_token, vp, field, dtype.str)) as pool:
        pending: deque = deque()
        for b in blocks:
            pending.append(pool.apply_async(_work, (b,)))
            if len(pending) >= IN_FLIGHT_PER_WORKER * workers:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()


# ---- writing -----------------------------------------------------------------------------------------------------
def binarize(
    sources: list[Source],
    out_dir: Path,
    tokenizer: Tokenizer,
    valid_percent: float,
    max_bytes: int = 0,
    text_field: str = "text",
    workers: int = 0,
    extra_files: dict[str, Path] | None = None,
    source_name: str = "",
) -> dict:
    """Tokenize ``sources`` into out_dir/{train,valid}.bin + meta.json (+ ``extra_files`` copied in) atomically."""
    check_sources(sources, text_field)  # a shard without the text column fails now, not hours in
    dtype = token_dtype(tokenizer.vocab_size)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=temp_prefix(out_dir), dir=out_dir.parent))
    try:
        meta = _write_splits(sources, tmp, tokenizer, valid_percent, max_bytes, text_field, workers, dtype)
        meta.update(source=source_name, text_field=text_field, content_digest=content_digest(tmp))
        if extra_files and "tokenizer.json" in extra_files:  # trained for this corpus: it lives beside the tokens
            meta["tokenizer"] = str(out_dir.resolve() / "tokenizer.json")
        for name, path in (extra_files or {}).items():
            shutil.copyfile(path, tmp / name)
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
        for f in tmp.iterdir():
            fsync_path(f)
        fsync_path(tmp)
        try:
            os.replace(tmp, out_dir)
        except OSError:  # another rank or run finished the same cache first: keep theirs
            shutil.rmtree(tmp, ignore_errors=True)
            if not (out_dir / "meta.json").is_file():
                raise DataError(f"{out_dir} exists but holds no meta.json (not shardlab's?); delete it") from None
        fsync_path(out_dir.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # a failed or interrupted run leaves nothing behind
        raise
    return json.loads((out_dir / "meta.json").read_text())


def content_digest(corpus: Path) -> str:
    """A hash of the token files' bytes: ranks compare it to know they train on the same tokens, whatever the paths
    and timestamps that named their cache (node-local copies of one corpus agree)."""
    h = hashlib.blake2b(digest_size=12)
    for split in ("train", "valid"):
        with open(corpus / f"{split}.bin", "rb") as f:
            while chunk := f.read(1 << 24):
                h.update(chunk)
        h.update(b"|")
    return h.hexdigest()


def _write_splits(sources, tmp, tokenizer, valid_percent, max_bytes, field, workers, dtype) -> dict:
    # Progress counts text bytes; a compressed or columnar file's text size is unknown until read: then no total.
    total = None if any(s.compression or s.columnar for s in sources) else sum(s.path.stat().st_size for s in sources)
    counts = {"train": 0, "valid": 0}
    docs = {"train": 0, "valid": 0}
    last_train = 0
    read = 0
    start = time.perf_counter()
    progress = _progress(total)

    def blocks() -> Iterator[Block]:
        nonlocal read
        for s in sources:
            for b in read_blocks(s, text_field=field, budget=max_bytes - read if max_bytes else 0):
                read += b.size
                progress.update(b.size)
                capped = bool(max_bytes) and read >= max_bytes
                b.last = b.last or capped  # the document ends at the cap
                if b.data or b.texts is not None:  # not the empty end of a record the cap cut (read, left out)
                    yield b
                if capped:
                    return

    files = {split: open(tmp / f"{split}.bin", "wb") for split in counts}  # noqa: SIM115
    try:
        for encoded in _encoded(blocks(), tokenizer, valid_percent, field, dtype, workers):
            for split, tokens in zip(counts, encoded, strict=True):
                if tokens.size:
                    tokens.tofile(files[split])
                    counts[split] += tokens.size
                    docs[split] += int((tokens == tokenizer.eod).sum())
            last_train = encoded[0].size
    finally:
        for f in files.values():
            f.close()
        progress.close()
    if counts["valid"] == 0 and counts["train"]:  # tiny corpora: hold out the last block rather than nothing
        _hold_out_tail(tmp, last_train, tokenizer.eod, dtype, counts, docs)
    seconds = time.perf_counter() - start
    print(
        f"  read {read / 1e6:,.1f} MB in {seconds:.1f} s ({read / 1e6 / max(seconds, 1e-9):,.1f} MB/s, "
        f"{max(workers, 1)} worker{'s' if workers > 1 else ''})",
        flush=True,
    )
    return {
        "format": FORMAT_VERSION,
        "tokenizer": tokenizer.name,
        "tokenizer_fingerprint": tokenizer.fingerprint,
        "vocab_size": tokenizer.vocab_size,
        "eod": tokenizer.eod,
        "dtype": dtype.name,
        "documents": docs,
        "train_tokens": counts["train"],
        "valid_tokens": counts["valid"],
        "bytes_read": read,
        "seconds": round(seconds, 3),
    }


def _hold_out_tail(tmp: Path, num_tokens: int, eod: int, dtype, counts: dict, docs: dict) -> None:
    """Move the last ``num_tokens`` train tokens (the last block's) to valid, and their counts with them."""
    _move_tail(tmp / "train.bin", tmp / "valid.bin", num_tokens, dtype)
    counts["train"] -= num_tokens
    counts["valid"] = num_tokens
    moved = int((np.fromfile(tmp / "valid.bin", dtype=dtype) == eod).sum())
    docs["train"] -= moved
    docs["valid"] += moved


def _move_tail(src: Path, dst: Path, num_tokens: int, dtype) -> None:
    size = src.stat().st_size
    keep = size - num_tokens * dtype.itemsize
    with open(src, "rb") as f:
        f.seek(keep)
        dst.write_bytes(f.read())
    os.truncate(src, keep)


def _progress(total: int | None):
    from tqdm import tqdm

    # disable=None: a bar on a terminal, nothing in a log file; the summary line prints either way.
    return tqdm(total=total, unit="B", unit_scale=True, desc="  binarize", file=sys.stderr, disable=None)
