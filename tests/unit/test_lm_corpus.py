"""Corpus inputs and their binarization: text, JSONL, gzip, streamed blocks, workers, atomic caches, bad input."""

from __future__ import annotations

import gzip
import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from shardlab.errors import ConfigError, DataError
from tasks.lm.cache import prepare_corpus
from tasks.lm.corpus import find_sources, read_blocks
from tasks.lm.data import open_splits
from tasks.lm.tokenizer import ByteTokenizer, load_tokenizer, train_bpe
from tests.unit.test_cli import ROOT, run_cli


def tokens(corpus_dir, split="train"):
    meta = json.loads((corpus_dir / "meta.json").read_text())
    return np.fromfile(corpus_dir / f"{split}.bin", dtype=meta["dtype"])


def all_tokens(corpus_dir):
    return np.concatenate([tokens(corpus_dir, "train"), tokens(corpus_dir, "valid")])


def test_blocks_of_a_file_end_at_line_ends_and_join_back_to_the_file(tmp_path):
    text = "".join(f"line {i}: déjà vu ✓\n" for i in range(200))
    (tmp_path / "a.txt").write_text(text)
    (source,) = find_sources(tmp_path / "a.txt")
    blocks = list(read_blocks(source, block_bytes=100))
    assert len(blocks) > 10
    assert b"".join(b.data for b in blocks) == text.encode()
    assert all(b.data.endswith(b"\n") for b in blocks)
    assert [b.last for b in blocks] == [False] * (len(blocks) - 1) + [True]
    assert blocks[3].first_line == 1 + sum(b.data.count(b"\n") for b in blocks[:3])


def test_a_file_without_line_ends_is_cut_between_characters(tmp_path):
    text = "漢字✓é" * 500  # multi-byte characters only, no newline
    (tmp_path / "a.txt").write_text(text)
    (source,) = find_sources(tmp_path / "a.txt")
    blocks = list(read_blocks(source, block_bytes=101))
    assert all(b.data.decode("utf-8") for b in blocks)  # each block decodes alone: no character is split
    assert b"".join(b.data for b in blocks).decode() == text


def test_text_jsonl_and_their_gzip_give_the_same_documents(tmp_path):
    docs = [f"document {i}: " + "hello world " * (i + 1) for i in range(30)]
    plain, zipped = tmp_path / "plain", tmp_path / "zipped"
    plain.mkdir()
    zipped.mkdir()
    (plain / "docs.jsonl").write_text("".join(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(docs)))
    with gzip.open(zipped / "docs.jsonl.gz", "wt") as f:
        f.write((plain / "docs.jsonl").read_text())
    a = prepare_corpus(str(plain), str(tmp_path / "cache"), "byte", 10.0, 0)
    b = prepare_corpus(str(zipped), str(tmp_path / "cache"), "byte", 10.0, 0)
    assert a != b and np.array_equal(tokens(a), tokens(b)) and np.array_equal(tokens(a, "valid"), tokens(b, "valid"))
    meta = json.loads((a / "meta.json").read_text())
    assert meta["documents"]["train"] + meta["documents"]["valid"] == 30
    assert sorted(bytes(all_tokens(a)[all_tokens(a) != 256].astype(np.uint8)).decode()) == sorted("".join(docs))


def test_worker_processes_write_exactly_what_one_process_writes(tmp_path):
    root = tmp_path / "corpus"
    root.mkdir()
    for i in range(6):
        (root / f"f{i}.txt").write_text("".join(f"{i} line {j} of some text\n" for j in range(20_000)))
    one = prepare_corpus(str(root), str(tmp_path / "one"), "byte", 20.0, 0, num_workers=0)
    two = prepare_corpus(str(root), str(tmp_path / "two"), "byte", 20.0, 0, num_workers=2)
    for split in ("train", "valid"):
        assert np.array_equal(tokens(one, split), tokens(two, split))
    assert tokens(one, "valid").size and tokens(one, "train").size  # several blocks per file, split between both


