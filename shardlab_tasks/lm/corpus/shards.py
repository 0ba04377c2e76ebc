"""A corpus preprocessed as shards by many tasks (local processes, a Slurm array, a multi-task job), and the manifest
that makes them one cache.

The shards live in the cache directory of today's key (shardlab_tasks/lm/corpus/cache.py), so training finds them where
it would find one train.bin:

    <out>/shards/plan.json              which corpus files each shard holds: contiguous runs of the canonical order
    <out>/shards/00002/train.bin        a finished shard: its tokens ...
    <out>/shards/00002/valid.bin
    <out>/shards/00002/record.json      ... and what it read (each file's path, size, mtime), its token counts
    <out>/meta.json                     the manifest: written once every shard is finished, it lists them in order

A shard boundary is a file boundary and a document's split hashes only its path and position, so the train (valid)
stream - the shards' train.bin (valid.bin) concatenated in shard order - is token for token the train.bin (valid.bin)
of one process. A shard is written into a temporary directory, fsynced and renamed into place: a task killed
mid-shard leaves no shard that looks finished, and a rerun redoes only the shards without a record (or whose record
names an input that has since changed). Whichever task finishes the last shard writes the manifest.
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import shutil
import socket
import time
from collections.abc import Iterator
from pathlib import Path

from shardlab.errors import ConfigError, DataError
from shardlab.files.durable import fsync_path, write_json_atomic
from shardlab_tasks.lm.corpus.binarize import FORMAT_VERSION, _encoded, temp_folder
from shardlab_tasks.lm.corpus.cache_files import open_cache_file, read_cache_json, token_file_size
from shardlab_tasks.lm.corpus.corpus import check_sources, read_blocks
from shardlab_tasks.lm.corpus.sources import Block, Source
from shardlab_tasks.lm.corpus.tokenizer import Tokenizer, token_dtype

SHARDS = "shards"
PLAN = "plan.json"
RECORD = "record.json"
TMP = ".tmp-"


def shard_name(k: int) -> str:
    return f"{k:05d}"


def plan_shards(sources: list[Source], num_shards: int) -> list[list[Source]]:
    """The files cut into min(num_shards, files) contiguous runs of about equal bytes, none empty: a file is never
    split, so a shard boundary is always a document boundary."""
    sizes = [s.path.stat().st_size for s in sources]
    n, total = max(1, min(num_shards, len(sources))), max(sum(sizes), 1)
    groups: list[list[Source]] = [[]]
    before = 0
    for i, (s, size) in enumerate(zip(sources, sizes, strict=True)):
        # a new run starts where a file's middle byte passes the next boundary, or where every file left must start
        # one for the runs still to come to be non-empty
        crosses = before + size / 2 > len(groups) * total / n
        if groups[-1] and len(groups) < n and (crosses or len(sources) - i <= n - len(groups)):
            groups.append([])
        groups[-1].append(s)
        before += size
    return groups


def file_identity(source: Source) -> dict:
    st = source.path.stat()
    return {"path": str(source.path), "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def write_plan(out: Path, groups: list[list[Source]], num_shards: int) -> None:
    """The plan every task follows; a rerun asking for another number of shards is refused while shards of the first
    remain (its finished shards would no longer line up with the new ones)."""
    plan = {"num_shards_asked": num_shards, "shards": [[str(s.path) for s in g] for g in groups]}
    path = out / SHARDS / PLAN
    old = read_cache_json(path, out, missing_ok=True)
    if old is not None:
        if old.get("shards") != plan["shards"]:
            raise ConfigError(
                f"{out} is being preprocessed as {old['num_shards_asked']} shards ({path}), not {num_shards}; rerun "
                f"with --shards {old['num_shards_asked']}, or delete {out} to start again"
            )
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, plan)


def finished_shards(out: Path, groups: list[list[Source]]) -> list[bool]:
    """Which shards hold a record that still matches their files (size and mtime, as the cache key does)."""
    done = []
    for k, group in enumerate(groups):
        record = read_cache_json(out / SHARDS / shard_name(k) / RECORD, out, missing_ok=True)
        done.append(record is not None and record.get("files") == [file_identity(s) for s in group])
    return done


def build_shard(out: Path, k: int, group: list[Source], tok: Tokenizer, vp: float, field: str, workers: int) -> dict:
    """Tokenize one shard into out/shards/<k> atomically, replacing a stale one; returns its record."""
    check_sources(group, field)
    shards = out / SHARDS
    final = shards / shard_name(k)
    _remove_dead_temps(shards, k)
    tmp = temp_folder(f"{TMP}{shard_name(k)}-{socket.gethostname()}-{os.getpid()}-", shards)
    try:
        record = {"shard": k, "files": [file_identity(s) for s in group], "host": socket.gethostname()}
        record.update(_write_shard(group, tmp, tok, vp, field, workers))
        (tmp / RECORD).write_text(json.dumps(record, indent=1))
        for f in tmp.iterdir():
            fsync_path(f)
        fsync_path(tmp)
        if final.exists():  # a stale shard (an input changed since): the new one replaces it
            shutil.rmtree(final)
        os.replace(tmp, final)
        fsync_path(shards)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return record


def _write_shard(group: list[Source], tmp: Path, tok: Tokenizer, vp: float, field: str, workers: int) -> dict:
    """binarize's streaming without its small-corpus hold-out: a shard's split is each document's own hash alone."""
    dtype = token_dtype(tok.vocab_size)
    counts, docs, read = {"train": 0, "valid": 0}, {"train": 0, "valid": 0}, 0
    start = time.perf_counter()

    def blocks() -> Iterator[Block]:
        nonlocal read
        for s in group:
            for b in read_blocks(s, text_field=field):
                read += b.size
                yield b

    files = {split: open(tmp / f"{split}.bin", "wb") for split in counts}  # noqa: SIM115
    try:
        for encoded in _encoded(blocks(), tok, vp, field, dtype, workers):
            for i, (split, tokens) in enumerate(zip(counts, (encoded.train, encoded.valid), strict=True)):
                if tokens.size:
                    tokens.tofile(files[split])
                    counts[split] += tokens.size
                docs[split] += encoded.documents[i]
    finally:
        for f in files.values():
            f.close()
    seconds = round(time.perf_counter() - start, 3)
    return {"dtype": dtype.name, "train_tokens": counts["train"], "valid_tokens": counts["valid"],
            "documents": docs, "bytes_read": read, "seconds": seconds}  # fmt: skip


