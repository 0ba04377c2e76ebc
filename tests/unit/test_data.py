"""Data: preprocessing, the byte tokenizer, and a data order that does not depend on the world size."""

from __future__ import annotations

import json

import numpy as np
import pytest

from shardlab.data import GlobalOrder, RankBatchSampler
from shardlab.errors import DataError
from shardlab_tasks.lm.corpus.corpus import find_sources
from shardlab_tasks.lm.corpus.data import TokenBlocks, prepare_corpus
from shardlab_tasks.lm.corpus.tokenizer import ByteTokenizer


def global_batches(world: int, start: int, batch: int, steps: int) -> list[list[int]]:
    order = GlobalOrder(50, seed=3)
    per_rank = [list(RankBatchSampler(order, start, batch, r, world, num_batches=steps)) for r in range(world)]
    return [sum((per_rank[r][s] for r in range(world)), []) for s in range(steps)]


@pytest.mark.parametrize("world", [2, 4])
def test_ranks_together_read_exactly_the_single_process_batch(world):
    assert global_batches(world, 0, 8, 20) == global_batches(1, 0, 8, 20)


def test_a_resumed_order_continues_where_it_stopped_on_any_world_size():
    full = global_batches(1, 0, 8, 20)
    assert global_batches(2, 8 * 7, 8, 13) == full[7:]


def test_order_is_a_fresh_permutation_every_epoch():
    order = GlobalOrder(50, seed=3)
    first, second = order.indices(0, 50), order.indices(50, 50)
    assert sorted(first) == sorted(second) == list(range(50))
    assert first != second


def test_every_rank_draws_a_new_epochs_shuffle_in_the_same_step(monkeypatch):
    """50 samples, global batch 8 over 2 ranks: step 6 reads samples 48-55, rank 0's slice (48-51) all in epoch 0
    and rank 1's (52-55) in epoch 1. Both ranks must draw epoch 1's permutation in step 6, or rank 1 spends that
    step drawing while rank 0 waits for it in a collective (a 10^8-block corpus takes seconds to shuffle)."""
    import torch

    drawn: dict[int, list[tuple[int, int]]] = {0: [], 1: []}
    real = torch.randperm
    for rank in (0, 1):
        step = {"n": 0}

        def randperm(n, generator=None, _rank=rank, _step=step):
            drawn[_rank].append((_step["n"], generator.initial_seed()))
            return real(n, generator=generator)

        monkeypatch.setattr(torch, "randperm", randperm)
        order = GlobalOrder(50, seed=3)
        for _ in RankBatchSampler(order, 0, 8, rank, 2, num_batches=13):
            step["n"] += 1
    assert drawn[0] == drawn[1] and len(drawn[0]) == 3  # epochs 0, 1, 2, each in the same step on both ranks
    assert [s for s, _ in drawn[0]] == [0, 6, 12]
    assert list(order._perms) == [1, 2], "the last batch (96-103) reads epochs 1 and 2; epoch 0's order is freed"


def test_byte_tokenizer_round_trips_any_text():
    tok = ByteTokenizer()
    text = "déjà vu — 漢字 ✓\n\tdef f(): pass"
    assert tok.decode(tok.encode(text)) == text
    assert max(tok.encode(text)) < 256 and tok.eod == 256 and tok.vocab_size == 257


@pytest.fixture
def corpus(tmp_path):
    root = tmp_path / "corpus"
    (root / "sub").mkdir(parents=True)
    for i in range(40):
        (root / "sub" / f"doc{i}.txt").write_text(f"document {i}: " + "hello world " * 50)
    (root / "image.bin").write_bytes(bytes(range(256)) * 10)  # binary: ignored
    return root


def test_preprocess_writes_a_deterministic_split_and_reuses_its_cache(corpus, tmp_path):
    out = prepare_corpus(str(corpus), str(tmp_path / "cache"), "byte", 10.0, 0)
    meta = json.loads((out / "meta.json").read_text())
    assert meta["documents"]["train"] + meta["documents"]["valid"] == 40
    assert meta["documents"]["valid"] >= 1
    train = np.fromfile(out / "train.bin", dtype=np.uint16)
    assert train.size == meta["train_tokens"]
    assert (train == 256).sum() == meta["documents"]["train"]  # one end-of-document token per document
    assert b"hello world" in bytes(t for t in train[:200] if t < 256)
    mtime = (out / "train.bin").stat().st_mtime_ns
    again = prepare_corpus(str(corpus), str(tmp_path / "cache"), "byte", 10.0, 0)
    assert again == out and (out / "train.bin").stat().st_mtime_ns == mtime


def test_token_blocks_serve_shifted_input_and_target(corpus, tmp_path):
    out = prepare_corpus(str(corpus), str(tmp_path / "cache"), "byte", 10.0, 0)
    blocks = TokenBlocks(out / "train.bin", seq_len=16)
    tokens = np.fromfile(out / "train.bin", dtype=np.uint16)
    assert len(blocks) == (tokens.size - 1) // 16
    assert blocks[3].tolist() == tokens[48:65].tolist()


def test_missing_data_path_names_the_path(tmp_path):
    with pytest.raises(DataError, match=rf"data.path: {tmp_path / 'nope'} does not exist"):
        find_sources(tmp_path / "nope")


def test_directory_without_text_names_the_path(tmp_path):
    (tmp_path / "blob.bin").write_bytes(b"\0\1\2" * 100)
    with pytest.raises(DataError, match="holds no text files"):
        find_sources(tmp_path)


def test_too_short_corpus_for_the_sequence_length_says_so(tmp_path):
    (tmp_path / "a.txt").write_text("hi")
    out = prepare_corpus(str(tmp_path / "a.txt"), str(tmp_path / "cache"), "byte", 0.0, 0)
    with pytest.raises(DataError, match="fewer than data.seq_len"):
        TokenBlocks(out / "train.bin", seq_len=64)  # "hi" and the end of document: 3 tokens