def after_a_failed_build(cache: Path) -> tuple[list[str], list[str]]:
    """What a failed preprocessing left in ``cache``: the names of everything but its failure note, and the note's
    errors (tasks/lm/cache_lock.py: the processes that waited for that build stop with its error)."""
    notes = sorted(cache.glob("*.failed"))
    errors = [json.loads(note.read_text())["error"] for note in notes]
    return sorted(p.name for p in cache.iterdir() if p not in notes), errors


@pytest.mark.parametrize(
    "line, pattern",
    [
        ("{not json", r"docs.jsonl:3: not a JSON object .*fix or delete the line"),
        ('{"body": "x"}', r"docs.jsonl:3: no 'text' field \(found: body\); name the text field with data.jsonl_field"),
    ],
)
def test_bad_jsonl_line_names_file_and_line_and_leaves_no_cache(tmp_path, line, pattern):
    root = tmp_path / "corpus"
    root.mkdir()
    (root / "docs.jsonl").write_text(f'{{"text": "a"}}\n{{"text": "b"}}\n{line}\n{{"text": "c"}}\n')
    cache = tmp_path / "cache"
    kept = cache / "other-0123"  # a finished cache of another corpus must survive the failure untouched
    kept.mkdir(parents=True)
    (kept / "meta.json").write_text("{}")
    with pytest.raises(DataError, match=pattern):
        prepare_corpus(str(root), str(cache), "byte", 10.0, 0)
    assert (kept / "meta.json").read_text() == "{}"
    names, errors = after_a_failed_build(cache)
    assert names == ["other-0123"] and len(errors) == 1 and re.search(pattern, errors[0])


def test_corpus_too_small_for_a_block_says_which_split_and_the_fix(tmp_path):
    (tmp_path / "a.txt").write_text("hi there")
    out = prepare_corpus(str(tmp_path / "a.txt"), str(tmp_path / "cache"), "byte", 50.0, 0)
    with pytest.raises(DataError, match=r"(train|valid).bin has \d+ tokens, fewer than data.seq_len \+ 1 = 65"):
        open_splits(out, seq_len=64)


def test_an_interrupted_binarization_leaves_no_complete_looking_cache(tmp_path, monkeypatch):
    from tasks.lm import binarize

    (tmp_path / "a.txt").write_text("some text\n" * 1000)
    monkeypatch.setattr(binarize, "_move_tail", lambda *a: (_ for _ in ()).throw(KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):
        prepare_corpus(str(tmp_path / "a.txt"), str(tmp_path / "cache"), "byte", 0.0, 0)
    assert list((tmp_path / "cache").iterdir()) == []
    monkeypatch.undo()
    out = prepare_corpus(str(tmp_path / "a.txt"), str(tmp_path / "cache"), "byte", 0.0, 0)
    assert (out / "meta.json").is_file() and [p.name for p in (tmp_path / "cache").iterdir()] == [out.name]


def test_a_tokenizer_file_that_does_not_parse_is_a_one_line_error_naming_it(tmp_path):
    bad = tmp_path / "tokenizer.json"
    bad.write_text('{"model": "nope"}')
    with pytest.raises(DataError, match=rf"data.tokenizer: {bad} is not a tokenizer.json"):
        load_tokenizer(str(bad))
    code, out, err = run_cli(f"data.tokenizer={bad}", f"data.cache_dir={tmp_path / 'cache'}")
    assert code == 2 and err.strip().startswith("error: data.tokenizer:") and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "cache").exists()  # refused before any data work


def test_a_tokenizer_larger_than_a_pinned_vocab_size_is_refused_before_training(tmp_path, tiny_lm):
    from shardlab.runner import build_task

    tok = train_bpe(["some text to learn from " * 50], 300, tmp_path / "tokenizer.json")
    cfg = tiny_lm(f"data.tokenizer={tok}", "model.vocab_size=256")
    with pytest.raises(ConfigError, match=r"model.vocab_size \(256\) is smaller than the vocabulary of data.tokenizer"):
        build_task(cfg, world_size=1)


def test_tokenizer_without_end_of_document_token_asks_for_one(tmp_path):
    from tokenizers import Tokenizer, models

    path = tmp_path / "tokenizer.json"
    Tokenizer(models.WordLevel({"a": 0, "<unk>": 1}, unk_token="<unk>")).save(str(path))
    with pytest.raises(ConfigError, match=r"has none of the end-of-document tokens .* data.eod_token=<token>"):
        load_tokenizer(str(path))
    assert load_tokenizer(str(path), eod_token="<unk>").eod == 1


