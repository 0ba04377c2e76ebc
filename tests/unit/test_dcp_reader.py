"""Opening a step folder never runs its code: a .metadata pickle that would is refused, in one line, by every path
that reads checkpoints; a normal checkpoint keeps torch's own format, so torch's DCP tools still read it."""

from __future__ import annotations

import os
import pickle
import shutil

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from shardlab.checkpoint import dcp_reader, weights
from shardlab.distributed import env as dist_env
from shardlab.errors import CheckpointError, UnsafeCheckpointError
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
