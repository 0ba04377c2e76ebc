"""The same command line runs under torchrun: ranks from env://, only rank 0 talks."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from shardlab.distributed import env as dist_env
from shardlab.distributed.env import free_port
from shardlab.runner import run_rank
from tests.conftest import TINY_LM
from tests.events import scalars

pytestmark = pytest.mark.e2e  # torchrun and local ranks as commands: CI runs it after the suite (tests/conftest.py)

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


def two_torchrun_nodes(tmp_path: Path, args: list[str], node_env=lambda node: {}, timeout: float = 400) -> list:
    """Two torchrun agents that rendezvous over loopback as two "nodes" of 2 ranks each; (exit code, stdout, stderr)
    of each once both have ended, or a failure that shows both logs if either hangs."""
    port = free_port()
    # Each agent writes to files, not pipes: waiting on one agent's pipes while the other's fill up (warnings, a
    # traceback) blocks that node's ranks in a write, and every rank of the other node in a collective.
    logs = [(tmp_path / f"node{node}.out", tmp_path / f"node{node}.err") for node in (0, 1)]
    agents = []
    for node, (out, err) in enumerate(logs):
        with out.open("w") as stdout, err.open("w") as stderr:
            agents.append(
                subprocess.Popen(
                    [
                        sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=2",
                        f"--node_rank={node}", "--master_addr=127.0.0.1", f"--master_port={port}",
                        "-m", "shardlab.train", *args,
                    ],
                    cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1", **node_env(node)}, stdout=stdout,
                    stderr=stderr,
                )
            )  # fmt: skip
    deadline = time.monotonic() + timeout
    try:
        while any(agent.poll() is None for agent in agents):
            assert time.monotonic() < deadline, "a node hung:\n" + "\n".join(
                f"node {node} stderr: {err.read_text()[-1500:]}" for node, (_, err) in enumerate(logs)
            )
            time.sleep(0.2)
    finally:
        for agent in agents:
            agent.kill()
    return [(a.returncode, out.read_text(), err.read_text()) for a, (out, err) in zip(agents, logs, strict=True)]


def test_two_torchrun_nodes_with_hybrid_sharding_match_one_process(tmp_path, corpus_cache, tiny_lm):
    """sharding_degree=2 shards inside a node and replicates across the two (HSDP). The losses equal one process's."""
    overrides = [*TINY_LM, f"data.cache_dir={corpus_cache}", "logging.tensorboard=true"]
    args = ["distributed.backend=fully_sharded", "distributed.sharding_degree=2", *overrides,
            f"hydra.run.dir={tmp_path / 'hsdp'}"]  # fmt: skip
    nodes = two_torchrun_nodes(tmp_path, args)
    for code, _, err in nodes:
        assert code == 0, err[-3000:]
    assert "world size 4 (torchrun)" in nodes[0][1] and "mesh 2x2 ('dp_replicate', 'dp_shard')" in nodes[0][1]
    reference = run_rank(tiny_lm("logging.tensorboard=false"), tmp_path / "single", dist_env.detect())
    expected = [r["loss"] for r in reference["history"] if r["split"] == "train"]
    got = scalars(tmp_path / "hsdp")
    assert [step for step, _ in got] == list(range(1, 11))
    torch.testing.assert_close(
        torch.tensor([v for _, v in got], dtype=torch.float64), torch.tensor(expected, dtype=torch.float64), rtol=1e-5,
        atol=0,
    )  # fmt: skip


def test_a_node_whose_checks_fail_stops_the_whole_job_at_once_with_its_reason(tmp_path, corpus_cache):
    """The second node cannot write the checkpoint directory (a node-local path, here one under /proc). Its ranks
    fail their start-up checks before they reach the others; the first node's ranks stop with that reason at once,
    instead of waiting ten minutes for ranks its torchrun never knew had stopped."""
    args = ["distributed.backend=fully_sharded", *TINY_LM, f"data.cache_dir={corpus_cache}",
            "checkpoint.dir=${oc.env:CKPT_DIR}", f"hydra.run.dir={tmp_path / 'run'}"]  # fmt: skip
    (tmp_path / "afile").write_text("")  # node 1's checkpoint folder would be inside a file: it cannot be made
    unwritable = tmp_path / "afile" / "ckpt"
    started = time.monotonic()
    nodes = two_torchrun_nodes(
        tmp_path,
        args,
        node_env=lambda node: {"CKPT_DIR": str(unwritable) if node else "checkpoints"},
        timeout=120,
    )
    assert time.monotonic() - started < 90
    assert [code for code, _, _ in nodes] == [1, 1]
    reason = f"checkpoint.dir: cannot create or write {unwritable} ({unwritable.parent} is a file, not a directory)"
    assert f"error: {reason}" in nodes[1][2]
    assert re.search(rf"error: rank [23] failed before joining: {re.escape(reason)}", nodes[0][2]), nodes[0][2][-3000:]
    status = json.loads((tmp_path / "run" / "status.json").read_text())
    assert status["status"] == "failed" and "failed before joining: checkpoint.dir" in status["error"]


def test_sigterm_to_a_local_two_rank_run_stops_both_ranks_at_a_saved_step(tmp_path, corpus_cache):
    from shardlab.jobs import run_record
    from shardlab.jobs.preemption import STOPPED_EXIT_CODE

    cmd = [
        sys.executable, "-m", "shardlab.train", *TINY_LM, f"data.cache_dir={corpus_cache}", f"hydra.run.dir={tmp_path}",
        "distributed.backend=fully_sharded", "distributed.world_size=2", "optimization.max_steps=100000",
        "lr_scheduler.warmup_steps=0", "validation.interval_steps=0",
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
    deadline = time.monotonic() + 180
    while (run_record.read(tmp_path) or {}).get("step", 0) < 3:
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()[-3000:]
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == STOPPED_EXIT_CODE, err[-3000:]
    status = run_record.read(tmp_path)
    assert status["status"] == "stopped" and status["stopped_by"] == "SIGTERM"
    assert f"stopped at step {status['step']} on SIGTERM" in out and "rerun the same command to resume" in out
    saved = [p.name for p in (tmp_path / "checkpoints").iterdir()]
    assert saved == [f"step_{status['step']:08d}"]
