"""Opening a step folder never runs its code: a .metadata pickle that would is refused, in one line, by every path
that reads checkpoints, and so is a pickled value among the shards (DCP's own planner unpickles those with
weights_only=False) and an index that points outside the folder's files or gives a tensor more than its files hold;
a normal checkpoint keeps torch's own format, so torch's DCP tools still read it."""

from __future__ import annotations

import io
import os
import pickle
import shutil

import pytest
import torch
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex

from shardlab.checkpoint import dcp_reader, weights
from shardlab.distributed import env as dist_env
from shardlab.errors import CheckpointError, ConfigError, UnsafeCheckpointError, first_cause
from shardlab.runner import run_rank
from tools import consolidate, export_hf, generate

RUN = ["optimization.max_steps=2", "checkpoint.interval_steps=2", "validation.interval_steps=0"]


class RunsCode:
    """What an attacker puts into a pickle: unpickling it calls os.system."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self):
        return os.system, (self.command,)


@pytest.fixture(scope="module")
def checkpoints(tiny_lm, tmp_path_factory):
    """A normal step folder, and a copy whose .metadata also carries a payload that would create ``marker``."""
    tmp = tmp_path_factory.mktemp("dcp_reader")
    run_rank(tiny_lm(*RUN), tmp / "run", dist_env.detect())
    normal = tmp / "run" / "checkpoints" / "step_00000002"
    crafted = tmp / "crafted" / "step_00000002"
    shutil.copytree(normal, crafted)
    marker = tmp / "code-ran"
    metadata = dcp_reader.read_metadata(normal)
    metadata.planner_data = {"payload": RunsCode(f"touch {marker}")}  # hidden among the real entries
    (crafted / ".metadata").write_bytes(pickle.dumps(metadata))
    return normal, crafted, marker


def crafted_copy(normal, dest, edit) -> None:
    """``dest``: a copy of step folder ``normal`` whose index ``edit(metadata, dest)`` changed."""
    shutil.copytree(normal, dest)
    metadata = dcp_reader.read_metadata(normal)
    edit(metadata, dest)
    (dest / ".metadata").write_bytes(pickle.dumps(metadata))


def byte_entry_payload(marker):
    """An edit that makes the optimizer's first learning rate a pickle that would create ``marker`` when loaded."""

    def edit(metadata, dest) -> None:
        buffer = io.BytesIO()
        torch.save(RunsCode(f"touch {marker}"), buffer)  # as DCP writes its values: torch.save's format
        payload = buffer.getvalue()
        (dest / "__9_0.distcp").write_bytes(payload)
        metadata.storage_data[MetadataIndex("optim.param_groups.0.lr")] = _StorageInfo("__9_0.distcp", 0, len(payload))

    return edit


@pytest.fixture(scope="module")
def crafted_value(checkpoints, tmp_path_factory):
    """A step folder whose index is DCP's own but one of whose pickled values would run code."""
    normal, _, _ = checkpoints
    tmp = tmp_path_factory.mktemp("crafted_value")
    marker = tmp / "code-ran"
    crafted_copy(normal, tmp / "step_00000002", byte_entry_payload(marker))
    return tmp / "step_00000002", marker


def assert_value_refused(error: BaseException, crafted, marker) -> None:
    message = str(error)
    assert "\n" not in message
    assert (
        f"{crafted}: its entry optim.param_groups.0.lr is a pickle that torch's weights_only unpickler refuses "
        "(it names posix.system)"
    ) in message
    assert not marker.exists(), "the payload ran"


def assert_refused(error: BaseException, crafted, marker) -> None:
    message = str(error)
    assert "\n" not in message
    assert f"{crafted / '.metadata'} refers to posix.system, which DCP checkpoint metadata never holds" in message
    assert not marker.exists(), "the payload ran"


def test_torch_still_writes_the_index_under_the_name_we_read():
    from torch.distributed.checkpoint.filesystem import _metadata_fn

    assert _metadata_fn == dcp_reader.METADATA_FILE


def test_a_normal_checkpoint_reads_through_the_allow_list_and_through_torchs_own_tools(checkpoints, tmp_path):
    normal, _, _ = checkpoints
    ours = weights.read_full(normal)
    dcp_to_torch_save(str(normal), str(tmp_path / "whole.pt"))
    theirs = torch.load(tmp_path / "whole.pt", weights_only=True)["model"]
    assert sorted(ours) == sorted(theirs) and all(torch.equal(ours[k], theirs[k]) for k in ours)


