"""The same command line runs under torchrun: ranks from env://, only rank 0 talks."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

from shardlab.distributed import env as dist_env
from shardlab.distributed.env import free_port
from shardlab.runner import run_rank
from tests.conftest import TINY_LM
from tests.events import scalars

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


def test_two_torchrun_nodes_with_hybrid_sharding_match_one_process(tmp_path, corpus_cache, tiny_lm):
    """Two torchrun agents rendezvous over loopback as two "nodes" of 2 ranks; sharding_degree=2 shards inside a node
    and replicates across them (HSDP). The losses equal one process's."""
    overrides = [*TINY_LM, f"data.cache_dir={corpus_cache}", "logging.tensorboard=true"]
    port = free_port()
    agents = [
        subprocess.Popen(
            [
                sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=2",
                f"--node_rank={node}", "--master_addr=127.0.0.1", f"--master_port={port}",
                "-m", "shardlab.train", "distributed.backend=fully_sharded", "distributed.sharding_degree=2",
                *overrides, f"hydra.run.dir={tmp_path / 'hsdp'}",
            ],
            cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True,
        )
        for node in (0, 1)
    ]  # fmt: skip
    outputs = [agent.communicate(timeout=400) for agent in agents]
    for agent, (_, err) in zip(agents, outputs, strict=True):
        assert agent.returncode == 0, err[-3000:]
    assert "world size 4 (torchrun)" in outputs[0][0] and "mesh 2x2 ('replicate', 'shard')" in outputs[0][0]
    reference = run_rank(tiny_lm("logging.tensorboard=false"), tmp_path / "single", dist_env.detect())
    expected = [r["loss"] for r in reference["history"] if r["split"] == "train"]
    got = scalars(tmp_path / "hsdp")
    assert [step for step, _ in got] == list(range(1, 11))
    torch.testing.assert_close(
        torch.tensor([v for _, v in got], dtype=torch.float64), torch.tensor(expected, dtype=torch.float64), rtol=1e-5,
        atol=0,
    )  # fmt: skip
