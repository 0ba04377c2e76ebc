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
from shardlab_tasks.lm.corpus.binarize import FORMAT_VERSION
from shardlab_tasks.lm.corpus.cache import prepare_corpus
from shardlab_tasks.lm.corpus.corpus import find_sources, read_blocks
from shardlab_tasks.lm.corpus.data import open_splits
from shardlab_tasks.lm.corpus.tokenizer import ByteTokenizer, load_tokenizer, train_bpe
from tests.unit.test_cli import ROOT


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
    errors (shardlab_tasks/lm/corpus/cache_lock.py: the processes that waited for that build stop with its error)."""
    notes = sorted(cache.glob("*.failed"))
    errors = [json.loads(note.read_text())["error"] for note in notes]
    return sorted(p.name for p in cache.iterdir() if p not in notes), errors


@pytest.mark.parametrize(
    "line, pattern",
    [
        ("{not json", r"docs.jsonl:3: not a JSON object .*fix or delete the line"),
        ('{"body": "x"}', r"docs.jsonl:3: no 'text' field \(found: body\); name the text field with data.text_field"),
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
    from shardlab_tasks.lm.corpus import binarize

    (tmp_path / "a.txt").write_text("some text\n" * 1000)
    monkeypatch.setattr(binarize, "_hold_out_tail", lambda *a: (_ for _ in ()).throw(KeyboardInterrupt()))
    # one file, too few documents for whole ones: the tail hold-out (the last step before the cache is published) runs
    with pytest.raises(KeyboardInterrupt):
        prepare_corpus(str(tmp_path / "a.txt"), str(tmp_path / "cache"), "byte", 1.0, 0)
    assert list((tmp_path / "cache").iterdir()) == []
    monkeypatch.undo()
    out = prepare_corpus(str(tmp_path / "a.txt"), str(tmp_path / "cache"), "byte", 1.0, 0)
    assert (out / "meta.json").is_file() and [p.name for p in (tmp_path / "cache").iterdir()] == [out.name]


def test_a_tokenizer_file_that_does_not_parse_is_a_one_line_error_naming_it(tmp_path, cli_forks):
    bad = tmp_path / "tokenizer.json"
    bad.write_text('{"model": "nope"}')
    with pytest.raises(DataError, match=rf"data.tokenizer: {bad} is not a tokenizer.json"):
        load_tokenizer(str(bad))
    done = cli_forks.run(f"data.tokenizer={bad}", f"data.cache_dir={tmp_path / 'cache'}")
    code, err = done.returncode, done.stderr
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
    """Nor the corpora extra's packages: pyarrow and zstandard load only for Parquet, Arrow and .zst files."""
    optional = ("tokenizers", "transformers", "pyarrow", "zstandard")
    script = (
        "import sys; from tests.conftest import compose_config, TINY_LM; from shardlab.runner import build_task; "
        f"task = build_task(compose_config([*TINY_LM, 'data.cache_dir={tiny_lm().data.cache_dir}']), world_size=1); "
        f"task.prepare_data(); print(sorted(m for m in {optional} if m in sys.modules))"
    )
    result = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "[]"


