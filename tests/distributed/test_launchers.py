"""The same command line runs under torchrun: ranks from env://, only rank 0 talks."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from shardlab.distributed.env import free_port
from tests.conftest import TINY_LM

ROOT = Path(__file__).resolve().parents[2]


def test_torchrun_two_ranks_trains_and_only_rank_zero_logs(tmp_path, corpus_cache):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        f"--master_port={free_port()}",
        "-m",
        "shardlab.train",
        "distributed.backend=fully_sharded",
        *TINY_LM,
        f"data.cache_dir={corpus_cache}",
        f"hydra.run.dir={tmp_path}",
        "logging.interval_steps=5",
    ]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "world size 2 (torchrun)" in proc.stdout
    assert proc.stdout.count("[train] step 10 |") == 1  # rank 1 is silent
    assert proc.stdout.count("final validation:") == 1
    assert (tmp_path / "checkpoints" / "step_00000010" / "shardlab.json").is_file()
