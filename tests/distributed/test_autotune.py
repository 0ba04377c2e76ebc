"""distributed.backend=auto with auto_tune: the ranks measure the layouts that fit and keep the fastest; the decision
is part of the run (a resume reuses it) and cached for the next run of the same shape.

Step times on a shared 2-core machine are noise at this size, so the trials' real steps run but their clock is replaced
by a fixed speed per layout (``prepare``, in every rank): the test then knows which candidate must win. Whether the
choice is really fastest is a benchmark's question (tools/autotune_grid.py, docs/benchmarks.md).
"""

from __future__ import annotations

import json

from shardlab.memory.autotune import DECISION_FILE, _splits
from tests.distributed.harness import run_spawned

# Seconds per step the fake clock gives each layout (by its label): fully_sharded without resharding is "fastest",
# and half the micro-batch with twice the accumulation faster still.
FAKE_SECONDS = {"ddp": 3.0, "fully_sharded, no reshard": 1.0, "fully_sharded": 2.0}
CALLS = {"trials": 0}


def fake_clock() -> None:
    """Each rank: trials run their real steps, then report FAKE_SECONDS for their layout (x0.5 for micro-batch 4)."""
    from shardlab import trainer as trainer_module
    from shardlab.memory.plan import layout_of

    real = trainer_module.Trainer.time_steps

    def timed(self, num_steps):
        seconds, units = real(self, num_steps)
        CALLS["trials"] += 1
        label = layout_of(self.cfg.distributed, self.backend.env.world_size).label(self.backend.env.world_size)
        scale = 0.5 if self.cfg.optimization.batch_size == 4 else 1.0
        return [FAKE_SECONDS.get(label, 9.0) * scale] * num_steps, units

    trainer_module.Trainer.time_steps = timed


def chosen(trainer) -> dict:
    d, o = trainer.cfg.distributed, trainer.cfg.optimization
    return {
        "backend": d.backend,
        "reshard_after_forward": d.reshard_after_forward,
        "batch_size": o.batch_size,
        "update_freq": o.update_freq,
        "trials": CALLS["trials"],
    }


def test_the_split_candidates_keep_the_global_batch_and_divide_over_the_ranks():
    assert _splits(16, 2, 2) == [(32, 1), (8, 4)]
    assert _splits(16, 1, 2) == [(8, 2)]
    assert _splits(2, 1, 2) == []  # half of 2 does not split over 2 ranks
    for batch, accumulate in _splits(24, 4, 4):
        assert batch * accumulate == 96 and batch % 4 == 0


def test_auto_keeps_the_fastest_fitting_layout_reuses_it_on_resume_and_caches_it(tiny_lm, tmp_path):
    common = [
        "distributed.backend=auto",
        "distributed.memory_budget_gb=4",  # ddp, fully_sharded with and without resharding all fit
        "distributed.auto_tune_steps=2",
        "distributed.auto_tune_max_trials=4",
        f"distributed.auto_tune_cache={tmp_path / 'cache'}",
        "optimization.batch_size=8",
        "optimization.update_freq=1",
        "optimization.max_steps=2",
        "validation.num_batches=1",
    ]
    first = tiny_lm(*common)
    resumed = tiny_lm(*[c for c in common if "max_steps" not in c], "optimization.max_steps=3")
    elsewhere = tiny_lm(*common)
    runs = [tmp_path / "run", tmp_path / "run", tmp_path / "other"]
    results = run_spawned([first, resumed, elsewhere], 2, run_dirs=runs, inspect=chosen, prepare=fake_clock)

    # 3 layouts at micro-batch 8, then the fastest's split 4 x 2 (16 x 0.5 does not exist): 4 trials, the last wins.
    assert results[0]["backend"] == "fully_sharded" and results[0]["reshard_after_forward"] is False
    assert (results[0]["batch_size"], results[0]["update_freq"]) == (4, 2)
    assert results[0]["trials"] == 4
    decision = json.loads((tmp_path / "run" / DECISION_FILE).read_text())
    assert [t["layout"] for t in decision["trials"]] == ["ddp", "fully_sharded, no reshard", "fully_sharded"] + [
        "fully_sharded, no reshard"
    ]
    status = json.loads((tmp_path / "run" / "status.json").read_text())
    assert status["autotune"]["label"] == decision["label"] == "fully_sharded, no reshard, micro-batch 4 x 2"

    # The resumed run and a run elsewhere of the same shape measure nothing and make the same choice.
    for result in results[1:]:
        assert result["trials"] == 4, "no trial ran after the first decision"
        assert (result["backend"], result["reshard_after_forward"]) == ("fully_sharded", False)
        assert (result["batch_size"], result["update_freq"]) == (4, 2)
    assert [r["step"] for r in results[1]["history"] if r["split"] == "train"] == [3]
    assert list((tmp_path / "cache").glob("*.json")), "the decision is cached for the next run"