def test_resume_refuses_a_crafted_metadata_and_sets_nothing_aside(tiny_lm, checkpoints, tmp_path):
    _, crafted, marker = checkpoints
    shutil.copytree(crafted, tmp_path / "checkpoints" / crafted.name)
    with pytest.raises(UnsafeCheckpointError) as auto:  # the folder's own newest: refused, no fallback
        run_rank(tiny_lm(*RUN), tmp_path, dist_env.detect())
    assert_refused(auto.value, tmp_path / "checkpoints" / crafted.name, marker)
    assert (tmp_path / "checkpoints" / crafted.name).is_dir()
    with pytest.raises(CheckpointError) as explicit:
        run_rank(tiny_lm(*RUN, f"checkpoint.resume={crafted}"), tmp_path / "other", dist_env.detect())
    assert_refused(explicit.value, crafted, marker)


def test_init_from_refuses_a_crafted_metadata(tiny_lm, checkpoints, tmp_path):
    _, crafted, marker = checkpoints
    with pytest.raises(CheckpointError) as e:
        run_rank(tiny_lm(*RUN, f"checkpoint.init_from={crafted}"), tmp_path, dist_env.detect())
    assert_refused(e.value, crafted, marker)


@pytest.mark.parametrize(
    "tool",
    [
        lambda c, out: generate.main([str(c), "--max-new-tokens", "2"]),
        lambda c, out: consolidate.main([str(c), "--out", str(out / "m.safetensors")]),
        lambda c, out: export_hf.main([str(c), "--out", str(out / "hf")]),
    ],
    ids=["generate", "consolidate", "export_hf"],
)
def test_the_tools_refuse_a_crafted_metadata(checkpoints, tmp_path, tool):
    _, crafted, marker = checkpoints
    with pytest.raises(UnsafeCheckpointError) as e:
        tool(crafted, tmp_path)
    assert_refused(e.value, crafted, marker)
    assert not any(tmp_path.iterdir()), "nothing was written"


def test_garbage_metadata_is_unreadable_not_unsafe(checkpoints, tmp_path):
    normal, _, _ = checkpoints
    broken = tmp_path / "step_00000002"
    shutil.copytree(normal, broken)
    (broken / ".metadata").write_bytes(b"\x80\x04not a pickle")
    with pytest.raises(CheckpointError, match=r"\.metadata is unreadable") as e:
        dcp_reader.read_metadata(broken)
    assert not isinstance(e.value, UnsafeCheckpointError)
    assert "does not unpickle" in dcp_reader.integrity_defect(broken)
    assert dcp_reader.integrity_defect(normal) is None


def test_resume_and_init_from_refuse_a_pickled_value_that_would_run_code(tiny_lm, crafted_value, tmp_path):
    crafted, marker = crafted_value
    shutil.copytree(crafted, tmp_path / "run" / "checkpoints" / crafted.name)
    with pytest.raises(UnsafeCheckpointError) as auto:
        run_rank(tiny_lm(*RUN), tmp_path / "run", dist_env.detect())
    assert_value_refused(auto.value, tmp_path / "run" / "checkpoints" / crafted.name, marker)
    assert (tmp_path / "run" / "checkpoints" / crafted.name).is_dir()  # refused, not set aside
    with pytest.raises(UnsafeCheckpointError) as init:
        run_rank(tiny_lm(*RUN, f"checkpoint.init_from={crafted}"), tmp_path / "init", dist_env.detect())
    assert_value_refused(init.value, crafted, marker)


@pytest.mark.parametrize("tool", ["generate", "consolidate", "export_hf"])
def test_the_tools_refuse_a_pickled_value_that_would_run_code(crafted_value, tmp_path, tool):
    crafted, marker = crafted_value
    run = {
        "generate": lambda: generate.main([str(crafted), "--max-new-tokens", "2"]),
        "consolidate": lambda: consolidate.main([str(crafted), "--out", str(tmp_path / "m.safetensors")]),
        "export_hf": lambda: export_hf.main([str(crafted), "--out", str(tmp_path / "hf")]),
    }[tool]
    with pytest.raises(UnsafeCheckpointError) as e:
        run()
    assert_value_refused(e.value, crafted, marker)
    assert not any(tmp_path.iterdir()), "nothing was written"


def test_the_load_itself_unpickles_values_with_weights_only(checkpoints, crafted_value):
    """Even a caller that skipped the check (checked=True) does not run the value: SafeLoadPlanner reads it."""
    normal, _, _ = checkpoints
    crafted, marker = crafted_value
    state = {"optim": {"param_groups": [{"lr": 0.0}]}}
    with pytest.raises(CheckpointException) as e:  # DCP wraps each rank's error
        dcp_reader.load(state, crafted, checked=True, no_dist=True)
    assert "UnsafeCheckpointError" in first_cause(e.value) and "(it names posix.system)" in first_cause(e.value)
    assert not marker.exists(), "the payload ran"
    dcp_reader.load(state, normal, checked=True, no_dist=True)  # DCP's own values still load, through the same path
    assert isinstance(state["optim"]["param_groups"][0]["lr"], float)


