"""A corpus preprocessed as shards by many tasks (shardlab_tasks/lm/corpus/shards.py, shardlab-preprocess
--tasks/--shards) gives one process's tokens, survives a task killed mid-shard, and is read by training in the global
sample order."""

from __future__ import annotations

import json
import os
import random
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from shardlab.errors import ConfigError, DataError
from shardlab.runner import build_task, prepare_data
from shardlab_commands import preprocess_lm
from shardlab_tasks.lm.corpus.cache import prepare_corpus, preprocess_shards
from shardlab_tasks.lm.corpus.corpus import find_sources
from shardlab_tasks.lm.corpus.data import TokenBlocks, open_splits
from shardlab_tasks.lm.corpus.shards import finished_shards, plan_shards
from shardlab_tasks.lm.corpus.tokenizer import ByteTokenizer
from tests.conftest import ROOT, compose_config

TOOL = ROOT / "tools" / "preprocess_lm.py"
WORDS = ["alpha", "beta", "gamma", "delta", "épée", "naïve", "\n"]


def write_corpus(root: Path, num_files: int = 10, lines: int = 150, seed: int = 0) -> Path:
    """JSONL files and text files of random words: enough documents that each of 4 shards holds valid ones."""
    rng = random.Random(seed)
    root.mkdir(parents=True, exist_ok=True)
    for f in range(num_files):
        docs = [" ".join(rng.choices(WORDS, k=rng.randint(3, 300))) for _ in range(lines)]
        if f % 3 == 2:
            (root / f"doc-{f:02d}.txt").write_text("\n".join(docs))
        else:
            (root / f"part-{f:02d}.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    return root


def stream(corpus: Path, split: str) -> np.ndarray:
    """A split's whole token stream, read as training reads it (one file or the manifest's shards)."""
    blocks = open_splits(corpus, 1)[0 if split == "train" else 1]
    return np.concatenate([np.asarray(blocks._tokens(j)) for j in range(len(blocks.files))])


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return write_corpus(tmp_path_factory.mktemp("sharded") / "corpus")


def test_four_local_tasks_give_one_process_tokens_token_for_token(corpus, tmp_path):
    one = prepare_corpus(str(corpus), str(tmp_path / "one"), "byte", 10.0, 0, num_workers=0)
    four = preprocess_lm.main([str(corpus), "--cache-dir", str(tmp_path / "four"), "--valid-percent", "10",
                               "--tasks", "4"])  # fmt: skip
    single_shard, _ = preprocess_shards(str(corpus), str(tmp_path / "s1"), ByteTokenizer(), 10.0, "text", 1)
    assert four.name == one.name  # the cache key of today: training finds either where it looks
    meta_one, meta_four = (json.loads((d / "meta.json").read_text()) for d in (one, four))
    assert [s["name"] for s in meta_four["shards"]] == ["00000", "00001", "00002", "00003"]
    assert all(s["valid_tokens"] > 0 for s in meta_four["shards"])  # every shard holds documents of each split
    for split in ("train", "valid"):
        reference = np.fromfile(one / f"{split}.bin", dtype=meta_one["dtype"])
        assert reference.size > 1000
        np.testing.assert_array_equal(stream(four, split), reference)
        np.testing.assert_array_equal(stream(single_shard, split), reference)
    # the ranks' comparison sees the same data whichever way it was built
    assert meta_four["content_digest"] == meta_one["content_digest"]
    assert (meta_four["train_tokens"], meta_four["documents"]) == (meta_one["train_tokens"], meta_one["documents"])


def test_shards_are_contiguous_runs_of_the_files_in_order(corpus):
    sources = find_sources(corpus)
    for n in (1, 3, 4, 7, 50):
        groups = plan_shards(sources, n)
        assert [s for g in groups for s in g] == sources
        assert len(groups) == min(n, len(sources)) and all(groups)  # as many as asked (or files), none empty


def test_a_sample_crossing_shards_is_the_single_file_one(tmp_path):
    tokens = np.arange(5000, dtype=np.uint16) % 997
    tokens.tofile(tmp_path / "all.bin")
    cuts = [0, 3, 3, 40, 41, 1200, 4999, 5000]  # an empty shard, shards shorter than a sample, one token
    files = []
    for k, (a, b) in enumerate(zip(cuts, cuts[1:], strict=False)):
        files.append(tmp_path / f"{k}.bin")
        tokens[a:b].tofile(files[-1])
    for seq_len in (1, 7, 64):
        whole, sharded = TokenBlocks(tmp_path / "all.bin", seq_len), TokenBlocks(files, seq_len)
        assert len(sharded) == len(whole) == (5000 - 1) // seq_len
        for i in range(len(whole)):
            assert torch.equal(sharded[i], whole[i]), (seq_len, i)


def test_a_task_killed_mid_shard_is_redone_alone_and_the_manifest_waits_for_it(tmp_path):
    corpus = write_corpus(tmp_path / "corpus", num_files=6, lines=120, seed=1)
    big = corpus / "part-03.jsonl"  # shard 2 of 4 is one large file: time for the kill to land mid-shard
    line = json.dumps({"text": " ".join(random.Random(2).choices(WORDS, k=3000))}) + "\n"
    big.write_text(line * (40 * 2**20 // len(line)))
    cache = tmp_path / "cache"
    args = [str(corpus), "--cache-dir", str(cache), "--workers", "0", "--shards", "4", "--num-tasks", "4"]
    out = preprocess_lm.main([*args, "--task-index", "0"])
    groups = plan_shards(find_sources(corpus), 4)
    assert [big] == [s.path for s in groups[2]]
    for k in (1, 3):
        preprocess_lm.main([*args, "--task-index", str(k)])
    assert finished_shards(out, groups) == [True, True, False, True]
    assert not (out / "meta.json").exists()  # three of four shards: no manifest

    task = subprocess.Popen([sys.executable, str(TOOL), *args, "--task-index", "2"], env=os.environ)
    deadline = time.monotonic() + 120
    while not any(p.stat().st_size for p in (out / "shards").glob(".tmp-00002-*/train.bin")):
        assert task.poll() is None and time.monotonic() < deadline, "task 2 ended before it could be killed"
        time.sleep(0.005)
    task.send_signal(signal.SIGKILL)
    task.wait()
    assert not (out / "shards" / "00002").exists() and not (out / "meta.json").exists()

    # training before the last shard: one line with the command that finishes it
    with pytest.raises(DataError) as caught:
        prepare_corpus(str(corpus), str(cache), "byte", 5.0, 0, num_workers=0)
    assert re.search(r"being preprocessed as 4 shards \(3 finished, no manifest yet\); finish it with: python "
                     rf"shardlab-preprocess {corpus} --cache-dir {cache} --shards 4", str(caught.value))  # fmt: skip

    kept = {k: [(p.stat().st_ino, p.stat().st_mtime_ns) for p in sorted((out / "shards" / f"0000{k}").iterdir())]
            for k in (0, 1, 3)}  # fmt: skip
    assert preprocess_lm.main([str(corpus), "--cache-dir", str(cache), "--tasks", "4"]) == out  # the whole command
    for k, before in kept.items():
        assert [
            (p.stat().st_ino, p.stat().st_mtime_ns) for p in sorted((out / "shards" / f"0000{k}").iterdir())
        ] == before
    assert finished_shards(out, groups) == [True] * 4 and (out / "meta.json").is_file()
    assert not list((out / "shards").glob(".tmp-*"))  # the killed task's temporary directory is gone
    meta = json.loads((out / "meta.json").read_text())
    record = json.loads((out / "shards" / "00002" / "record.json").read_text())
    assert record["files"] == [{"path": str(big), "size": big.stat().st_size, "mtime_ns": big.stat().st_mtime_ns}]
    assert meta["shards"][2]["train_tokens"] == record["train_tokens"] > 20_000_000


def test_a_shard_whose_input_changed_is_redone(corpus, tmp_path):
    out, _ = preprocess_shards(str(corpus), str(tmp_path), ByteTokenizer(), 10.0, "text", 3)
    groups = plan_shards(find_sources(corpus), 3)
    record_file = out / "shards" / "00001" / "record.json"
    record = json.loads(record_file.read_text())
    record["files"][0]["mtime_ns"] -= 1  # as if the file was rewritten while its shard was built
    record_file.write_text(json.dumps(record))
    assert finished_shards(out, groups) == [True, False, True]


def test_another_shard_count_is_refused_while_the_first_shards_remain(corpus, tmp_path):
    preprocess_lm.main([str(corpus), "--cache-dir", str(tmp_path), "--shards", "4", "--num-tasks", "4",
                        "--task-index", "0"])  # fmt: skip
    with pytest.raises(ConfigError, match=r"being preprocessed as 4 shards .*; rerun with --shards 4"):
        preprocess_lm.main([str(corpus), "--cache-dir", str(tmp_path), "--shards", "3"])


def test_training_above_build_cache_max_mb_names_the_command_and_reads_what_it_builds(corpus, tmp_path):
    size_mb = sum(p.stat().st_size for p in corpus.iterdir()) / 2**20
    overrides = [f"data.path={corpus}", f"data.cache_dir={tmp_path}", "data.valid_percent=10", "data.seq_len=64"]
    cfg = compose_config([*overrides, f"data.build_cache_max_mb={size_mb / 2}"])
    with pytest.raises(DataError) as caught:
        prepare_data(build_task(cfg, 1))
    message = str(caught.value)
    assert "\n" not in message and f"above data.build_cache_max_mb={size_mb / 2:g}" in message, message
    assert f"shardlab-preprocess {corpus} --cache-dir {tmp_path} --valid-percent 10.0 --tasks 4" in message
    assert not list(tmp_path.iterdir())  # nothing started: no lock, no temporary directory

    preprocess_lm.main([str(corpus), "--cache-dir", str(tmp_path), "--valid-percent", "10.0", "--tasks", "2"])
    task = build_task(cfg, 1)
    prepare_data(task)  # the same job now trains, on the shards
    reference = prepare_corpus(str(corpus), str(tmp_path / "one"), "byte", 10.0, 0, num_workers=0)
    train, valid = open_splits(reference, 64)
    assert len(task.train_dataset) == len(train) and len(task.valid_dataset) == len(valid)
    for i in (0, 1, len(train) // 2, len(train) - 1):
        assert torch.equal(task.train_dataset[i], train[i])
    # below the threshold a job builds the cache itself, as before
    small = compose_config([*overrides[:1], f"data.cache_dir={tmp_path / 'built'}", *overrides[2:]])
    prepare_data(build_task(small, 1))
    assert list((tmp_path / "built").glob("corpus-*/train.bin"))


def test_local_tasks_share_the_machines_cores_out_unless_workers_is_given(corpus, tmp_path, monkeypatch):
    """A BPE task threads over every core unless told: --tasks N gives each task cores // N (at least 1)."""
    assert [preprocess_lm.task_workers(-1, n, 8) for n in (1, 2, 4, 16)] == [8, 4, 2, 1]
    assert preprocess_lm.task_workers(0, 4, 8) == 0 and preprocess_lm.task_workers(3, 4, 8) == 3  # as given
    started, popen = [], subprocess.Popen

    def recording(argv, *a, **k):
        started.append(argv[argv.index("--workers") + 1])
        return popen(argv, *a, **k)

    monkeypatch.setattr(preprocess_lm.subprocess, "Popen", recording)
    preprocess_lm.main([str(corpus), "--cache-dir", str(tmp_path), "--tasks", "2"])
    assert started == [str(max(1, len(os.sched_getaffinity(0)) // 2))] * 2


@pytest.mark.parametrize("tasks", [1, 2])
def test_the_train_with_line_finds_this_cache_with_its_tokenizer(corpus, tmp_path, capfd, tasks):
    """The summary's overrides, pasted as they are printed, make training read this very cache: without its
    tokenizer (and end-of-document token) training keyed, and built, a byte-level one instead."""
    from shardlab_tasks.lm.corpus.corpus import iter_texts
    from shardlab_tasks.lm.corpus.tokenizer import train_bpe

    tok = train_bpe(iter_texts(find_sources(corpus), "text", 2**20), 300, tmp_path / "tok" / "tokenizer.json")
    cache = tmp_path / "cache"
    out = preprocess_lm.main([str(corpus), "--cache-dir", str(cache), "--tokenizer", str(tok), "--eod-token",
                              "<|endoftext|>", "--valid-percent", "10", "--tasks", str(tasks)])  # fmt: skip
    line = [x for x in capfd.readouterr().out.splitlines() if "train with" in x][-1]  # a task prints it
    overrides = shlex.split(line.split("train with", 1)[1].removeprefix(":").replace("python -m shardlab.train", ""))
    assert f"data.tokenizer={tok}" in overrides and "data.eod_token='<|endoftext|>'" in overrides, overrides
    task = build_task(compose_config([*overrides, "data.seq_len=64"]), 1)
    assert task.corpus() == out and [p.name for p in cache.iterdir() if not p.name.startswith(".")] == [out.name]


def test_a_sharded_corpus_without_a_validation_document_names_the_way_out_and_it_works(tmp_path):
    """Few documents, a tiny held-out share: no document hashes into the validation split, so the manifest is
    refused; the message's two steps (delete the shards, one task) give a cache that holds one document out."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for k in range(4):
        (corpus / f"doc{k}.txt").write_text(" ".join(WORDS * (50 + k)))
    cache = tmp_path / "cache"
    preprocess_shards(str(corpus), str(cache), ByteTokenizer(), 0.001, "text", 2, (0, 2))
    with pytest.raises(DataError) as caught:
        preprocess_shards(str(corpus), str(cache), ByteTokenizer(), 0.001, "text", 2, (1, 2))
    message = str(caught.value)
    out = re.search(r"rm -r (\S+)\)", message)
    assert out and "without --shards/--tasks" in message, message
    shutil.rmtree(out[1])
    one = prepare_corpus(str(corpus), str(cache), "byte", 0.001, 0, num_workers=0)
    assert json.loads((one / "meta.json").read_text())["documents"]["valid"] == 1


def test_caches_are_readable_by_whoever_the_umask_lets_read_them(corpus, tmp_path):
    """A cache shared on a cluster: its folders get a plain mkdir's mode, not mkdtemp's 0700."""
    old = os.umask(0o022)
    try:
        one = prepare_corpus(str(corpus), str(tmp_path / "one"), "byte", 10.0, 0, num_workers=0)
        sharded, _ = preprocess_shards(str(corpus), str(tmp_path / "two"), ByteTokenizer(), 10.0, "text", 2)
        os.umask(0o077)
        private = prepare_corpus(str(corpus), str(tmp_path / "private"), "byte", 10.0, 0, num_workers=0)
    finally:
        os.umask(old)
    folders = [one, sharded, *sorted(p for p in (sharded / "shards").iterdir() if p.is_dir())]
    assert [oct(p.stat().st_mode & 0o777) for p in folders] == [oct(0o755)] * len(folders)
    assert private.stat().st_mode & 0o777 == 0o700  # the user's umask still rules
