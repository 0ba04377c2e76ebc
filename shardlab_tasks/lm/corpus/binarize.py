"""Stream a corpus into train.bin / valid.bin token files, in bounded memory, atomically.

The main process reads ~1 MB blocks (decompressing, and decoding Parquet and Arrow record batches), tokenizes each
block's documents in one call (a tokenizer file spreads it over the tokenizers library's threads) and writes tokens in
order; worker processes parse and tokenize instead only where the library's threads are turned off
(TOKENIZERS_PARALLELISM=false), at most a few blocks per worker in flight. Memory does not grow with the corpus.
Output goes to a temporary directory, is fsynced, and is renamed into place only when complete: a killed run never
leaves a cache that looks finished.
"""

from __future__ import annotations

import hashlib
import json
import math
import multiprocessing as mp
import os
import shutil
import sys
import tempfile
import time
from collections import deque
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from shardlab.errors import DataError
from shardlab.files.durable import fsync_path
from shardlab_tasks.lm.corpus.cache_files import open_cache_file, read_cache_json
from shardlab_tasks.lm.corpus.cache_lock import temp_prefix
from shardlab_tasks.lm.corpus.corpus import check_sources, jsonl_text, read_blocks
from shardlab_tasks.lm.corpus.sources import Block, Source
from shardlab_tasks.lm.corpus.tokenizer import ByteTokenizer, Tokenizer, load_tokenizer, token_dtype

FORMAT_VERSION = 4
"""4: a corpus with too few documents for whole ones to make data.valid_percent (one text file) holds out the last
valid_percent of its tokens, not a whole file or block (the key changes: such a corpus's old cache, all or half of it
held out, is not reused); 3: a corpus whose hash gives valid no document holds out whole documents, not its last
block; 2: meta.json records the token dtype (uint16 or uint32) and the tokenizer's fingerprint. 1 to 3 still read."""
IN_FLIGHT_PER_WORKER = 3


def split_rank(key: str) -> int:
    """Where a document falls in the hash order of the split, 0..9,999: valid below ``valid_percent * 100``."""
    return int.from_bytes(hashlib.sha1(key.encode()).digest()[:4], "little") % 10_000


def is_valid_document(relative_path: str, valid_percent: float) -> bool:
    return split_rank(relative_path) < valid_percent * 100


@dataclass
class Encoded:
    """One block's tokens by split, its documents by split, and its train units for the small-corpus hold-out."""

    train: np.ndarray
    valid: np.ndarray
    documents: tuple[int, int]
    """Documents that end in this block (train, valid): a text file's ends in its last block only."""
    train_units: np.ndarray
    """One row per train unit (a record, or a text block): its hash rank, its tokens (end-of-document included),
    and 1 where it ends a document. The order the hold-out of a small corpus picks units in."""
    all_units: np.ndarray
    """One row per unit in stream order: its tokens, 1 where it ends a document, 1 where it went to valid (the tail
    hold-out of a corpus of too few units puts the stream back in order)."""


def _units(block: Block, text_field: str) -> tuple[list[str], list[str], bool]:
    """(split keys, texts, whether each ends a document) of a block's units: its records, or the block itself."""
    src = block.source
    if block.texts is not None:  # Parquet or Arrow rows: split by row number, as the same JSONL file's lines
        keys = [f"{src.split_key}:{n}" for n in range(block.first_line, block.first_line + len(block.texts))]
        return keys, block.texts, True
    if not src.records:
        key = src.split_key if block.index == 0 else f"{src.split_key}#{block.index}"
        return [key], [block.data.decode("utf-8", errors="replace")], block.last
    keys, texts = [], []
    for n, line in enumerate(block.data.splitlines(), start=block.first_line):
        if line.strip():
            texts.append(jsonl_text(line, src.path, n, text_field))
            keys.append(f"{src.split_key}:{n}")
    return keys, texts, True


def encode_units(tokenizer: Tokenizer, block: Block, valid_percent: float, text_field: str, dtype) -> Encoded:
    """A block tokenized in one call of the tokenizer; each unit's end-of-document token goes with its last tokens."""
    keys, texts, ends = _units(block, text_field)
    ranks = np.fromiter((split_rank(k) for k in keys), np.int64, len(keys))
    valid = ranks < valid_percent * 100
    ids, lengths = tokenizer.encode_documents(texts)
    lengths = lengths + ends  # room for each unit's end-of-document token
    out = np.empty(int(lengths.sum()), dtype)
    if ends:
        eod_at = np.cumsum(lengths) - 1
        is_text = np.ones(out.size, bool)
        is_text[eod_at] = False
        out[is_text] = ids
        out[eod_at] = tokenizer.eod
    else:
        out[:] = ids
    in_valid = np.repeat(valid, lengths)
    documents = (int((~valid).sum()) * ends, int(valid.sum()) * ends)
    units = np.stack([ranks[~valid], lengths[~valid], np.full((~valid).sum(), int(ends))], axis=1)
    in_order = np.stack([lengths, np.full(len(keys), int(ends)), valid.astype(np.int64)], axis=1)
    return Encoded(out[~in_valid], out[in_valid], documents, units, in_order)


