"""A user_dir under torchrun: every rank's own command line imports the folder; the sharded run matches one process.
(Local ranks, a Hydra multirun and Slurm are covered by the tutorial's tests.)"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from shardlab.distributed import env as dist_env
from shardlab.distributed.env import free_port
from shardlab.runner import run_rank
from tests.conftest import compose_config
from tests.events import scalars

SHORT = ["task=spirals", "optimization.max_steps=20", "logging.interval_steps=5", "validation.interval_steps=10"]


@pytest.mark.slow
def test_torchrun_two_ranks_of_a_user_task_match_one_process(research_root, tmp_path):
    user_dir = research_root / "examples" / "my_research"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
        "-m", "shardlab.train", "user_dir=examples/my_research", *SHORT, "distributed.backend=fully_sharded",
        f"hydra.run.dir={tmp_path / 'torchrun'}",
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=research_root, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "world size 2 (torchrun)" in proc.stdout and proc.stdout.count("final validation:") == 1
    expected = run_rank(compose_config([f"user_dir={user_dir}", *SHORT]), tmp_path / "one", dist_env.detect())
    got = scalars(tmp_path / "torchrun")
    want = [(r["step"], r["loss"]) for r in expected["history"] if r["split"] == "train"]
    assert [s for s, _ in got] == [s for s, _ in want] == [5, 10, 15, 20]
    torch.testing.assert_close(
        torch.tensor([v for _, v in got], dtype=torch.float64),
        torch.tensor([v for _, v in want], dtype=torch.float64),
        rtol=1e-5,
        atol=0,
    )
