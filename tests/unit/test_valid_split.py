"""The validation split of a small corpus (whole documents, never a whole block or file) and the tokens binarize
writes, compared with a plain one-piece-at-a-time reference encoding (issue 42, items 4 and 6)."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import numpy as np
import pytest

from shardlab_tasks.lm.corpus.binarize import (
    TAIL_MIN_TOKENS,
    held_out_count,
    is_valid_document,
    split_rank,
    tail_count,
    too_few_units,
)
from shardlab_tasks.lm.corpus.cache import prepare_corpus
from shardlab_tasks.lm.corpus.corpus import find_sources, jsonl_text, read_blocks
from shardlab_tasks.lm.corpus.data import open_splits
from shardlab_tasks.lm.corpus.tokenizer import load_tokenizer, segments, train_bpe
from tests.unit.test_lm_corpus import tokens, write_parquet_shards, zstd_frames


def c_jsonl_records(n: int = 20) -> list[str]:
    """The issue's corpus: 20 records of ~18 KB (0.36 MB), none of whose keys ``c.jsonl:<line>`` hashes into valid
    at data.valid_percent=10."""
    return [f"record {i} " + f"word{i} ünïcödé text line\n" * 560 for i in range(n)]


def split_docs(ids: np.ndarray) -> list[str]:
    """The documents of byte tokens, in order (each ends with the end-of-document token 256)."""
    cuts = np.flatnonzero(ids == 256)
    starts = np.concatenate([[0], cuts[:-1] + 1])
    return [bytes(ids[a:b].astype(np.uint8)).decode() for a, b in zip(starts, cuts, strict=True)]


def test_the_issue_corpus_hashes_no_record_into_valid():
    assert not any(is_valid_document(f"c.jsonl:{n}", 10.0) for n in range(1, 21))  # else the tests below test nothing


@pytest.mark.parametrize(
    "units, percent, held", [(20, 10.0, 2), (30, 10.0, 3), (21, 10.0, 3), (100, 0.0, 1), (2, 90.0, 1), (1, 10.0, 1)]
)
def test_the_hold_out_takes_the_fewest_documents_that_make_valid_percent_and_leaves_train_some(units, percent, held):
    assert held_out_count(units, percent) == held


def test_a_small_corpus_holds_out_whole_documents_nearest_to_valid_by_hash_and_says_so(tmp_path, capsys):
    docs = c_jsonl_records()
    (tmp_path / "c.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    corpus = prepare_corpus(str(tmp_path / "c.jsonl"), str(tmp_path / "cache"), "byte", 10.0, 0, num_workers=0)
    meta = json.loads((corpus / "meta.json").read_text())
    nearest = sorted(range(20), key=lambda i: split_rank(f"c.jsonl:{i + 1}"))[:2]
    assert split_docs(tokens(corpus, "valid")) == [docs[i] for i in sorted(nearest)]
    assert split_docs(tokens(corpus, "train")) == [d for i, d in enumerate(docs) if i not in nearest]
    assert meta["documents"] == {"train": 18, "valid": 2}
    assert meta["train_tokens"] + meta["valid_tokens"] == sum(len(d.encode()) + 1 for d in docs)
    assert "the 2 of 20 documents nearest to it by hash" in capsys.readouterr().out


def test_a_corpus_whose_hash_gives_valid_documents_keeps_exactly_those(tmp_path):
    docs = [f"doc {i} é\n" * (i % 5 + 1) for i in range(200)]
    (tmp_path / "big.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    corpus = prepare_corpus(str(tmp_path / "big.jsonl"), str(tmp_path / "cache"), "byte", 10.0, 0, num_workers=0)
    hashed = [is_valid_document(f"big.jsonl:{i + 1}", 10.0) for i in range(200)]
    assert 0 < sum(hashed) < 200
    assert split_docs(tokens(corpus, "valid")) == [d for d, v in zip(docs, hashed, strict=True) if v]


def test_a_corpus_of_text_files_holds_out_whole_files_not_the_last_one(tmp_path):
    root = tmp_path / "texts"
    root.mkdir()
    names = [f"f{i:02d}.txt" for i in range(12)]
    names = [n for n in names if not is_valid_document(n, 10.0)][:10]
    for n in names:
        (root / n).write_text(f"{n} text\n" * 50)
    corpus = prepare_corpus(str(root), str(tmp_path / "cache"), "byte", 10.0, 0, num_workers=0)
    nearest = min(names, key=split_rank)
    assert split_docs(tokens(corpus, "valid")) == [(root / nearest).read_text()]


def train_lm(tiny_lm, path: Path, run_dir: Path) -> dict:
    from shardlab.distributed import env as dist_env
    from shardlab.runner import run_rank

    cfg = tiny_lm(
        f"data.path={path}",
        "data.valid_percent=10",
        "model.dim=32",
        "optimization.max_steps=2",
        "validation.interval_steps=2",
    )
    return run_rank(cfg, run_dir, dist_env.detect(), after_fit=lambda t: {"task": t.task})


def test_the_issue_corpus_trains_as_jsonl_jsonl_zst_and_parquet_with_a_tenth_of_its_documents_held_out(
    tmp_path, tiny_lm
):
    """Must-show 4: the 20-record c.jsonl, its .jsonl.zst and its Parquet twin each train, the same 2 of 20
    documents held out (it used to be 0 train / 363,660 valid tokens, then a refusal)."""
    docs = c_jsonl_records()
    for name in ("jsonl", "zst", "parquet"):
        (tmp_path / name).mkdir()
    plain = tmp_path / "jsonl" / "c.jsonl"
    plain.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    (tmp_path / "zst" / "c.jsonl.zst").write_bytes(zstd_frames(plain.read_bytes()))
    write_parquet_shards(tmp_path / "parquet" / "p", [docs])
    (tmp_path / "parquet" / "p" / "part-0.parquet").rename(tmp_path / "parquet" / "c.parquet")
    runs = [
        train_lm(tiny_lm, path, tmp_path / f"run{k}")
        for k, path in enumerate([plain, tmp_path / "zst" / "c.jsonl.zst", tmp_path / "parquet" / "c.parquet"])
    ]
    corpora = [r["task"].corpus_dir for r in runs]
    for corpus, run in zip(corpora, runs, strict=True):
        meta = json.loads((corpus / "meta.json").read_text())
        assert meta["documents"] == {"train": 18, "valid": 2}
        assert np.isfinite(run["final"]["loss"])
    for split in ("train", "valid"):
        assert all(np.array_equal(tokens(corpora[0], split), tokens(c, split)) for c in corpora[1:])


# ---- the tokens themselves ---------------------------------------------------------------------------------------
def reference_tokens(path: Path, tokenizer, valid_percent: float) -> dict[str, list[int]]:
    """What binarize must write, encoded the plain way: each ~64 KB piece of each document by ``encode`` alone,
    split by its key, its end-of-document token after its last piece."""
    out: dict[str, list[int]] = {"train": [], "valid": []}
    for src in find_sources(path):
        for b in read_blocks(src, text_field="text"):
            if src.records:
                lines = [(n, line) for n, line in enumerate(b.data.splitlines(), start=b.first_line) if line.strip()]
                units = [(f"{src.split_key}:{n}", jsonl_text(line, src.path, n, "text"), True) for n, line in lines]
            else:
                key = src.split_key if b.index == 0 else f"{src.split_key}#{b.index}"
                units = [(key, b.data.decode("utf-8", errors="replace"), b.last)]
            for key, text, ends in units:
                split = out["valid" if is_valid_document(key, valid_percent) else "train"]
                for piece in segments(text):
                    split += tokenizer.encode(piece)
                split += [tokenizer.eod] if ends else []
    return out


@pytest.fixture(scope="module")
def mixed_corpus(tmp_path_factory) -> Path:
    """Multi-byte text everywhere, a 2.5 MB text file read in three blocks (a document across block boundaries,
    some pieces cut inside a line longer than a piece) and JSONL records, one of them empty."""
    root = tmp_path_factory.mktemp("mixed")
    line = "naïve café ✓ 漢字 emoji 🙂 " * 3
    (root / "long.txt").write_text("".join(f"{i} {line}\n" for i in range(30_000)) + "x" * 70_000)
    records = [f"doc {i}: größe 😀 " * (i % 40 + 1) + "\n\n  indented" for i in range(300)] + [""]
    (root / "docs.jsonl").write_text("".join(json.dumps({"text": r}) + "\n" for r in records))
    return root


@pytest.fixture(scope="module")
def plain_encoding(mixed_corpus, tmp_path_factory):
    """``plain_encoding(kind)``: (the tokenizer's spec, the plain encoding's tokens per split), made once per kind: the
    BPE trained and the corpus encoded token by token take ~15 s, and each worker setting must give the same tokens."""

    @functools.cache
    def make(kind: str) -> tuple[str, dict]:
        spec = "byte"
        if kind == "bpe":
            texts = [p.read_text() for p in mixed_corpus.iterdir()]
            spec = str(train_bpe(texts, 600, tmp_path_factory.mktemp("tok") / "t.json"))
        return spec, reference_tokens(mixed_corpus, load_tokenizer(spec), 10.0)

    return make


@pytest.mark.parametrize("workers", [0, 2, "2 processes"])
@pytest.mark.parametrize("kind", ["byte", "bpe"])
def test_binarize_writes_the_tokens_of_the_plain_encoding(
    tmp_path, mixed_corpus, plain_encoding, kind, workers, monkeypatch
):
    if workers == "2 processes":  # the library's threads off: worker processes tokenize a tokenizer file's blocks
        monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
        workers = 2
    spec, expected = plain_encoding(kind)
    corpus = prepare_corpus(str(mixed_corpus), str(tmp_path / "cache"), spec, 10.0, 0, num_workers=workers)
    for split in ("train", "valid"):
        assert len(expected[split]) > 1000
        assert tokens(corpus, split).tolist() == expected[split]


# ---- a corpus of too few documents: the tail of its tokens (issue 47, item 7) ---------------------------------------
def text_file(path: Path, size: int, seed: int = 0) -> Path:
    """A text file of ``size`` bytes of words (ASCII: a byte token each), one document as docs/corpora.md has it."""
    rng = np.random.default_rng(seed)
    words = np.array("the quick brown fox jumps over a lazy dog and runs far away".split())
    text = " ".join(words[rng.integers(0, len(words), size // 3)])[:size]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_the_tail_rule_applies_below_50_over_valid_percent_units_and_keeps_train_the_larger_part():
    assert too_few_units(1, 5.0) and too_few_units(1, 90.0) and too_few_units(9, 5.0) and too_few_units(4, 10.0)
    assert not too_few_units(10, 5.0) and not too_few_units(5, 10.0) and not too_few_units(20, 10.0)
    assert not too_few_units(1, 0.0)  # nothing is held out at 0
    assert tail_count(1_112_008, 5.0) == 55_601  # 5%, rounded up
    assert tail_count(46_484, 5.0) == TAIL_MIN_TOKENS == 4_097  # 5% is 2,325: raised to one default valid batch
    assert tail_count(6_000, 5.0) == 3_000  # the floor never takes train below half
    assert tail_count(1, 50.0) == 0 and tail_count(2, 99.0) == 1


def test_one_48_kb_text_file_keeps_its_head_for_training_and_its_tail_for_validation(tmp_path, capsys):
    """It used to hold the whole file out ('the 1 of 1 documents nearest to it by hash'), then refuse: train.bin
    had 0 tokens. Now: the file's tokens in order, cut at 4,097 tokens from the end (5% would be 2,325, fewer than
    one validation batch of the default config: 32 blocks of 128 tokens)."""
    path = text_file(tmp_path / "input.txt", 48_000)
    corpus = prepare_corpus(str(path), str(tmp_path / "cache"), "byte", 5.0, 0, num_workers=0)
    stream = np.frombuffer(path.read_bytes(), np.uint8).astype(np.int64).tolist() + [256]
    assert tokens(corpus, "train").tolist() == stream[:-4_097]
    assert tokens(corpus, "valid").tolist() == stream[-4_097:]
    meta = json.loads((corpus / "meta.json").read_text())
    assert (meta["train_tokens"], meta["valid_tokens"], meta["documents"]) == (43_904, 4_097, {"train": 1, "valid": 0})
    line = capsys.readouterr().out
    assert "too few documents to hold whole ones out (1 document), so its last 4,097 tokens (8.5%" in line
    assert (len(tokens(corpus, "valid")) - 1) // 128 >= 32  # the default config's validation batch


def test_a_1_1_mb_text_file_holds_out_its_last_5_percent_not_half(tmp_path):
    """Two blocks of ~1 MB: one of them (half the file) used to be held out."""
    path = text_file(tmp_path / "input.txt", 1_100_000)
    corpus = prepare_corpus(str(path), str(tmp_path / "cache"), "byte", 5.0, 0, num_workers=0)
    stream = np.concatenate([np.frombuffer(path.read_bytes(), np.uint8).astype(np.int64), [256]])
    train, valid = tokens(corpus, "train"), tokens(corpus, "valid")
    assert len(valid) == tail_count(1_100_001, 5.0) == 55_001
    np.testing.assert_array_equal(np.concatenate([train, valid]), stream)


def test_a_folder_of_few_files_is_put_back_in_order_and_cut_at_its_tail(tmp_path):
    """Three files: whichever of them the hash sends to valid, the stream is the files in order, cut at the tail."""
    root = tmp_path / "texts"
    files = [text_file(root / f"part-{k}.txt", 20_000, seed=k) for k in range(3)]
    corpus = prepare_corpus(str(root), str(tmp_path / "cache"), "byte", 10.0, 0, num_workers=0)
    stream = np.concatenate([np.append(np.frombuffer(f.read_bytes(), np.uint8).astype(np.int64), 256) for f in files])
    train, valid = tokens(corpus, "train"), tokens(corpus, "valid")
    assert len(valid) == tail_count(len(stream), 10.0) == 6_001
    np.testing.assert_array_equal(np.concatenate([train, valid]), stream)
    assert json.loads((corpus / "meta.json").read_text())["documents"] == {"train": 3, "valid": 0}


def test_valid_percent_0_holds_nothing_out_and_says_what_to_set(tmp_path):
    path = text_file(tmp_path / "input.txt", 48_000)
    corpus = prepare_corpus(str(path), str(tmp_path / "cache"), "byte", 0.0, 0, num_workers=0)
    assert len(tokens(corpus, "train")) == 48_001 and len(tokens(corpus, "valid")) == 0
    train, valid = open_splits(corpus, 32)  # an empty split: validation off trains on it all (Task.data_errors)
    assert (len(train), len(valid)) == (48_000 // 32, 0)


def test_a_cache_of_the_earlier_rule_is_not_found_by_the_new_key(tmp_path, monkeypatch):
    """The split of such a corpus changed: so does its cache's name (the format is in the key), and an old cache
    (all of a one-file corpus held out) is never read as the new one."""
    from shardlab_tasks.lm.corpus import cache

    path = text_file(tmp_path / "input.txt", 48_000)
    tok = load_tokenizer("byte")
    sources, _ = cache.corpus_sources(str(path))
    new = cache.cache_key(sources, tok, 5.0, 0, "text")
    monkeypatch.setattr(cache, "FORMAT_VERSION", 3)
    assert cache.cache_key(sources, tok, 5.0, 0, "text") != new


@pytest.mark.parametrize("corpus", ["48 KB file", "1.1 MB file", "folder of 3 files"])
def test_one_text_file_or_a_few_train_and_validate(tmp_path, tiny_lm, corpus):
    """Must-show 2: `python -m shardlab.train data.path=<one text file>` (here through run_rank, a tiny model), and so
    do a 1.1 MB file and a folder of files."""
    if corpus == "folder of 3 files":
        path = tmp_path / "texts"
        for k in range(3):
            text_file(path / f"part-{k}.txt", 20_000, seed=k)
    else:
        path = text_file(tmp_path / "input.txt", 48_000 if corpus == "48 KB file" else 1_100_000)
    run = train_lm(tiny_lm, path, tmp_path / "run")
    assert np.isfinite(run["final"]["loss"])
    assert run["task"].meta["valid_tokens"] > 0 and run["task"].meta["train_tokens"] > 0
