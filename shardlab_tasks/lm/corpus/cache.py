"""The cache of preprocessed corpora: one directory per (corpus files, tokenizer, split settings), built once.

A preprocessed corpus is a directory with train.bin / valid.bin (token ids, uint16 when the vocabulary fits, else
uint32) and meta.json (see shardlab_tasks/lm/corpus/binarize.py). Documents end with an end-of-document token; a
document (a file, a JSONL line, a Parquet or Arrow row, or a ~1 MB block of a large file) goes to valid when a hash of
its path (and line, row or block number) says so, so the split is stable as files are added. The embedded default corpus
is this Python's standard library source: real text that every machine already has. No torch here: shardlab-preprocess
and its workers stay small (importing torch alone is ~650 MB RSS).
"""

from __future__ import annotations

import hashlib
import os
import sys
import sysconfig
from pathlib import Path

import numpy as np

from shardlab.errors import DataError
from shardlab_tasks.lm.corpus import shards
from shardlab_tasks.lm.corpus.binarize import FORMAT_VERSION, binarize
from shardlab_tasks.lm.corpus.cache_files import read_cache_json, token_file_size
from shardlab_tasks.lm.corpus.cache_lock import build_once
from shardlab_tasks.lm.corpus.corpus import find_sources, glob_root
from shardlab_tasks.lm.corpus.sources import Source
from shardlab_tasks.lm.corpus.tokenizer import Tokenizer, load_tokenizer


