"""A Hugging Face model.pretrained folder's small files (config.json, tokenizer_config.json, the safetensors index)
are read through regular_file.read_small_file: a FIFO is refused at once instead of hanging pre-flight, a link to a
device is refused saying what it is (not "has no config.json"), and a Hugging Face cache's snapshot, whose files are
links into a sibling blobs/ folder, still loads."""

from __future__ import annotations

import os
import shutil
import threading
from pathlib import Path

import pytest
import torch

from shardlab.checkpoint.hf_folder import INDEX_FILE, weight_files
from shardlab.errors import CheckpointError, ConfigError
from shardlab_tasks.lm.hf.hf_models import HFConfigError, eos_token, read_config_json
from tests.hf_folders import make_folder
from tests.unit.test_hf_pretrained import loaded, task_of


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return make_folder("llama3", tmp_path_factory.mktemp("hf") / "llama3")


def copy_with(folder: Path, tmp_path: Path, name: str, make) -> Path:
    """``folder`` copied, its file ``name`` replaced by what ``make(path)`` puts there."""
    copy = tmp_path / "model"
    shutil.copytree(folder, copy)
    (copy / name).unlink()
    make(copy / name)
    return copy


def within(seconds: float, call):
    """What ``call()`` raises or returns, from a thread given ``seconds``: a read blocked on a FIFO fails the test."""
    outcome: list = []
    worker = threading.Thread(target=lambda: outcome.append(_outcome(call)), daemon=True)
    worker.start()
    worker.join(timeout=seconds)
    return outcome[0] if outcome else pytest.fail(f"still reading after {seconds} s (a FIFO was opened blocking)")


def _outcome(call):
    try:
        return call()
    except BaseException as e:  # noqa: BLE001  (handed to the test thread, which asserts on it)
        return e


def test_a_fifo_tokenizer_config_is_refused_at_once_in_one_line(folder, tmp_path):
    copy = copy_with(folder, tmp_path, "tokenizer_config.json", os.mkfifo)
    refused = within(10, lambda: eos_token(copy))
    assert isinstance(refused, HFConfigError), refused
    assert str(refused) == (
        f"model.pretrained: {copy / 'tokenizer_config.json'} is a FIFO, not a regular file; give a Hugging Face model "
        "folder"
    )
    assert isinstance(within(10, lambda: task_of(copy)), HFConfigError)  # the pre-flight's road, not only the reader
    try:
        os.close(os.open(copy / "tokenizer_config.json", os.O_WRONLY | os.O_NONBLOCK))  # end a reader that blocked
    except OSError:
        pass  # no reader: none blocked


def test_a_fifo_or_device_tokenizer_json_is_refused_at_once_not_taken_for_no_tokenizer(folder, tmp_path):
    """A folder's tokenizer.json that is no file is refused (it used to be skipped: the run fell back to bytes), and
    the tokenizers library is never handed a FIFO to open by name."""
    from shardlab_tasks.lm.corpus.tokenizer import FileTokenizer

    copy = copy_with(folder, tmp_path, "tokenizer.json", os.mkfifo)
    refused = within(10, lambda: task_of(copy))
    assert isinstance(refused, ConfigError), refused
    assert str(refused) == f"data.tokenizer: {copy / 'tokenizer.json'} is a FIFO, not a regular file; give the path " \
        "of a tokenizer.json"  # fmt: skip
    (copy / "tokenizer.json").unlink()
    (copy / "tokenizer.json").symlink_to("/dev/zero")
    refused = within(10, lambda: FileTokenizer(copy / "tokenizer.json"))
    assert isinstance(refused, ConfigError) and "a character device" in str(refused), refused


def test_a_config_json_linked_to_dev_zero_is_refused_naming_what_it_is(folder, tmp_path):
    copy = copy_with(folder, tmp_path, "config.json", lambda p: p.symlink_to("/dev/zero"))
    refused = within(10, lambda: read_config_json(copy))
    assert isinstance(refused, HFConfigError), refused
    assert str(refused) == (
        f"model.pretrained: {copy / 'config.json'} is a character device, not a regular file; give a Hugging Face "
        "model folder"
    )
    (copy / "config.json").unlink()
    with pytest.raises(HFConfigError, match="has no config.json"):  # missing is still said so
        read_config_json(copy)


def test_an_index_that_is_a_fifo_or_a_device_is_refused_and_a_missing_one_globs(folder, tmp_path):
    copy = copy_with(folder, tmp_path, INDEX_FILE, os.mkfifo)
    refused = within(10, lambda: weight_files(copy))
    assert isinstance(refused, CheckpointError) and str(refused).startswith(
        f"{copy / INDEX_FILE} is a FIFO, not a regular file"
    ), refused
    (copy / INDEX_FILE).unlink()
    (copy / INDEX_FILE).symlink_to("/dev/zero")
    with pytest.raises(CheckpointError, match=f"^{copy / INDEX_FILE} is a character device, not a regular file"):
        weight_files(copy)
    (copy / INDEX_FILE).unlink()
    assert weight_files(copy) == sorted(copy.glob("*.safetensors")) and len(weight_files(copy)) >= 3


def test_a_weights_file_that_is_a_fifo_is_refused_before_safetensors_opens_it(folder, tmp_path):
    """safetensors opens its files by name: a FIFO among them (globbed, or named by the index) would hang it."""
    copy = copy_with(folder, tmp_path, INDEX_FILE, lambda p: None)  # no index: every *.safetensors is read
    os.mkfifo(copy / "model-extra.safetensors")
    refused = within(10, lambda: weight_files(copy))
    assert isinstance(refused, CheckpointError), refused
    assert str(refused).startswith(f"{copy / 'model-extra.safetensors'} is a FIFO, not a regular file"), refused
    shutil.copy(folder / INDEX_FILE, copy / INDEX_FILE)
    named = sorted(copy.glob("model-0*.safetensors"))[0]
    named.unlink()
    os.mkfifo(named)
    refused = within(10, lambda: weight_files(copy))
    assert isinstance(refused, CheckpointError) and str(refused).startswith(f"{named} is a FIFO"), refused
    named.unlink()  # not downloaded: the index names it, the folder lacks it (a dangling link alike)
    for make in (lambda p: None, lambda p: p.symlink_to(tmp_path / "blobs" / "never-fetched")):
        make(named)
        with pytest.raises(CheckpointError, match=f"names {named.name}, which is not in {copy}; download the whole"):
            weight_files(copy)


def test_a_hugging_face_cache_snapshot_of_links_into_blobs_loads_as_its_folder(folder, tmp_path):
    """models--org--name/snapshots/REV/* are relative links to ../../blobs/HASH, a sibling folder: followed."""
    cache = tmp_path / "models--org--tiny"
    (cache / "blobs").mkdir(parents=True)
    snapshot = cache / "snapshots" / "0123abcd"
    snapshot.mkdir(parents=True)
    for i, file in enumerate(sorted(folder.iterdir())):
        shutil.copy(file, cache / "blobs" / f"blob{i:04d}")
        (snapshot / file.name).symlink_to(Path("..", "..", "blobs", f"blob{i:04d}"))
    assert all((snapshot / n).is_symlink() for n in ("config.json", "tokenizer_config.json", INDEX_FILE))
    assert weight_files(snapshot) == sorted(snapshot.glob("*.safetensors"))
    ours, theirs = loaded(task_of(snapshot)), loaded(task_of(folder))
    assert ours.state_dict().keys() == theirs.state_dict().keys()
    assert all(torch.equal(ours.state_dict()[k], v) for k, v in theirs.state_dict().items())
    assert eos_token(snapshot) == "<|endoftext|>"