def _remove_dead_temps(shards: Path, k: int) -> None:
    """A task killed mid-shard leaves its temporary directory: the task that redoes the shard removes it (only this
    host's, whose process is gone; another host's is left to the manifest step)."""
    from shardlab.files.liveness import process_alive

    prefix = f"{TMP}{shard_name(k)}-{socket.gethostname()}-"
    for tmp in shards.glob(prefix + "*"):
        pid = tmp.name[len(prefix) :].split("-")[0]
        if pid.isdigit() and not process_alive(int(pid)):
            shutil.rmtree(tmp, ignore_errors=True)


def write_manifest(out: Path, groups: list[list[Source]], tok: Tokenizer, meta_extra: dict) -> dict | None:
    """Once every shard is finished: out/meta.json listing them in order, with the totals and the digest one
    process's cache would have. None (nothing written) while a shard is missing."""
    if not all(finished_shards(out, groups)):
        return None
    records = [read_cache_json(out / SHARDS / shard_name(k) / RECORD, out) for k in range(len(groups))]
    total = {split: sum(r[f"{split}_tokens"] for r in records) for split in ("train", "valid")}
    if total["valid"] == 0:
        raise DataError(
            f"{out}: no document of the corpus hashed into the validation split; a corpus this small is preprocessed "
            f"by one task, which holds documents out for it: delete the shards (rm -r {out}), then run "
            "shardlab-preprocess without --shards/--tasks"
        )
    meta = {
        "format": FORMAT_VERSION,
        "tokenizer": tok.name,
        "tokenizer_fingerprint": tok.fingerprint,
        "vocab_size": tok.vocab_size,
        "eod": tok.eod,
        "dtype": records[0]["dtype"],
        "documents": {s: sum(r["documents"][s] for r in records) for s in ("train", "valid")},
        "train_tokens": total["train"],
        "valid_tokens": total["valid"],
        "bytes_read": sum(r["bytes_read"] for r in records),
        "seconds": round(sum(r["seconds"] for r in records), 3),
        "shards": [
            {"name": shard_name(k), "train_tokens": r["train_tokens"], "valid_tokens": r["valid_tokens"]}
            for k, r in enumerate(records)
        ],  # fmt: skip
        **meta_extra,
    }
    meta["content_digest"] = stream_digest({s: shard_files(out, meta, s) for s in ("train", "valid")}, out)
    write_json_atomic(out / "meta.json", meta)
    fsync_path(out)
    for tmp in (out / SHARDS).glob(TMP + "*"):  # temporaries of tasks that died on other hosts
        shutil.rmtree(tmp, ignore_errors=True)
    return meta


