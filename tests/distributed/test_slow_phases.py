"""What is slow by nature runs outside distributed.timeout_s: a rank that materializes, writes, reads or prunes a
checkpoint for longer than the collective timeout does not time the others out (distributed.init_timeout_s and
checkpoint.timeout_s cover those phases), and the run resumes exactly."""

from __future__ import annotations

import os
import time
from pathlib import Path

from tests.distributed.harness import run_spawned

TIMEOUT_S = 2
STALL_S = 4  # twice the collective timeout: each phase below would fail a run without its own timeout


def stall_once(name: str, rank: int) -> bool:
    """Whether this rank stalls now: the first time ``name`` runs on ``rank``."""
    import torch.distributed as dist

    if dist.get_rank() != rank or name in STALLED:
        return False
    STALLED.add(name)
    (Path(os.environ["STALLS_SEEN"]) / name).touch()  # the test checks that every phase did stall
    return True


STALLED: set[str] = set()


def slow_phases() -> None:
    """Each rank, before the configs: rank 1 writes its first checkpoint slowly and reads the resumed one slowly, and
    materializes the resumed run's model slowly; rank 0 prunes slowly (removing an old checkpoint on a busy NFS)."""
    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    from shardlab import trainer as trainer_module
    from shardlab.checkpoint import manager
    from shardlab.checkpoint.readers.dcp_reader import SafeReader  # a resume reads through shardlab's reader, not DCP's

    def slowed(name: str, rank: int, fn, when=lambda: True):
        def run(*args, **kwargs):
            if when() and stall_once(name, rank):
                time.sleep(STALL_S)
            return fn(*args, **kwargs)

        return run

    FileSystemWriter.write_data = slowed("write", 1, FileSystemWriter.write_data)
    SafeReader.read_data = slowed("read", 1, SafeReader.read_data)
    manager.remove = slowed("prune", 0, manager.remove)
    calls = {"n": 0}

    def second_run() -> bool:
        calls["n"] += 1
        return calls["n"] > 1

    trainer_module.materialize = slowed("materialize", 1, trainer_module.materialize, second_run)


def train_losses(result: dict) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in result["history"] if r["split"] == "train"}


def test_slow_checkpoint_io_and_start_up_on_one_rank_do_not_time_out_the_others(tiny_lm, tmp_path, monkeypatch):
    monkeypatch.setenv("STALLS_SEEN", str(tmp_path))
    common = [
        "distributed.backend=fully_sharded",
        f"distributed.timeout_s={TIMEOUT_S}",
        "validation.interval_steps=0",
        "checkpoint.interval_steps=2",
        "checkpoint.keep_last=1",  # step 4's save prunes step 2
        "lr_scheduler=constant",  # the same schedule whatever max_steps: the reference runs 6 steps at once
    ]
    first = tiny_lm(*common, "optimization.max_steps=4")
    resumed = tiny_lm(*common, "optimization.max_steps=6")
    reference = tiny_lm(*common, "optimization.max_steps=6")
    results = run_spawned(
        [first, resumed, reference], 2, run_dirs=[tmp_path / "run", tmp_path / "run", tmp_path / "ref"],
        prepare=slow_phases,
    )  # fmt: skip
    assert sorted(train_losses(results[0])) == [1, 2, 3, 4]
    assert sorted(train_losses(results[1])) == [5, 6], "resumed from step 4"
    expected = train_losses(results[2])
    assert {s: train_losses(results[1])[s] for s in (5, 6)} == {s: expected[s] for s in (5, 6)}
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == ["step_00000006"]
    assert {p.name for p in tmp_path.iterdir() if p.is_file()} == {"write", "read", "prune", "materialize"}