def test_byte_level_training_imports_neither_tokenizers_nor_transformers(tiny_lm):
    script = (
        "import sys; from tests.conftest import compose_config, TINY_LM; from shardlab.runner import build_task; "
        f"task = build_task(compose_config([*TINY_LM, 'data.cache_dir={tiny_lm().data.cache_dir}']), world_size=1); "
        "task.prepare_data(); print(sorted(m for m in ('tokenizers', 'transformers') if m in sys.modules))"
    )
    result = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "[]"


def test_preprocessing_modules_do_not_import_torch():
    """tools/preprocess_lm.py and its worker processes read and tokenize text only: torch would cost each worker
    ~1 GiB of resident memory and seconds of start-up for nothing."""
    script = (
        "import sys; import tasks.lm.cache, tasks.lm.binarize, tasks.lm.corpus, tasks.lm.tokenizer; "
        "print('torch' in sys.modules)"
    )
    result = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"


def test_byte_tokenizer_array_encoding_matches_its_list_encoding():
    tok = ByteTokenizer()
    text = "déjà vu — 漢字 ✓"
    assert tok.encode_array([text[:5], text[5:]]).tolist() == tok.encode(text)


def wide_tokenizer(path):
    """A word-level tokenizer of 70,000 ids whose real words all sit above 65,535: only uint32 can hold them."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = "the quick brown fox jumps over a lazy dog and runs far away".split()
    vocab = {"<unk>": 0, "<|endoftext|>": 1, **{f"filler{i}": i for i in range(2, 65_536)}}
    vocab.update({w: 65_536 + i for i, w in enumerate(words)})
    vocab.update({f"top{i}": i for i in range(65_536 + len(words), 70_000)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path))
    return words


def test_a_vocabulary_above_65535_is_stored_as_uint32_and_trains(tmp_path, tiny_lm):
    from shardlab.distributed import env as dist_env
    from shardlab.runner import run_rank

    words = wide_tokenizer(tmp_path / "tokenizer.json")
    rng = np.random.default_rng(0)
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for d in range(20):
        (corpus / f"d{d}.txt").write_text(" ".join(rng.choice(words, 300)) + "\n")
    cfg = tiny_lm(
        f"data.path={corpus}",
        f"data.tokenizer={tmp_path / 'tokenizer.json'}",
        "data.valid_percent=20",
        "model.dim=32",
        "optimization.max_steps=4",
        "validation.interval_steps=4",
    )
    result = run_rank(cfg, tmp_path / "run", dist_env.detect(), after_fit=lambda t: {"task": t.task})
    task = result["task"]
    assert task.meta["dtype"] == "uint32" and task.vocab_size == 70_016  # 70,000 padded to a multiple of 64
    ids = set(task.train_dataset[0].tolist())
    assert ids <= set(range(65_536, 65_536 + len(words))) | {1} and max(ids) > 65_535  # read back whole, not wrapped
    assert np.isfinite(result["final"]["loss"])


def token_cache(path, meta: dict) -> np.ndarray:
    """A preprocessed corpus made by hand at ``path``: 300 byte tokens in each split, and ``meta`` as meta.json."""
    path.mkdir(exist_ok=True)
    ids = np.arange(300, dtype=np.uint16) % 257
    for split in ("train", "valid"):
        ids.tofile(path / f"{split}.bin")
    (path / "meta.json").write_text(json.dumps(meta))
    return ids


BYTE_META = {"tokenizer": "byte", "vocab_size": 257, "dtype": "uint16", "documents": {}}


def test_a_cache_of_the_first_format_still_reads_and_a_newer_one_is_refused(tmp_path):
    old = tmp_path / "old"
    meta = {"format": 1, **BYTE_META}
    ids = token_cache(old, meta)
    train, _ = open_splits(old, seq_len=16)
    assert train[1].tolist() == ids[16:33].tolist()
    (old / "meta.json").write_text(json.dumps({**meta, "format": 99}))
    with pytest.raises(DataError, match=r"written by a newer shardlab \(format 99 > 2\); upgrade shardlab or delete"):
        open_splits(old, seq_len=16)


@pytest.mark.parametrize(
    "edit, refusal",
    [
        ({"dtype": "O"}, r"gives the token dtype 'O', which preprocessing never writes \(uint16 or uint32\); delete"),
        ({"train_tokens": 600}, r"train\.bin holds 600 bytes, not the 600 uint16 tokens its meta\.json records"),
    ],
    ids=["object-dtype", "counts-off"],
)
def test_a_cache_whose_meta_does_not_match_what_preprocessing_writes_is_refused(tmp_path, edit, refusal):
    """A shared cache someone edited: numpy would map an object dtype's bytes as pointers (a crash, or worse)."""
    cache = tmp_path / "cache"
    meta = {"format": 2, **BYTE_META, "train_tokens": 300, "valid_tokens": 300}
    token_cache(cache, meta)
    open_splits(cache, seq_len=16)  # as preprocessing writes it: reads
    (cache / "meta.json").write_text(json.dumps({**meta, **edit}))
    with pytest.raises(DataError, match=refusal):
        open_splits(cache, seq_len=16)