def encode_block(tokenizer: Tokenizer, block: Block, valid_percent: float, text_field: str, dtype) -> tuple:
    """(train tokens, valid tokens) of one block; a document's end-of-document token goes with its last tokens."""
    encoded = encode_units(tokenizer, block, valid_percent, text_field, dtype)
    return encoded.train, encoded.valid


# ---- worker processes --------------------------------------------------------------------------------------------
_worker: dict = {}


def _init_worker(tokenizer_spec: str, eod_token: str | None, valid_percent: float, field: str, dtype: str) -> None:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # parallelism comes from the processes; no threads on top
    _worker.update(tok=load_tokenizer(tokenizer_spec, eod_token), vp=valid_percent, field=field, dtype=np.dtype(dtype))


def _work(block: Block) -> Encoded:
    return encode_units(_worker["tok"], block, _worker["vp"], _worker["field"], _worker["dtype"])


def processes_for(tokenizer: Tokenizer, workers: int) -> int:
    """Worker processes worth starting for ``workers``: none for the byte tokenizer (a lookup: sending a block to a
    process and its tokens back costs more CPU than tokenizing it, measured 7.3 against 17.3 MB per CPU-second) nor
    for a tokenizer file, whose library threads over each block's batch were measured faster per CPU-second and in
    wall time than as many processes (docs/corpora.md); processes only where the user turned those threads off."""
    if isinstance(tokenizer, ByteTokenizer) or os.environ.get("TOKENIZERS_PARALLELISM", "").lower() != "false":
        return 0
    return workers


def _encoded(blocks: Iterable[Block], tokenizer: Tokenizer, vp: float, field: str, dtype, workers: int):
    """Each block encoded, in input order, with at most a few blocks per worker in memory."""
    processes = processes_for(tokenizer, workers)
    if processes <= 0:
        with _library_threads(workers):
            for b in blocks:
                yield encode_units(tokenizer, b, vp, field, dtype)
        return
    ctx = mp.get_context("spawn")  # not fork: the parent may hold torch's and the tokenizers' threads
    with ctx.Pool(processes, _init_worker, (tokenizer.name, tokenizer.eod_token, vp, field, dtype.str)) as pool:
        pending: deque = deque()
        for b in blocks:
            pending.append(pool.apply_async(_work, (b,)))
            if len(pending) >= IN_FLIGHT_PER_WORKER * processes:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()


@contextmanager
def _library_threads(workers: int) -> Iterator[None]:
    """The tokenizers library's thread pool sized to ``workers`` (when > 0), if it has not started yet in this
    process (it starts once, at its first parallel call; an earlier one, such as training the BPE, keeps its size)."""
    if workers <= 0 or "RAYON_NUM_THREADS" in os.environ:
        yield
        return
    os.environ["RAYON_NUM_THREADS"] = str(workers)
    try:
        yield
    finally:
        del os.environ["RAYON_NUM_THREADS"]


def temp_folder(prefix: str, parent: Path) -> Path:
    """A new folder to build in, renamed into place once complete, with the mode a plain mkdir gives (the umask's):
    mkdtemp's 0700 made a cache shared on a cluster unreadable to everyone but the user who built it."""
    tmp = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
    os.chmod(tmp, 0o777 & ~_umask())
    return tmp