def test_preprocessing_modules_do_not_import_torch():
    """shardlab-preprocess and its worker processes read and tokenize text only: torch would cost each worker
    ~1 GiB of resident memory and seconds of start-up for nothing."""
    script = (
        "import sys; import shardlab_tasks.lm.corpus.cache, shardlab_tasks.lm.corpus.binarize, "
        "shardlab_tasks.lm.corpus.corpus, "
        "shardlab_tasks.lm.corpus.tokenizer; "
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
    newer = rf"written by a newer shardlab \(format 99 > {FORMAT_VERSION}\); upgrade shardlab or delete"
    with pytest.raises(DataError, match=newer):
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
    from shardlab_commands import preprocess_lm

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


def test_a_bad_jsonl_line_found_by_a_worker_process_is_the_same_one_line_error(tmp_path, monkeypatch):
    root = tmp_path / "corpus"
    root.mkdir()
    (root / "docs.jsonl").write_text('{"text": "a"}\n' * 5000 + '{"title": "x"}\n')
    tok = train_bpe(["a b c"] * 10, 300, tmp_path / "tok" / "tokenizer.json")
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")  # the library's threads off: worker processes tokenize
    with pytest.raises(DataError, match=r"docs.jsonl:5001: no 'text' field \(found: title\)"):
        prepare_corpus(str(root), str(tmp_path / "cache"), str(tok), 10.0, 0, num_workers=2)
    names, errors = after_a_failed_build(tmp_path / "cache")
    assert names == [] and len(errors) == 1 and "docs.jsonl:5001: no 'text' field" in errors[0]


# ---- corpora as they ship: Parquet shards, Arrow datasets, compressed JSONL ------------------------------------------
def shipped_documents(n: int = 90) -> list[str]:
    """Documents of several lines and non-ASCII text, as real corpora hold."""
    return [
        f"document {i}: héllo wörld ✓ 漢字\n" + "some words of text " * (i % 9 + 1) + f"\nend {i}" for i in range(n)
    ]


def write_jsonl_shards(folder: Path, docs: list[str], num_shards: int) -> list[list[str]]:
    """``docs`` as ``part-<k>.jsonl`` shards (what shardlab read before Parquet); returns each shard's documents."""
    folder.mkdir(parents=True)
    shards = [docs[k::num_shards] for k in range(num_shards)]
    for k, shard in enumerate(shards):
        (folder / f"part-{k}.jsonl").write_text(
            "".join(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(shard))
        )
    return shards


def write_parquet_shards(folder: Path, shards: list[list[str]], **columns) -> None:
    """The same shards as ``part-<k>.parquet``, in row groups of 7 rows (a shard spans several), text not first."""
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    folder.mkdir(parents=True)
    for k, shard in enumerate(shards):
        table = pa.table({"id": list(range(len(shard))), **(columns or {"text": shard})})
        pq.write_table(table, folder / f"part-{k}.parquet", row_group_size=7)


def zstd_frames(data: bytes, num_frames: int = 3) -> bytes:
    """``data`` compressed as several concatenated zstd frames (as pzstd and appended shards write them)."""
    zstandard = pytest.importorskip("zstandard")
    step = -(-len(data) // num_frames)
    return b"".join(zstandard.ZstdCompressor().compress(data[i : i + step]) for i in range(0, len(data), step))


def same_tokens(a: Path, b: Path) -> bool:
    return all(np.array_equal(tokens(a, split), tokens(b, split)) for split in ("train", "valid"))


def train_lm_on(tiny_lm, path: Path, cache: Path, run_dir: Path) -> dict:
    """The default LM (the tiny test flavor) trained for 3 steps on data.path=``path``: the run's result and task."""
    from shardlab.distributed import env as dist_env
    from shardlab.runner import run_rank

    cfg = tiny_lm(
        f"data.path={path}",
        f"data.cache_dir={cache}",
        "data.valid_percent=20",
        "model.dim=32",
        "optimization.max_steps=3",
        "validation.interval_steps=3",
    )
    return run_rank(cfg, run_dir, dist_env.detect(), after_fit=lambda t: {"task": t.task})


def test_parquet_shards_and_a_jsonl_zst_train_on_the_same_tokens_as_plain_jsonl(tmp_path, tiny_lm):
    """The must-show of the corpora item: the default LM trained from a directory of Parquet shards and from a
    .jsonl.zst file caches, token for token, what the same text as plain JSONL gives."""
    docs = shipped_documents()
    shards = write_jsonl_shards(tmp_path / "plain", docs, num_shards=3)
    write_parquet_shards(tmp_path / "parquet", shards)
    (tmp_path / "one").mkdir()
    (tmp_path / "one" / "docs.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    (tmp_path / "zst").mkdir()
    (tmp_path / "zst" / "docs.jsonl.zst").write_bytes(zstd_frames((tmp_path / "one" / "docs.jsonl").read_bytes()))
    cache = tmp_path / "cache"

    from_parquet = train_lm_on(tiny_lm, tmp_path / "parquet", cache, tmp_path / "run_parquet")
    from_zst = train_lm_on(tiny_lm, tmp_path / "zst" / "docs.jsonl.zst", cache, tmp_path / "run_zst")
    plain_shards = prepare_corpus(str(tmp_path / "plain"), str(cache), "byte", 20.0, 1)
    plain_file = prepare_corpus(str(tmp_path / "one" / "docs.jsonl"), str(cache), "byte", 20.0, 1)

    parquet_dir, zst_dir = from_parquet["task"].corpus_dir, from_zst["task"].corpus_dir
    assert same_tokens(parquet_dir, plain_shards) and same_tokens(zst_dir, plain_file)
    for corpus in (parquet_dir, zst_dir):
        assert tokens(corpus, "train").size > 1000 and tokens(corpus, "valid").size > 200  # both splits hold text
        meta = json.loads((corpus / "meta.json").read_text())
        assert meta["documents"]["train"] + meta["documents"]["valid"] == len(docs)
    text = bytes(all_tokens(parquet_dir)[all_tokens(parquet_dir) != 256].astype(np.uint8)).decode()
    assert sorted(text) == sorted("".join(docs))  # every document whole, nothing else (not the id column)
    assert np.isfinite(from_parquet["final"]["loss"]) and np.isfinite(from_zst["final"]["loss"])


def test_a_dataset_saved_by_datasets_reads_its_arrow_files_only(tmp_path):
    datasets = pytest.importorskip("datasets")
    docs = shipped_documents(60)
    saved = tmp_path / "saved"
    datasets.Dataset.from_dict({"n": list(range(60)), "content": docs}).save_to_disk(str(saved), num_shards=2)
    assert sorted(p.name for p in saved.iterdir())[-2:] == ["dataset_info.json", "state.json"]
    plain = tmp_path / "plain"
    plain.mkdir()
    for k, shard in enumerate([docs[:30], docs[30:]]):  # save_to_disk's shards, as JSONL of the same names
        (plain / f"data-0000{k}-of-00002.jsonl").write_text("".join(json.dumps({"content": d}) + "\n" for d in shard))
    cache = str(tmp_path / "cache")
    from_arrow = prepare_corpus(str(saved), cache, "byte", 20.0, 0, text_field="content")
    assert same_tokens(from_arrow, prepare_corpus(str(plain), cache, "byte", 20.0, 0, text_field="content"))
    assert json.loads((from_arrow / "meta.json").read_text())["documents"]["train"] > 30  # not the json files

    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": docs})}).save_to_disk(str(tmp_path / "dict"))
    with pytest.raises(DataError, match=r"holds a DatasetDict saved by datasets \(splits: train\); point data.path at"):
        prepare_corpus(str(tmp_path / "dict"), cache, "byte", 20.0, 0)


def test_a_glob_of_parquet_shards_reuses_the_cache_of_their_folder_and_a_replaced_shard_makes_a_new_one(tmp_path):
    shards = [shipped_documents(40)[k::2] for k in range(2)]
    write_parquet_shards(tmp_path / "shards", shards)
    cache = str(tmp_path / "cache")
    folder = prepare_corpus(str(tmp_path / "shards"), cache, "byte", 20.0, 0)
    assert prepare_corpus(str(tmp_path / "shards" / "part-*.parquet"), cache, "byte", 20.0, 0) == folder
    only_first = prepare_corpus(str(tmp_path / "shards" / "part-0.*"), cache, "byte", 20.0, 0)
    assert only_first != folder and all_tokens(only_first).size < all_tokens(folder).size

    write_parquet_shards(tmp_path / "other", [shards[0], [d.upper() for d in shards[1]]])
    (tmp_path / "other" / "part-1.parquet").replace(tmp_path / "shards" / "part-1.parquet")
    changed = prepare_corpus(str(tmp_path / "shards"), cache, "byte", 20.0, 0)
    assert changed != folder and not same_tokens(changed, folder)


def refusal(tmp_path, cli_forks, path: Path, *overrides: str) -> str:
    """The training CLI's stderr for data.path=``path``, asserting it is one line, exit code 2, and left no cache."""
    run = tmp_path / "run"
    done = cli_forks.run(
        f"data.path={path}", f"data.cache_dir={tmp_path / 'cache'}", f"hydra.run.dir={run}", *overrides
    )
    code, out, err = done.returncode, done.stdout, done.stderr
    assert code == 2, (out, err)
    assert len(err.strip().splitlines()) == 1 and err.startswith("error: "), err
    assert not [p for p in (tmp_path / "cache").glob("*") if (p / "meta.json").exists()]
    return err.strip()


def test_a_corrupt_parquet_shard_is_refused_in_one_line_naming_it_before_training(tmp_path, cli_forks):
    shards = [shipped_documents(30)[k::3] for k in range(3)]
    write_parquet_shards(tmp_path / "shards", shards)
    shard = tmp_path / "shards" / "part-2.parquet"
    shard.write_bytes(shard.read_bytes()[:-100])  # a download cut short: the footer is gone
    err = refusal(tmp_path, cli_forks, tmp_path / "shards")
    assert re.fullmatch(rf"error: {shard}: not a readable Parquet file \(.*\); the file is damaged: download .*", err)
    assert "Traceback" not in err


def test_parquet_problems_name_the_file_and_the_row(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    docs = shipped_documents(30)
    write_parquet_shards(tmp_path / "wrong_column", [docs], body=docs)
    with pytest.raises(DataError, match=r"part-0.parquet: no 'text' column \(found: id, body\); name the text column"):
        prepare_corpus(str(tmp_path / "wrong_column"), str(tmp_path / "cache"), "byte", 20.0, 0)
    assert prepare_corpus(str(tmp_path / "wrong_column"), str(tmp_path / "cache"), "byte", 20.0, 0, text_field="body")
    with pytest.raises(DataError, match=r"part-0.parquet: column 'id' holds int64, not text"):
        prepare_corpus(str(tmp_path / "wrong_column"), str(tmp_path / "cache"), "byte", 20.0, 0, text_field="id")

    pq.write_table(pa.table({"text": ["a", "b", None, "c"]}), tmp_path / "nulls.parquet")
    with pytest.raises(DataError, match=r"nulls.parquet: row 3: 'text' is null; filter such rows out"):
        prepare_corpus(str(tmp_path / "nulls.parquet"), str(tmp_path / "cache"), "byte", 20.0, 0)

    write_parquet_shards(tmp_path / "damaged", [docs])  # row groups of 7 rows: the second starts at row 8
    shard = tmp_path / "damaged" / "part-0.parquet"
    second = pq.ParquetFile(shard).metadata.row_group(1).column(1).data_page_offset
    data = bytearray(shard.read_bytes())
    data[second : second + 40] = b"\xff" * 40  # a damaged page inside the file: its footer still reads
    shard.write_bytes(bytes(data))
    with pytest.raises(DataError, match=r"part-0.parquet: rows 8-14 \(row group 1\) are unreadable \(.*\); the file"):
        prepare_corpus(str(tmp_path / "damaged"), str(tmp_path / "cache"), "byte", 20.0, 0)


@pytest.mark.parametrize("suffix", [".jsonl.zst", ".jsonl.gz"])
def test_a_truncated_compressed_jsonl_is_refused_naming_the_file_and_the_last_whole_line(tmp_path, suffix):
    lines = "".join(json.dumps({"text": f"document {i} " * 30}) + "\n" for i in range(20_000)).encode()
    packed = zstd_frames(lines, num_frames=1) if suffix.endswith("zst") else gzip.compress(lines)
    path = tmp_path / f"docs{suffix}"
    path.write_bytes(packed[: len(packed) // 2])
    with pytest.raises(DataError) as refused:
        prepare_corpus(str(path), str(tmp_path / "cache"), "byte", 20.0, 0)
    message = str(refused.value)
    found = re.fullmatch(
        rf"{path}: the file is cut short: it ends inside a compressed stream, after line ([\d,]+) of its text; "
        "download or compress it again, or remove it from data.path",
        message,
    )
    assert found, message
    assert 1_000 < int(found[1].replace(",", "")) < 20_000  # the lines before the cut were read, not all of them
    garbage = tmp_path / f"garbage{suffix}"
    garbage.write_bytes(b"these bytes are not compressed " * 50)
    with pytest.raises(DataError, match=rf"{garbage}: damaged: not readable as (zstd|gzip) .*before the end of"):
        prepare_corpus(str(garbage), str(tmp_path / "cache"), "byte", 20.0, 0)


def test_text_gz_zst_and_plain_text_give_the_same_tokens(tmp_path):
    text = "".join(f"line {i} of a long text file, déjà vu\n" for i in range(60_000))  # ~2.4 MB: several blocks
    for name, data in [
        ("plain/book.txt", text.encode()),
        ("gz/book.txt.gz", gzip.compress(text.encode())),
        ("zst/book.txt.zst", zstd_frames(text.encode())),
    ]:
        (tmp_path / name).parent.mkdir()
        (tmp_path / name).write_bytes(data)
    cache = str(tmp_path / "cache")
    plain = prepare_corpus(str(tmp_path / "plain"), cache, "byte", 30.0, 0)
    assert tokens(plain, "valid").size and tokens(plain, "train").size
    for folder in ("gz", "zst"):
        assert same_tokens(prepare_corpus(str(tmp_path / folder), cache, "byte", 30.0, 0), plain)


def test_a_missing_optional_package_is_refused_naming_the_file_and_the_extra(tmp_path, monkeypatch):
    write_parquet_shards(tmp_path / "shards", [shipped_documents(10)])
    (tmp_path / "zst").mkdir()
    (tmp_path / "zst" / "docs.jsonl.zst").write_bytes(zstd_frames(b'{"text": "a"}\n'))
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # import pyarrow now raises ImportError, as when not installed
    monkeypatch.setitem(sys.modules, "zstandard", None)
    for path, package in [(tmp_path / "shards", "pyarrow"), (tmp_path / "zst", "zstandard")]:
        with pytest.raises(DataError) as refused:
            prepare_corpus(str(path), str(tmp_path / "cache"), "byte", 20.0, 0)
        assert re.fullmatch(
            rf"data.path: {path}/\S+ \(a \w+ file\) needs the {package} package, which is not installed: "
            r"pip install 'shardlab\[corpora\]'",
            str(refused.value),
        ), str(refused.value)


def test_parquet_blocks_hold_about_block_bytes_of_whole_rows_numbered_from_one(tmp_path):
    """A record batch of long documents is cut into blocks of ~block_bytes (what bounds the blocks in flight to the
    workers), each knowing its first row's number (what the split hashes and errors name)."""
    docs = [f"row {i} " + "x" * (50 + 40 * (i % 5)) for i in range(60)]
    write_parquet_shards(tmp_path / "shards", [docs])
    (source,) = find_sources(tmp_path / "shards")
    blocks = list(read_blocks(source, block_bytes=1000))
    assert [t for b in blocks for t in b.texts] == docs
    assert all(1000 <= b.size < 1000 + 300 for b in blocks[:-1]) and blocks[-1].last
    assert [b.first_line for b in blocks] == [1 + sum(len(b.texts) for b in blocks[:k]) for k in range(len(blocks))]
    assert all(b.size == sum(len(t.encode()) for t in b.texts) for b in blocks)
