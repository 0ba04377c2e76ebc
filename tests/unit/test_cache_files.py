"""A corpus cache's own files (the shard plan, the shard records, the manifest) and the chat template's
tokenizer_config.json are read through the one reader: a FIFO under their name is refused at once (it blocked every
training start), a link to /dev/zero is refused before a byte is read (a start read 1.5 GB of it), a file past the cap
is refused by its size (a 4 GB tokenizer_config.json was read whole); each in one line, with nothing on disk
changed."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from shardlab.errors import ConfigError, DataError
from shardlab_tasks.lm.corpus.cache import prepare_corpus, preprocess_shards, read_corpus_meta
from shardlab_tasks.lm.corpus.tokenizer import ByteTokenizer
from shardlab_tasks.lm.finetuning.sft_template import find_chat_template, load_chat_template


def finished(fn, timeout_s: float = 30.0) -> BaseException | None:
    """Run ``fn`` in a thread: the exception it raised (None if none), or a failure if it is still running after
    ``timeout_s`` (blocked in a FIFO's open, as readers were)."""
    outcome: list[BaseException | None] = []

    def run() -> None:
        try:
            fn()
            outcome.append(None)
        except BaseException as e:  # noqa: BLE001  (handed to the test)
            outcome.append(e)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout_s)
    assert outcome, f"still running after {timeout_s} s: blocked on a FIFO or reading without end"
    return outcome[0]


def snapshot(folder: Path) -> dict[str, tuple[str, int, int]]:
    """Every entry under ``folder``: its kind, size and mtime (a FIFO or link is stat'ed without following)."""
    return {
        str(p.relative_to(folder)): (oct(p.lstat().st_mode), p.lstat().st_size, p.lstat().st_mtime_ns)
        for p in sorted(folder.rglob("*"))
    }


@pytest.fixture
def half_sharded(tmp_path) -> tuple[Path, Path]:
    """(corpus, cache) where task 0 of 2 finished its shard of 2: a plan and one record, no manifest yet."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for k in range(2):
        (corpus / f"part-{k}.txt").write_text("\n\n".join(f"document {k}-{i} " * 20 for i in range(40)))
    out, meta = preprocess_shards(str(corpus), str(tmp_path / "cache"), ByteTokenizer(), 10.0, "text", 2, (0, 2))
    assert meta is None and (out / "shards" / "plan.json").is_file()
    return corpus, out


def start(corpus: Path, out: Path):
    """What a training start does with the cache: find it, see it is being preprocessed as shards."""
    return lambda: prepare_corpus(str(corpus), str(out.parent), "byte", 10.0, 0, num_workers=0)


@pytest.mark.parametrize("plant", ["fifo", "dev-zero"])
def test_a_shard_plan_that_is_a_fifo_or_a_link_to_dev_zero_is_refused_at_start_in_one_line(half_sharded, plant):
    corpus, out = half_sharded
    plan = out / "shards" / "plan.json"
    plan.unlink()
    os.mkfifo(plan) if plant == "fifo" else os.symlink("/dev/zero", plan)
    before = snapshot(out)
    error = finished(start(corpus, out))
    assert isinstance(error, DataError), error
    kind = "a FIFO, not a regular file" if plant == "fifo" else "a symbolic link, not a regular file"
    assert str(error) == f"{plan} is {kind}; delete {out} to preprocess again"
    assert snapshot(out) == before


def test_a_shard_record_that_is_a_link_to_dev_zero_is_refused_by_the_next_task(half_sharded):
    corpus, out = half_sharded
    record = out / "shards" / "00000" / "record.json"
    record.unlink()
    os.symlink("/dev/zero", record)
    before = snapshot(out)
    error = finished(lambda: preprocess_shards(str(corpus), str(out.parent), ByteTokenizer(), 10.0, "text", 2, (1, 2)))
    assert isinstance(error, DataError) and str(error).startswith(f"{record} is a symbolic link"), error
    assert "\n" not in str(error) and snapshot(out) == before


def test_a_manifest_past_the_cap_or_not_a_json_object_is_refused_naming_it(tmp_path):
    corpus = tmp_path / "one.txt"
    corpus.write_text("a small corpus of one document, said twice. " * 400)
    out = prepare_corpus(str(corpus), str(tmp_path / "cache"), "byte", 10.0, 0, num_workers=0)
    meta = out / "meta.json"
    meta.write_text("[1, 2]")
    with pytest.raises(DataError, match=r"meta.json holds a JSON list, not the object shardlab writes; delete"):
        read_corpus_meta(out)
    meta.unlink()
    with open(meta, "wb") as f:
        f.truncate(257 * 2**20)  # sparse: a size past the cap, nothing on the disk
    error = finished(lambda: read_corpus_meta(out))
    assert isinstance(error, DataError) and "holds 269484032 bytes, more than the 268435456 allowed" in str(error)
    meta.unlink()
    os.mkfifo(meta)
    error = finished(lambda: read_corpus_meta(out))
    assert isinstance(error, DataError) and str(error) == f"{meta} is a FIFO, not a regular file; delete {out} to " \
        "preprocess again"  # fmt: skip


@pytest.mark.parametrize("plant", ["big", "fifo", "dev-zero"])
def test_a_tokenizer_config_beside_the_tokenizer_is_read_through_the_reader(tmp_path, plant):
    """data.format=chat with the model folder's template: a 4 GB tokenizer_config.json was read whole (1.5 GB of
    memory in 7 s); past the 16 MiB cap of a model folder's JSON it is refused by its size, unread."""
    folder = tmp_path / "model"
    folder.mkdir()
    config = folder / "tokenizer_config.json"
    if plant == "big":
        with open(config, "wb") as f:
            f.write(b'{"chat_template": "{{ messages }}", "pad": "')
            f.truncate(17 * 2**20)
    elif plant == "fifo":
        os.mkfifo(config)
    else:
        os.symlink("/dev/zero", config)
    error = finished(lambda: find_chat_template(None, str(folder / "tokenizer.json")))
    assert isinstance(error, ConfigError), error
    reason = {"big": "holds 17825792 bytes, more than the 16777216 allowed", "fifo": "is a FIFO, not a regular file",
              "dev-zero": "is a character device, not a regular file"}[plant]  # fmt: skip
    assert str(error) == f"data.tokenizer: {config} {reason}; give a tokenizer_config.json or a .jinja file"
    error = finished(lambda: load_chat_template(config))  # named outright as data.chat_template: the same refusal
    assert isinstance(error, ConfigError) and str(error).startswith(f"data.chat_template: {config} {reason};")