def test_trained_tokenizer_lands_beside_its_data_and_training_with_it_reuses_the_cache(tmp_path, capsys):
    from tools import preprocess_lm

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(12):
        (corpus / f"d{i}.txt").write_text(f"def function_{i}(x):\n    return x * {i} + len('hello world')\n" * 40)
    out = preprocess_lm.main(
        [str(corpus), "--train-tokenizer", "bpe", "--vocab-size", "300", "--cache-dir", str(tmp_path / "c")]
    )
    meta = json.loads((out / "meta.json").read_text())
    assert meta["tokenizer"] == str(out / "tokenizer.json") and meta["vocab_size"] == 300
    assert f"data.tokenizer={out / 'tokenizer.json'}" in capsys.readouterr().out
    tok = load_tokenizer(str(out / "tokenizer.json"))
    text = (corpus / "d3.txt").read_text()
    assert len(tok.encode(text)) < len(text) / 2  # it learned merges from this corpus
    assert tok.decode(tok.encode(text)) == text
    assert prepare_corpus(str(corpus), str(tmp_path / "c"), str(out / "tokenizer.json"), 5.0, 0) == out


def sentencepiece_like_tokenizer(path):
    """Llama-2 style: a '▁' prepended to every encoded text, byte fallback, </s> as end of document."""
    from tokenizers import Tokenizer, decoders, models, normalizers

    vocab = {"<unk>": 0, "</s>": 1, **{f"<0x{i:02X}>": i + 2 for i in range(256)}, "▁": 258, "a": 259, "▁a": 260}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[("▁", "a")], byte_fallback=True, unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tok.save(str(path))


def test_a_tokenizer_that_marks_each_text_start_encodes_each_document_whole(tmp_path):
    sentencepiece_like_tokenizer(tmp_path / "sp.json")
    tok = load_tokenizer(str(tmp_path / "sp.json"))
    assert not tok.splits_cleanly and tok.eod == 1
    doc = "a a\n" * 40_000  # 160 KB: more than one 64 KB piece, which would each gain a '▁'
    (tmp_path / "docs.jsonl").write_text(json.dumps({"text": doc}) + "\n")
    out = prepare_corpus(str(tmp_path / "docs.jsonl"), str(tmp_path / "cache"), tok, 0.0, 0)
    assert all_tokens(out).tolist() == tok.encode(doc) + [1]


def test_a_bad_jsonl_line_found_by_a_worker_process_is_the_same_one_line_error(tmp_path):
    root = tmp_path / "corpus"
    root.mkdir()
    (root / "docs.jsonl").write_text('{"text": "a"}\n' * 5000 + '{"title": "x"}\n')
    with pytest.raises(DataError, match=r"docs.jsonl:5001: no 'text' field \(found: title\)"):
        prepare_corpus(str(root), str(tmp_path / "cache"), "byte", 10.0, 0, num_workers=2)
    names, errors = after_a_failed_build(tmp_path / "cache")
    assert names == [] and len(errors) == 1 and "docs.jsonl:5001: no 'text' field" in errors[0]