def shard_files(corpus: Path, meta: dict, split: str) -> list[Path]:
    """The token files of one split, in stream order: train.bin alone, or each shard's the manifest lists."""
    if "shards" not in meta:
        return [corpus / f"{split}.bin"]
    return [corpus / SHARDS / s["name"] / f"{split}.bin" for s in meta["shards"]]


def stream_digest(files: dict[str, list[Path]], cache: Path) -> str:
    """binarize.content_digest of the concatenated streams: a sharded cache and one process's agree (ranks compare
    it), since the hash sees bytes, not where a file ends."""
    h = hashlib.blake2b(digest_size=12)
    for split in ("train", "valid"):
        for path in files[split]:
            with open_cache_file(path, cache) as f:
                while chunk := f.read(1 << 24):
                    h.update(chunk)
        h.update(b"|")
    return h.hexdigest()


def progress(out: Path) -> tuple[int, int] | None:
    """(finished, planned) shards of a sharded build under way in ``out``; None when none was started there."""
    plan = read_cache_json(out / SHARDS / PLAN, out, missing_ok=True)
    if plan is None:
        return None
    if not isinstance(plan.get("shards"), list):
        raise DataError(f"{out / SHARDS / PLAN} lists no shards; delete {out} to preprocess again")
    finished = sum((out / SHARDS / shard_name(k) / RECORD).is_file() for k in range(len(plan["shards"])))
    return finished, len(plan["shards"])


def preprocess_command(path: str | None, cache_dir: str, tokenizer: str, valid_percent: float, field: str) -> str:
    """The shardlab-preprocess command that builds the cache training looks for (options only where they are not
    the defaults), as one shell line."""
    from shardlab_tasks.lm.config import LMDataConfig

    d = LMDataConfig()
    cmd = ["python", "shardlab-preprocess", *([str(Path(path).expanduser().resolve())] if path else [])]
    for flag, value, default in (
        ("--cache-dir", cache_dir, d.cache_dir),
        ("--tokenizer", tokenizer, d.tokenizer),
        ("--valid-percent", valid_percent, d.valid_percent),
        ("--text-field", field, d.text_field),
    ):
        if value != default:
            cmd += [flag, str(value)]
    return shlex.join(cmd)


def shard_sizes_ok(corpus: Path, meta: dict, itemsize: int) -> str | None:
    """The first shard token file whose size is not the tokens the manifest records (None: all agree)."""
    for split in ("train", "valid"):
        for f, s in zip(shard_files(corpus, meta, split), meta["shards"], strict=True):
            size = token_file_size(f, corpus)
            if size != s[f"{split}_tokens"] * itemsize:
                return f"{f} holds {size} bytes, not the {s[f'{split}_tokens']:,} tokens the manifest records"
    return None