def test_a_tokenizer_config_without_a_template_still_means_no_template(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text('{"eos_token": "</s>"}')
    assert find_chat_template(None, str(tmp_path / "tokenizer.json")) is None
    assert find_chat_template(None, str(tmp_path / "absent" / "tokenizer.json")) is None
    (tmp_path / "tokenizer_config.json").write_text('{"chat_template": "{{ messages[0].content }}"}')
    assert find_chat_template(None, str(tmp_path / "tokenizer.json")).render([{"content": "hi"}]) == "hi"


@pytest.mark.parametrize("plant", ["fifo", "link-out"])
def test_an_image_that_is_a_fifo_or_a_link_out_of_the_folder_is_refused_as_undecodable(tmp_path, plant):
    """An image is a file of the folder the user named: a FIFO under an image's name blocked a DataLoader worker for
    ever; a link out of the folder is not followed. Both are undecodable images (skipped with data.skip_corrupt)."""
    from PIL import Image

    from shardlab_tasks.image_classification.data import ImageFiles

    (tmp_path / "data" / "cat").mkdir(parents=True)
    Image.new("RGB", (4, 4)).save(tmp_path / "data" / "cat" / "a.png")
    bad = tmp_path / "data" / "cat" / "b.png"
    if plant == "fifo":
        os.mkfifo(bad)
    else:
        Image.new("RGB", (4, 4)).save(tmp_path / "outside.png")
        os.symlink(tmp_path / "outside.png", bad)
    images = ImageFiles(tmp_path / "data", transform=lambda x: x, skip_corrupt=False)
    error = finished(lambda: images[1])
    assert isinstance(error, DataError) and str(error).startswith(f"data: cannot decode image {bad} ("), error
    skipping = ImageFiles(tmp_path / "data", transform=lambda x: x, skip_corrupt=True)
    assert finished(lambda: skipping[1]) is None  # passed over for the next decodable image
