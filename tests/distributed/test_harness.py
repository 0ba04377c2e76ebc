"""tests/distributed/harness.py itself: its ranks run as the suite assumes they do."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from tests.distributed.harness import run_spawned


def threads(trainer) -> dict:
    return {"threads": torch.get_num_threads()}


@pytest.mark.parametrize("start_method", ["forkserver", "spawn"])
def test_every_rank_runs_one_thread_whatever_the_environment(tiny_lm, monkeypatch, start_method):
    """A rank imports torch before the harness sets OMP_NUM_THREADS (the fork server preloads it; a spawned rank
    imports it to unpickle the worker), so OpenMP sized its pool by the cores: two threads per rank, spinning against
    the other ranks on a 2-core machine, slowed every op of the suite's distributed tests. The harness sets one thread
    where it is imported."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    cfg = tiny_lm("optimization.max_steps=1", "validation.interval_steps=0", "distributed=ddp")
    (result,) = run_spawned([cfg], 2, inspect=threads, start_method=start_method)
    assert result["threads"] == 1


def _write_threads(rank: int, out: str) -> None:
    Path(out, f"rank{rank}").write_text(str(torch.get_num_threads()))


def test_a_process_forked_from_the_server_directly_runs_one_thread(tmp_path, monkeypatch):
    """Tests that start their own ranks from the server (test_vision_parity's 4-rank SyncBatchNorm) get one thread
    too: the server set it before forking them."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    mp.start_processes(_write_threads, args=(str(tmp_path),), nprocs=2, join=True, start_method="forkserver")
    assert [(tmp_path / f"rank{r}").read_text() for r in range(2)] == ["1", "1"]