def embedded_corpus_files() -> list[Path]:
    """The standard library's own modules (tests and vendored packages excluded), in a stable order."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    skip = {"test", "tests", "idlelib", "site-packages", "dist-packages", "lib2to3", "__pycache__", "turtledemo"}
    files = []
    # Skipped folders are pruned, not walked: a pyenv or conda site-packages below the stdlib holds ~100x more files.
    for folder, subfolders, names in os.walk(stdlib):
        subfolders[:] = [d for d in subfolders if d not in skip]
        files.extend(Path(folder, n) for n in names if n.endswith(".py"))
    return sorted(files)


def corpus_sources(path: str | None) -> tuple[list[Source], str]:
    """(the corpus files, a name for its cache directory) for data.path (None = the embedded corpus)."""
    if path is None:
        stdlib = Path(sysconfig.get_paths()["stdlib"])
        files = [Source(p, str(p.relative_to(stdlib))) for p in embedded_corpus_files()]
        return files, f"stdlib-py{sys.version_info.major}{sys.version_info.minor}"
    root = Path(path).expanduser().resolve()
    return find_sources(root), (glob_root(root).name.split(".")[0] or "corpus")


def cache_key(sources: list[Source], tokenizer: Tokenizer, valid_percent: float, max_bytes: int, field: str) -> str:
    """Names the cache by everything its tokens depend on: the settings, and each file's identity (path, size and
    modification time; a glob, a directory and a list of the same files agree) - a shard replaced, added or removed
    makes another cache, without reading a byte of the corpus."""
    h = hashlib.sha1(f"{FORMAT_VERSION}|{tokenizer.fingerprint}|{valid_percent}|{max_bytes}|{field}".encode())
    for s in sources:
        st = s.path.stat()
        h.update(f"{s.path}|{st.st_size}|{st.st_mtime_ns}".encode())
    return h.hexdigest()[:16]


def default_workers(sources: list[Source]) -> int:
    """One worker per core for corpora worth it; in-process below 16 MB, where starting workers costs more."""
    return 0 if sum(s.path.stat().st_size for s in sources) < 16 * 2**20 else (os.cpu_count() or 1)


def prepare_corpus(
    path: str | None,
    cache_dir: str,
    tokenizer: str | Tokenizer,
    valid_percent: float,
    max_mb: float,
    text_field: str = "text",
    num_workers: int = -1,
    extra_files: dict[str, Path] | None = None,
    build_max_mb: float = 0.0,
) -> Path:
    """The preprocessed directory for a corpus (built on first use, reused after).

    ``tokenizer``: 'byte', a tokenizer.json path, or a loaded tokenizer; ``text_field``: the JSONL key or Parquet
    and Arrow column of the text; ``num_workers`` -1 = chosen by size; ``build_max_mb`` > 0: a corpus larger than
    this without a finished cache is refused with the command that builds it (data.build_cache_max_mb), not built.
    """
    tok = load_tokenizer(tokenizer) if isinstance(tokenizer, str) else tokenizer
    sources, name = corpus_sources(path)
    max_bytes = int(max_mb * 2**20)
    out = Path(cache_dir).expanduser() / f"{name}-{cache_key(sources, tok, valid_percent, max_bytes, text_field)}"
    if not (out / "meta.json").is_file():
        _refuse_to_build(out, sources, build_max_mb, shards.preprocess_command(
            path, cache_dir, tok.name, valid_percent, text_field))  # fmt: skip

    def build() -> None:
        workers = default_workers(sources) if num_workers < 0 else num_workers
        print(f"preprocessing {len(sources)} files from {path or 'the embedded corpus'} into {out} ...", flush=True)
        source = str(path or "embedded")
        meta = binarize(sources, out, tok, valid_percent, max_bytes, text_field, workers, extra_files, source)
        print(f"  {meta['train_tokens']:,} train / {meta['valid_tokens']:,} valid tokens ({meta['dtype']})", flush=True)

    # Every process that asks (ranks, jobs, nodes) gets the same directory; one of them builds it, the others wait
    # for its meta.json - never in a collective, so preprocessing takes as long as it needs.
    build_once(out, build, lambda line: print(line, flush=True))
    return out


def _refuse_to_build(out: Path, sources: list[Source], build_max_mb: float, command: str) -> None:
    """A training job does not become the one writer of a corpus that takes hours (every node would wait on it), nor
    of one being preprocessed as shards: it stops, before training, with the command that builds or finishes it."""
    started = shards.progress(out)
    if started is not None:
        done, planned = started
        raise DataError(
            f"{out} is being preprocessed as {planned} shards ({done} finished, no manifest yet); finish it with: "
            f"{command} --shards {planned} (a rerun redoes only the unfinished shards), then train again"
        )
    size_mb = sum(s.path.stat().st_size for s in sources) / 2**20
    if build_max_mb > 0 and size_mb > build_max_mb:
        raise DataError(
            f"data.path holds {size_mb:,.0f} MB, above data.build_cache_max_mb={build_max_mb:g}, and has no finished "
            f"cache ({out}); build it first, as many tasks: {command} --tasks 4 (or a Slurm array: "
            f"docs/corpora.md#preprocessing-as-shards), or raise data.build_cache_max_mb to build it in this job"
        )


def preprocess_shards(
    path: str | None,
    cache_dir: str,
    tok: Tokenizer,
    valid_percent: float,
    text_field: str,
    num_shards: int,
    task: tuple[int, int] = (0, 1),
    num_workers: int = 0,
) -> tuple[Path, dict | None]:
    """Task ``task[0]`` of ``task[1]``: build the unfinished shards k with k % task[1] == task[0] of a corpus cut
    into ``num_shards``, then write the manifest if every shard is finished. Returns (the cache directory, the
    manifest or None while shards remain)."""
    sources, name = corpus_sources(path)
    out = Path(cache_dir).expanduser() / f"{name}-{cache_key(sources, tok, valid_percent, 0, text_field)}"
    if (out / "meta.json").is_file():
        print(f"{out} is finished; nothing to do", flush=True)
        return out, read_corpus_meta(out)
    groups = shards.plan_shards(sources, num_shards)
    shards.write_plan(out, groups, num_shards)
    index, count = task
    done = shards.finished_shards(out, groups)
    for k in range(index, len(groups), count):
        if done[k]:
            print(f"shard {k} of {len(groups)}: finished before, kept", flush=True)
            continue
        record = shards.build_shard(out, k, groups[k], tok, valid_percent, text_field, num_workers)
        print(
            f"shard {k} of {len(groups)}: {len(groups[k])} files, {record['train_tokens']:,} train / "
            f"{record['valid_tokens']:,} valid tokens in {record['seconds']:.1f} s",
            flush=True,
        )
    extra = {"source": str(path or "embedded"), "text_field": text_field}
    return out, shards.write_manifest(out, groups, tok, extra)


TOKEN_DTYPES = ("uint16", "uint32")
"""What binarize writes token files in (tokenizer.token_dtype: uint32 once a vocabulary outgrows uint16)."""


def read_corpus_meta(corpus: Path) -> dict:
    """meta.json of a preprocessed corpus; formats 1 (uint16 only) and 2 read, newer ones are refused, and so is a
    token dtype binarize never writes or token files whose size is not the token counts it records (a shared cache
    someone edited: numpy would map an object dtype's bytes as pointers)."""
    meta = read_cache_json(corpus / "meta.json", corpus)
    if not isinstance(meta.get("format", 1), int):
        raise DataError(f"{corpus / 'meta.json'} gives no format number; delete {corpus} to preprocess again")
    if meta.get("format", 1) > FORMAT_VERSION:
        raise DataError(
            f"{corpus} was written by a newer shardlab (format {meta['format']} > {FORMAT_VERSION}); "
            "upgrade shardlab or delete that directory to preprocess again"
        )
    meta.setdefault("dtype", "uint16")
    if meta["dtype"] not in TOKEN_DTYPES:
        raise DataError(
            f"{corpus / 'meta.json'} gives the token dtype {meta['dtype']!r}, which preprocessing never writes "
            f"({' or '.join(TOKEN_DTYPES)}); delete {corpus} to preprocess again"
        )
    itemsize = np.dtype(meta["dtype"]).itemsize
    if "shards" in meta:  # a manifest: each shard's files against the tokens it records
        wrong = shards.shard_sizes_ok(corpus, meta, itemsize)
        if wrong:
            raise DataError(f"{wrong}; delete {corpus} to preprocess again")
        return meta
    for split in ("train", "valid"):
        recorded = meta.get(f"{split}_tokens")
        size = token_file_size(corpus / f"{split}.bin", corpus)
        if recorded is not None and size != recorded * itemsize:
            raise DataError(
                f"{corpus / (split + '.bin')} holds {size} bytes, not the {recorded:,} {meta['dtype']} tokens its "
                f"meta.json records; delete {corpus} to preprocess again"
            )
    return meta
