"""A Hugging Face folder's weights come from exactly the files its index names (DCP's own HuggingFaceStorageReader
lists every ``*.safetensors`` of the folder: a stray file beside the index supplied weights, a FIFO of that name hung
the load), each a regular file of the folder; an index naming ``../x`` or an absolute path is refused; and every
failure of the read, DCP's CheckpointException (a BaseException) included, is one line."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest
import torch

from shardlab.checkpoint import hf_folder
from shardlab.checkpoint.hf_folder import INDEX_FILE, weight_files
from shardlab.errors import CheckpointError
from tests.hf_folders import make_folder
from tests.unit.test_hf_pretrained import loaded, task_of
from tests.unit.test_hf_small_files import within


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return make_folder("llama3", tmp_path_factory.mktemp("hf") / "llama3")


@pytest.fixture(scope="module")
def reference(folder) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in loaded(task_of(folder)).state_dict().items()}


def copied(folder: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "model"
    shutil.copytree(folder, copy)
    return copy


def stray(copy: Path) -> Path:
    """A file the index does not name, holding every tensor of the first shard at 9.0."""
    from safetensors.torch import load_file, save_file

    first = sorted(copy.glob("model-0*.safetensors"))[0]
    nines = {k: torch.full_like(v, 9.0) for k, v in load_file(str(first)).items()}
    save_file(nines, str(copy / "model-stray.safetensors"))
    return copy / "model-stray.safetensors"


def test_a_stray_safetensors_beside_the_index_supplies_no_weight(folder, reference, tmp_path):
    copy = copied(folder, tmp_path)
    stray(copy)
    assert copy / "model-stray.safetensors" not in weight_files(copy)
    ours = loaded(task_of(copy)).state_dict()
    assert ours.keys() == reference.keys()
    assert all(torch.equal(ours[k], v) for k, v in reference.items())


def test_a_fifo_beside_the_index_is_never_opened(folder, reference, tmp_path):
    copy = copied(folder, tmp_path)
    os.mkfifo(copy / "model-stray.safetensors")
    ours = within(60, lambda: loaded(task_of(copy)).state_dict())
    assert not isinstance(ours, BaseException), ours
    assert all(torch.equal(ours[k], v) for k, v in reference.items())


def test_without_an_index_exactly_the_safetensors_present_are_read_each_a_file(folder, tmp_path):
    copy = copied(folder, tmp_path)
    (copy / INDEX_FILE).unlink()
    assert weight_files(copy) == sorted(copy.glob("*.safetensors"))
    extra = stray(copy)  # now named by nobody's index: it is one of the folder's files, and it repeats keys
    with pytest.raises(CheckpointError, match=r"^\S+model-stray.safetensors is not a readable .* is in model-0"):
        hf_folder.tensor_files(weight_files(copy))
    extra.unlink()
    outside = tmp_path / "elsewhere.safetensors"
    shutil.copy(sorted(copy.glob("*.safetensors"))[0], outside)
    (copy / "model-linked.safetensors").symlink_to(outside)
    with pytest.raises(CheckpointError, match=f"model-linked.safetensors is a link to {outside}, outside"):
        weight_files(copy)


@pytest.mark.parametrize("name", ["../other/model.safetensors", "/tmp/model.safetensors", "sub/model.safetensors",
                                  "..", "config.json", 7])  # fmt: skip
def test_an_index_naming_a_path_outside_the_folder_is_refused_in_one_line(folder, tmp_path, name):
    copy = copied(folder, tmp_path)
    (tmp_path / "other").mkdir()
    shutil.copy(sorted(copy.glob("model-0*.safetensors"))[0], tmp_path / "other" / "model.safetensors")
    index = json.loads((copy / INDEX_FILE).read_text())
    index["weight_map"][next(iter(index["weight_map"]))] = name
    (copy / INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(CheckpointError) as refused:
        weight_files(copy)
    assert "\n" not in str(refused.value) and str(refused.value).startswith(f"{copy / INDEX_FILE} ")
    with pytest.raises(CheckpointError, match=re.escape(f"{copy / INDEX_FILE} ")):  # at the pre-flight
        loaded(task_of(copy))


def test_a_failure_inside_dcps_read_is_one_checkpoint_error_line_not_a_checkpoint_exception(
    folder, tmp_path, monkeypatch
):
    """A shard cut short after the headers were checked: DCP raises CheckpointException (a BaseException)."""
    copy = copied(folder, tmp_path)
    task = task_of(copy)
    monkeypatch.setattr(hf_folder, "fit_errors", lambda *args, **kwargs: [])
    shard = sorted(copy.glob("model-0*.safetensors"))[0]
    os.truncate(shard, shard.stat().st_size - 64)
    with pytest.raises(CheckpointError, match=f"^model.pretrained: {copy} could not be read") as refused:
        loaded(task)
    assert "\n" not in str(refused.value)
