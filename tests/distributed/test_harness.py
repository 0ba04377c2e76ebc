"""tests/distributed/harness.py itself: its ranks run as the suite assumes they do."""

from __future__ import annotations

import pytest
import torch

from tests.distributed.harness import run_spawned


def threads(trainer) -> dict:
    return {"threads": torch.get_num_threads()}


@pytest.mark.parametrize("start_method", ["forkserver", "spawn"])
def test_every_rank_runs_one_thread_whatever_the_environment(tiny_lm, monkeypatch, start_method):
    """A rank imports torch before the harness sets OMP_NUM_THREADS (the fork server preloads it; a spawned rank
    imports it to unpickle the worker), so OpenMP sized its pool by the cores: two threads per rank, spinning against
    the other ranks on a 2-core machine, slowed every op of the suite's distributed tests."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    cfg = tiny_lm("optimization.max_steps=1", "validation.interval_steps=0", "distributed=ddp")
    (result,) = run_spawned([cfg], 2, inspect=threads, start_method=start_method)
    assert result["threads"] == 1