def _umask() -> int:
    """This process's umask, read without setting it (os.umask sets it, for every thread) where Linux says it."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


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
    tmp = temp_folder(temp_prefix(out_dir), out_dir.parent)
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
    return read_cache_json(out_dir / "meta.json", out_dir)


def content_digest(corpus: Path) -> str:
    """A hash of the token files' bytes: ranks compare it to know they train on the same tokens, whatever the paths
    and timestamps that named their cache (node-local copies of one corpus agree)."""
    h = hashlib.blake2b(digest_size=12)
    for split in ("train", "valid"):
        with open_cache_file(corpus / f"{split}.bin", corpus) as f:
            while chunk := f.read(1 << 24):
                h.update(chunk)
        h.update(b"|")
    return h.hexdigest()


def _write_splits(sources, tmp, tokenizer, valid_percent, max_bytes, field, workers, dtype) -> dict:
    # Progress counts text bytes; a compressed or columnar file's text size is unknown until read: then no total.
    total = None if any(s.compression or s.columnar for s in sources) else sum(s.path.stat().st_size for s in sources)
    counts = {"train": 0, "valid": 0}
    docs = {"train": 0, "valid": 0}
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

    # Train units seen while no document has hashed into valid (rank, offset, tokens, ends a document); dropped at the
    # first valid document, so only a corpus that may need the hold-out below keeps them. And every unit placed (went to
    # valid, offset in its split, tokens, ends a document) while the corpus has too few for whole ones to be held out.
    units: list[np.ndarray] | None = []
    placed: list[tuple[int, int, int, int]] | None = []
    files = {split: open(tmp / f"{split}.bin", "wb") for split in counts}  # noqa: SIM115
    try:
        for encoded in _encoded(blocks(), tokenizer, valid_percent, field, dtype, workers):
            if units is not None and encoded.valid.size == 0:
                offsets = counts["train"] + np.cumsum(encoded.train_units[:, 1]) - encoded.train_units[:, 1]
                units.append(np.insert(encoded.train_units, 1, offsets, axis=1))
            else:
                units = None
            placed = _place(placed, encoded.all_units, counts, valid_percent)
            for split, tokens, n in zip(counts, (encoded.train, encoded.valid), encoded.documents, strict=True):
                tokens.tofile(files[split])
                counts[split] += tokens.size
                docs[split] += n
    finally:
        for f in files.values():
            f.close()
        progress.close()
    held_out = ""
    if placed is not None and valid_percent > 0 and counts["train"] + counts["valid"] > 1:
        held_out = _hold_out_tail(tmp, np.array(placed, dtype=np.int64), valid_percent, dtype, counts, docs)
    elif units is not None and counts["train"] and valid_percent > 0:  # no document hashed into valid: hold out some
        held_out = _hold_out(tmp, np.concatenate(units), valid_percent, dtype, counts, docs)
    seconds = time.perf_counter() - start
    print(
        f"  read {read / 1e6:,.1f} MB in {seconds:.1f} s ({read / 1e6 / max(seconds, 1e-9):,.1f} MB/s, "
        f"{_how(tokenizer, workers)}){held_out}",
        flush=True,
    )
    return {**_tokenizer_meta(tokenizer, dtype), "documents": docs, "train_tokens": counts["train"],
            "valid_tokens": counts["valid"], "bytes_read": read, "seconds": round(seconds, 3)}  # fmt: skip


def _tokenizer_meta(tokenizer: Tokenizer, dtype) -> dict:
    return {"format": FORMAT_VERSION, "tokenizer": tokenizer.name, "tokenizer_fingerprint": tokenizer.fingerprint,
            "vocab_size": tokenizer.vocab_size, "eod": tokenizer.eod, "dtype": dtype.name}  # fmt: skip


def _how(tokenizer: Tokenizer, workers: int) -> str:
    if processes_for(tokenizer, workers):
        return f"{workers} worker processes"
    if isinstance(tokenizer, ByteTokenizer) or workers <= 0:
        return "in-process"
    return f"in-process, tokenizers' {os.environ.get('RAYON_NUM_THREADS', workers)} threads"


def held_out_count(num_units: int, valid_percent: float) -> int:
    """How many units the hold-out takes from ``num_units`` when the hash gave valid none: the fewest that make
    ``valid_percent`` (at least one), leaving train at least one where there are two."""
    wanted = max(1, math.ceil(num_units * valid_percent / 100 - 1e-9))
    return min(wanted, num_units - 1) if num_units > 1 else num_units


def too_few_units(num_units: int, valid_percent: float) -> bool:
    """Whether a corpus has too few units (documents, or a text file's ~1 MB blocks) for whole ones to make the
    validation split: fewer than two, or fewer than 50 / ``valid_percent`` (10 at 5%, 5 at 10%), below which the one
    unit held out would be more than twice ``valid_percent`` of them (one text file: all of it; 1.1 MB: half)."""
    return num_units < max(2, 50 / valid_percent) if valid_percent > 0 else False


def _place(placed: list | None, in_order: np.ndarray, counts: dict, valid_percent: float) -> list | None:
    """``placed`` with a block's units added as (went to valid, offset in its split, tokens, ends a document), given
    the tokens written so far (``counts``); None once the corpus has enough units for whole ones to be held out."""
    if placed is None:
        return None
    at = {0: counts["train"], 1: counts["valid"]}
    for length, ends, valid in in_order.tolist():
        placed.append((valid, at[valid], length, ends))
        at[valid] += length
    return placed if too_few_units(len(placed), valid_percent) else None


TAIL_MIN_TOKENS = 32 * 128 + 1
"""The fewest tokens the tail hold-out gives valid (while train keeps at least as many): one validation batch of the
LM's default config (validation.batch_size=32 blocks of data.seq_len=128, and the last block's target), so a 48 KB
text file, whose 5% is 18 blocks, validates as `python -m shardlab.train data.path=input.txt` runs it."""


def tail_count(num_tokens: int, valid_percent: float) -> int:
    """Tokens the tail hold-out gives valid: ``valid_percent`` of them rounded up, raised to TAIL_MIN_TOKENS where
    that leaves train at least half, and always leaving train at least one."""
    share = math.ceil(num_tokens * valid_percent / 100 - 1e-9)
    return max(0, min(max(share, min(TAIL_MIN_TOKENS, num_tokens // 2)), num_tokens - 1))


def _hold_out_tail(tmp: Path, placed: np.ndarray, valid_percent: float, dtype, counts: dict, docs: dict) -> str:
    """A corpus of too few units: its token stream, put back in the order of its units (the hash may have sent some
    to valid), is split at ``tail_count`` tokens from its end, inside a document: train the head, valid the tail.
    ``docs`` counts documents by the part they start in. Returns what the summary line says of it."""
    total = counts["train"] + counts["valid"]
    moved = tail_count(total, valid_percent)
    keep = total - moved
    maps = {
        v: np.memmap(tmp / f"{s}.bin", dtype=dtype, mode="r") if counts[s] else None
        for v, s in ((0, "train"), (1, "valid"))
    }  # fmt: skip  (both written by this process, above)
    at = 0
    with open(tmp / "train.bin.tmp", "wb") as t, open(tmp / "valid.bin.tmp", "wb") as v:
        for valid, offset, length, _ in placed.tolist():
            if not length:
                continue
            piece = maps[valid][offset : offset + length]
            cut = min(max(keep - at, 0), length)
            piece[:cut].tofile(t)
            piece[cut:].tofile(v)
            at += length
    del maps
    for split in ("train", "valid"):
        os.replace(tmp / f"{split}.bin.tmp", tmp / f"{split}.bin")
    ends = np.cumsum(placed[:, 2])[placed[:, 3] == 1]
    starts = np.concatenate([[0], ends[:-1]])
    counts["train"], counts["valid"] = keep, moved
    docs["valid"] = int((starts >= keep).sum())
    docs["train"] = len(starts) - docs["valid"]
    what = "1 document" if len(placed) == 1 else f"{len(placed)} documents and blocks"
    return (
        f"; the corpus has too few documents to hold whole ones out ({what}), so its last {moved:,} tokens "
        f"({100 * moved / total:.1f}%; data.valid_percent={valid_percent:g}, at least {TAIL_MIN_TOKENS:,} where that "
        "leaves train half) were held out for validation, cut inside a document"
    )


def _hold_out(tmp: Path, units: np.ndarray, valid_percent: float, dtype, counts: dict, docs: dict) -> str:
    """Move whole units (records, or a text file's blocks) from train to valid: the fewest that make valid_percent,
    those nearest to hashing into valid (lowest rank; the position breaks ties), so the choice depends on the
    documents' keys and not on the order their files are read in. Returns what the summary line says of it."""
    k = held_out_count(len(units), valid_percent)
    order = np.lexsort((units[:, 1], units[:, 0]))  # by rank, then by offset
    chosen = units[np.sort(order[:k])]
    train = tmp / "train.bin"
    tokens = np.memmap(train, dtype=dtype, mode="r")
    kept = tmp / "train.bin.tmp"
    with open(kept, "wb") as t, open(tmp / "valid.bin", "wb") as v:
        at = 0
        for _, offset, length, _ in chosen:
            tokens[at:offset].tofile(t)
            tokens[offset : offset + length].tofile(v)
            at = offset + length
        tokens[at:].tofile(t)
    del tokens
    os.replace(kept, train)
    moved, moved_docs = int(chosen[:, 2].sum()), int(chosen[:, 3].sum())
    counts["train"] -= moved
    counts["valid"] += moved
    docs["train"] -= moved_docs
    docs["valid"] += moved_docs
    return (
        f"; no document hashed into the validation split, so the {k} of {len(units)} "
        f"{'documents' if units[:, 3].all() else 'documents and blocks'} nearest to it by hash "
        f"({moved:,} tokens) were held out for it (data.valid_percent={valid_percent:g})"
    )


def _progress(total: int | None):
    from tqdm import tqdm

    # disable=None: a bar on a terminal, nothing in a log file; the summary line prints either way.
    return tqdm(total=total, unit="B", unit_scale=True, desc="  binarize", file=sys.stderr, disable=None)