def _outside(metadata, dest) -> None:
    index = next(k for k in metadata.storage_data if k.fqn == "optim.param_groups.0.lr")
    metadata.storage_data[index] = _StorageInfo("/dev/zero", 0, 8 * 2**30)


def _device_link(metadata, dest) -> None:
    (dest / "__8_0.distcp").symlink_to("/dev/zero")
    index = next(k for k in metadata.storage_data if k.fqn == "optim.param_groups.0.lr")
    metadata.storage_data[index] = _StorageInfo("__8_0.distcp", 0, 8 * 2**30)


def _unstored_tensor(metadata, dest) -> None:
    entry = metadata.state_dict_metadata["model.embed.tok.weight"]
    entry.size = torch.Size([2**31])  # 8 GiB of float32 that no file holds
    entry.chunks = []


def _chunk_past_its_bytes(metadata, dest) -> None:
    entry = metadata.state_dict_metadata["model.embed.tok.weight"]
    first = entry.chunks[0]
    entry.size = torch.Size([first.sizes[0] * 1000, *entry.size[1:]])
    entry.chunks = [ChunkStorageMetadata(first.offsets, torch.Size([entry.size[0], *first.sizes[1:]]))]


@pytest.mark.parametrize(
    "edit, refusal",
    [
        (_outside, "places optim.param_groups.0.lr in '/dev/zero', outside the step folder"),
        (_device_link, "__8_0.distcp, which is not a regular file"),
        (_unstored_tensor, "gives model.embed.tok.weight the shape [2147483648] but chunks holding 0 of its elements"),
        (_chunk_past_its_bytes, "stores the chunk of model.embed.tok.weight at [0, 0] in fewer bytes than its"),
    ],
    ids=["absolute-path", "link-to-a-device", "tensor-no-file-holds", "chunk-larger-than-its-bytes"],
)
def test_an_index_that_would_read_or_allocate_past_the_folders_files_is_refused(checkpoints, tmp_path, edit, refusal):
    normal, _, _ = checkpoints
    crafted = tmp_path / "step_00000002"
    crafted_copy(normal, crafted, edit)
    out = tmp_path / "out" / "m.safetensors"
    for read in (dcp_reader.read_metadata, weights.read_full, lambda p: consolidate.main([str(p), "--out", str(out)])):
        with pytest.raises(UnsafeCheckpointError) as e:
            read(crafted)
        assert refusal in str(e.value) and "\n" not in str(e.value)
    assert not out.parent.exists(), "nothing was written"


def test_a_shard_cut_short_is_unreadable_not_unsafe(checkpoints, tmp_path):
    """A torn write: resume falls back past it (tests/unit/test_checkpoint_lifecycle.py), so it is no refusal."""
    normal, _, _ = checkpoints
    torn = tmp_path / "step_00000002"
    shutil.copytree(normal, torn)
    shard = torn / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    with pytest.raises(CheckpointError, match="a write cut short") as e:
        dcp_reader.read_metadata(torn)
    assert not isinstance(e.value, UnsafeCheckpointError)
    assert "a write cut short" in dcp_reader.integrity_defect(torn)


def test_an_optimizer_whose_param_groups_would_not_read_back_is_refused_before_training(tiny_lm, tmp_path, monkeypatch):
    """A plug-in optimizer keeping a numpy scalar in its param groups would save, then have its own checkpoint refused
    at resume as a crafted file: refused at once instead, naming the optimizer."""
    import numpy as np

    from shardlab.optim import OPTIMIZERS

    assert dcp_reader.values_load_back([{"lr": 1e-3, "betas": (0.9, 0.95), "foreach": None, "name": "x"}]) is None
    assert "numpy" in dcp_reader.values_load_back([{"lr": np.float64(1e-3)}])
    build = OPTIMIZERS.build

    def with_numpy_lr(*args, **kwargs):
        optimizer = build(*args, **kwargs)
        optimizer.param_groups[0]["lr"] = np.float64(optimizer.param_groups[0]["lr"])
        return optimizer

    monkeypatch.setattr(OPTIMIZERS, "build", with_numpy_lr)
    with pytest.raises(ConfigError, match=r"optimizer.name=adamw: its param groups hold a value checkpoints cannot"):
        run_rank(tiny_lm(*RUN), tmp_path, dist_env.detect())
    assert not (tmp_path / "checkpoints").exists()
