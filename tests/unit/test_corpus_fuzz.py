"""Corpus records fuzzed (issue 41, item 10): seeded mutations of JSONL lines, text files, their gzip and zstd, and
Parquet files, each read as preprocessing reads it (find the files, check them, read the blocks, parse and tokenize).
Every case must end in bounded time and memory, either read or refused in one line (a DataError); nothing else."""

from __future__ import annotations

import functools
import gzip
import io
import json
import random
from pathlib import Path

import numpy as np
import pytest

from shardlab.errors import DataError
from shardlab_tasks.lm.corpus import corpus
from shardlab_tasks.lm.corpus.binarize import encode_block
from shardlab_tasks.lm.corpus.corpus import check_sources, find_sources, read_blocks
from shardlab_tasks.lm.corpus.tokenizer import ByteTokenizer
from tests import fuzzing

SEED = 41
CASES = 150
"""Cases per format: the whole file runs in ~10 s on the 2-core development machine."""
MAX_SECONDS = 2.0
MAX_PEAK_BYTES = 96 << 20
"""Python allocations at the peak of a case (tracemalloc): a record is capped at 1 MiB below, so a reader holding
more than a few copies of one, or a whole decompressed bomb, fails."""
RECORD_CAP = 1 << 20


def documents(rng: random.Random) -> list[str]:
    words = ["alpha", "béta", "γάμμα", "漢字", "\t", "\\", '"', "\u2028", "\x00", "{", "]", "\ud7ff", "😀"]
    return ["".join(rng.choice(words) + " " for _ in range(rng.randrange(1, 40))) for _ in range(rng.randrange(1, 30))]


def jsonl(rng: random.Random) -> bytes:
    return "".join(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(documents(rng))).encode()


def mutate(rng: random.Random, data: bytes) -> bytes:
    """One to three of: bytes flipped, inserted or dropped, a cut, a piece repeated, or a crafted record spliced in
    (deep nesting, a huge number, a line past the record cap, a non-string text, bytes that are not UTF-8)."""
    crafted = [
        b"[" * 200_000 + b"\n",
        b'{"text": ' + b"[" * 100_000 + b"]" * 100_000 + b"}\n",
        b'{"text": ' + b"9" * 50_000 + b"}\n",
        b'{"text": "' + b"x" * (RECORD_CAP + 10) + b'"}\n',
        b'{"text": "' + b"y" * (RECORD_CAP + 10),
        b'{"text": null}\n{"text": {"a": 1}}\n{"nope": "x"}\n',
        b"\xff\xfe\xc3\x28\xed\xa0\x80\n",
        b'{"text": "\\ud800"}\n',
        b"\r\r\n\n\x00\n",
    ]
    return fuzzing.mutate(rng, data, crafted)


def compressed(kind: str, data: bytes) -> bytes:
    if kind == "gz":
        return gzip.compress(data, mtime=0)
    import zstandard

    return zstandard.ZstdCompressor().compress(data)


def parquet(rng: random.Random) -> bytes:
    import pyarrow as pa
    import pyarrow.parquet as pq

    out = io.BytesIO()
    pq.write_table(pa.table({"text": documents(rng)}), out, row_group_size=rng.randrange(1, 8))
    return out.getvalue()


def case(rng: random.Random, fmt: str) -> tuple[str, bytes]:
    """(file name, file bytes) of one fuzzed corpus file of format ``fmt``."""
    if fmt in ("jsonl", "txt"):
        return f"c.{fmt}", mutate(rng, jsonl(rng))
    if fmt in ("jsonl.gz", "jsonl.zst"):
        kind = fmt.split(".")[1]
        if rng.random() < 0.5:  # damaged in the compressed bytes, or well compressed damaged records
            return f"c.{fmt}", mutate(rng, compressed(kind, jsonl(rng)))
        return f"c.{fmt}", compressed(kind, mutate(rng, jsonl(rng)))
    # nearly every mutation breaks a Parquet file's footer or pages: some files stay whole, to be read to the end
    return "c.parquet", parquet(rng) if rng.random() < 0.2 else mutate(rng, parquet(rng))


def read_as_preprocessing_does(path: Path) -> int:
    """Tokens of the corpus ``path``, read as binarize reads it (in-process: what a worker does, done here)."""
    sources = find_sources(path)
    check_sources(sources, "text")
    tokenizer, n = ByteTokenizer(), 0
    for source in sources:
        for block in read_blocks(source, block_bytes=4096):
            train, valid = encode_block(tokenizer, block, 5.0, "text", np.dtype("uint16"))
            n += train.size + valid.size
    return n


@pytest.mark.parametrize("fmt", ["jsonl", "txt", "jsonl.gz", "jsonl.zst", "parquet"])
def test_fuzzed_corpus_records_are_read_or_refused_in_one_line_in_bounded_time_and_memory(tmp_path, monkeypatch, fmt):
    monkeypatch.setattr(corpus, "MAX_RECORD_BYTES", RECORD_CAP)
    rng = random.Random(f"{SEED}-{fmt}")
    outcomes = {"read": 0, "refused": 0}
    for i in range(CASES):
        name, data = case(rng, fmt)
        folder = tmp_path / str(i)
        folder.mkdir()
        (folder / name).write_bytes(data)
        fuzzing.bounded_read(
            functools.partial(read_as_preprocessing_does, folder),
            DataError,
            outcomes,
            f"case {i} ({name}, {len(data)} bytes)",
            MAX_SECONDS,
            MAX_PEAK_BYTES,
        )
    assert outcomes["read"] and outcomes["refused"], outcomes  # the mutations reach both ends
