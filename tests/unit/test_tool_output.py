"""The tools' everyday output: a missing step names the steps that exist, a consolidated file's mode follows the
umask, and a tool's normal output carries no torch warning about running in one process."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from shardlab.checkpoint import weights
from shardlab.checkpoint.layout import META_FILE
from shardlab.distributed import env as dist_env
from shardlab.errors import CheckpointError
from shardlab.files.durable import umask
from shardlab.runner import run_rank
from tests.conftest import ROOT


def test_a_missing_step_lists_the_steps_its_folder_holds(tmp_path):
    for step in (10, 20, 30, 40, 50, 60, 70):
        (tmp_path / f"step_{step:08d}").mkdir()
        (tmp_path / f"step_{step:08d}" / META_FILE).write_text("{}")
    (tmp_path / "step_00000080.tmp").mkdir()  # being written: not a checkpoint
    with pytest.raises(CheckpointError) as e:
        weights.describe(tmp_path / "step_00000099")
    assert str(e.value) == (
        f"{tmp_path / 'step_00000099'} does not exist; {tmp_path} holds 2 older and step_00000030, step_00000040, "
        "step_00000050, step_00000060, step_00000070; give one of those"
    )
    with pytest.raises(CheckpointError, match="does not exist; give a step_N checkpoint directory or a .safetensors"):
        weights.describe(tmp_path / "nowhere" / "step_00000010")


@pytest.mark.parametrize("mask", [0o022, 0o077])
def test_a_consolidated_file_gets_the_mode_the_umask_gives(tmp_path, mask):
    before = os.umask(mask)
    try:
        assert umask() == mask
        out = weights.write_safetensors({"w": torch.ones(2)}, tmp_path / "model.safetensors", {"task": "lm"})
    finally:
        os.umask(before)
    assert out.stat().st_mode & 0o777 == 0o666 & ~mask  # safetensors alone writes 0600
    assert (tmp_path / "model.json").stat().st_mode & 0o777 == 0o666 & ~mask


def test_a_tools_normal_output_has_no_torch_distributed_warning(tmp_path, tiny_lm):
    run_rank(tiny_lm("optimization.max_steps=2", "checkpoint.interval_steps=2"), tmp_path, dist_env.detect())
    step = tmp_path / "checkpoints" / "step_00000002"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    out = tmp_path / "model.safetensors"
    cmd = [sys.executable, "-m", "shardlab_commands.consolidate", str(step), "--out", str(out)]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith("wrote ") and done.stderr == "", done.stderr
    assert json.loads((tmp_path / "model.json").read_text())["task"] == "lm"
