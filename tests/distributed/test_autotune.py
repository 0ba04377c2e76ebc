"""distributed.backend=auto with auto_tune: the ranks measure the layouts that fit and keep the fastest; the decision
is part of the run (a resume reuses it) and cached for the next run of the same shape.

Step times on a shared 2-core machine are noise at this size, so the trials' real steps run but their clock is replaced
by a fixed speed per layout (``prepare``, in every rank): the test then knows which candidate must win. Whether the
choice is really fastest is a benchmark's question (shardlab_bench/autotune_grid.py, docs/benchmarks.md).
"""

from __future__ import annotations

import json

from shardlab.runner.autotune import DECISION_FILE, _splits
from tests.distributed.harness import run_spawned

# Seconds per step the fake clock gives each layout (by its label): fully_sharded without resharding is "fastest",
# and half the micro-batch with twice the accumulation faster still.
FAKE_SECONDS = {"ddp": 3.0, "fully_sharded, no reshard": 1.0, "fully_sharded": 2.0}
CALLS = {"trials": 0}


def fake_clock() -> None:
    """Each rank: trials run their real steps, then report FAKE_SECONDS for their layout (x0.5 for micro-batch 4;
    for micro-batch 8 instead under auto_tune_steps=3, a machine on which the other split has become faster)."""
    from shardlab.memory.layout import layout_of
    from shardlab.runner import autotune

    real = autotune.time_steps

    def timed(self, num_steps):  # self: the trial's trainer
        seconds, units = real(self, num_steps)
        CALLS["trials"] += 1
        label = layout_of(self.cfg.distributed, self.backend.env.world_size).label(self.backend.env.world_size)
        faster_batch = 8 if self.cfg.distributed.auto_tune_steps == 3 else 4
        scale = 0.5 if self.cfg.optimization.batch_size == faster_batch else 1.0
        return [FAKE_SECONDS.get(label, 9.0) * scale] * num_steps, units

    autotune.time_steps = timed


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
        "distributed.auto_tune_max_trials=5",  # the 4 layouts that fit (TP 2 among them), then the split
        f"distributed.auto_tune_cache={tmp_path / 'cache'}",
        "optimization.batch_size=8",
        "optimization.update_freq=1",
        "optimization.max_steps=2",
        "validation.num_batches=1",
    ]
    first = tiny_lm(*common)
    resumed = tiny_lm(*[c for c in common if "max_steps" not in c], "optimization.max_steps=3")
    elsewhere = tiny_lm(*common)
    # The run elsewhere resumed without the cache (deleted, another node's home): the decision it took from the cache
    # is its own, so it measures nothing.
    empty = f"distributed.auto_tune_cache={tmp_path / 'empty'}"
    no_cache = [c if "auto_tune_cache" not in c else empty for c in common]
    elsewhere_again = tiny_lm(*[c for c in no_cache if "max_steps" not in c], "optimization.max_steps=3")
    # That run resumed again where its decision's key differs (auto_tune_steps stands in for another GPU model or
    # ranks per node) and the other split has become faster: only the layout is measured again, at the run's own
    # split 4 x 2 (its checkpoint holds it), so the run continues instead of being refused as another experiment.
    rekeyed = [c for c in common if "max_steps" not in c and "auto_tune_steps" not in c]
    changed = tiny_lm(*rekeyed, "distributed.auto_tune_steps=3", "optimization.max_steps=4")
    runs = [tmp_path / "run", tmp_path / "run", tmp_path / "other", tmp_path / "other", tmp_path / "other"]
    configs = [first, resumed, elsewhere, elsewhere_again, changed]
    results = run_spawned(configs, 2, run_dirs=runs, inspect=chosen, prepare=fake_clock)

    # 4 layouts at micro-batch 8 (the LM task splits by tensor too), then the fastest's split 4 x 2 (16 x 0.5 does not
    # exist): 5 trials, the last wins.
    assert results[0]["backend"] == "fully_sharded" and results[0]["reshard_after_forward"] is False
    assert (results[0]["batch_size"], results[0]["update_freq"]) == (4, 2)
    assert results[0]["trials"] == 5
    decision = json.loads((tmp_path / "run" / DECISION_FILE).read_text())
    assert [t["layout"] for t in decision["trials"]] == ["ddp", "fully_sharded, no reshard", "fully_sharded"] + [
        "FSDP 1 x TP 2",
        "fully_sharded, no reshard",
    ]
    status = json.loads((tmp_path / "run" / "status.json").read_text())
    assert status["autotune"]["label"] == decision["label"] == "fully_sharded, no reshard, micro-batch 4 x 2"

    # The resumed run and a run elsewhere of the same shape measure nothing and make the same choice; so does the run
    # elsewhere resumed without the cache, from its own copy of the decision.
    for result in results[1:4]:
        assert result["trials"] == 5, "no trial ran after the first decision"
        assert (result["backend"], result["reshard_after_forward"]) == ("fully_sharded", False)
        assert (result["batch_size"], result["update_freq"]) == (4, 2)
    assert [r["step"] for r in results[1]["history"] if r["split"] == "train"] == [3]
    assert [r["step"] for r in results[3]["history"] if r["split"] == "train"] == [3]
    cached = list((tmp_path / "cache").glob("*.json"))
    assert len(cached) == 1, "the decision is cached for the next run"

    # The re-keyed resume: 4 layouts measured at 4 x 2 (no split explored), the run continued to step 4.
    assert results[4]["trials"] == 5 + 4
    assert (results[4]["batch_size"], results[4]["update_freq"]) == (4, 2)
    assert [r["step"] for r in results[4]["history"] if r["split"] == "train"] == [4]
    rekeyed_decision = json.loads((tmp_path / "other" / DECISION_FILE).read_text())
    assert [t["micro_batch"] for t in rekeyed_decision["trials"]] == [4, 4, 4, 4]
    assert rekeyed_decision["label"] == decision["label"]
    assert list((tmp_path / "cache").glob("*.json")) == cached, "a held split is not cached for other runs"


def model_axes(trainer) -> dict:
    d = trainer.cfg.distributed
    return {"tp": d.tensor_parallel_degree, "pp": d.pipeline_parallel_degree, "backend": d.backend}


def plan_needs(cfg) -> tuple[float, float]:
    """The plan's need (bytes per rank) of the lightest data-parallel layout and of the lightest TP/PP layout at 2
    ranks: the budget between them is one only a model axis meets."""
    from shardlab.distributed.units import model_on_meta
    from shardlab.memory import budget
    from shardlab.memory.estimate import estimate
    from shardlab.memory.plan import profile_config
    from shardlab.runner import build_task

    task = build_task(cfg, world_size=2)
    model = model_on_meta(task)
    profile, ctx = profile_config(cfg, task, 2, model)
    axes = budget.task_axes(cfg, task, 2, model, ctx.ranks_per_node)
    needs: dict[bool, list[float]] = {False: [], True: []}
    for layout in budget.candidates(ctx, False, axes):
        at = axes.profile_at(layout) if layout.multi_axis else profile
        needs[layout.multi_axis].append(budget.needed(estimate(at, layout, ctx)))
    return min(needs[False]), min(needs[True])


def test_auto_with_a_budget_only_tensor_parallelism_meets_measures_that_layout_and_trains_on_it(tiny_lm, tmp_path):
    """Wide layers: a gathered layer is what a rank must hold, and TP 2 halves it. The budget (from the plan, between
    the data-parallel layouts' need and TP 2's) leaves only TP layouts; the trial runs real TP steps through the one
    assemble() and the run trains on the layout it measured."""
    wide = ["model.dim=256", "model.num_layers=2", "distributed.backend=auto", "distributed.auto_tune_steps=2",
            "distributed.auto_tune_max_trials=2", "optimization.max_steps=2", "validation.num_batches=1",
            f"distributed.auto_tune_cache={tmp_path / 'cache'}"]  # fmt: skip
    data_only, model_axis = plan_needs(tiny_lm(*wide, "distributed.memory_budget_gb=1000"))  # any budget, to plan
    assert model_axis < data_only
    cfg = tiny_lm(*wide, f"distributed.memory_budget_gb={(model_axis + data_only) / 2 / 2**30}")
    (result,) = run_spawned([cfg], 2, run_dirs=[tmp_path / "run"], inspect=model_axes)
    assert (result["backend"], result["tp"], result["pp"]) == ("fully_sharded", 2, 1)
    decision = json.loads((tmp_path / "run" / DECISION_FILE).read_text())
    trials = decision["trials"]
    assert all("TP 2" in t["layout"] for t in trials), "only TP layouts fit the budget"
    # the TP layout at the configured 8 x 1, then its other split 4 x 2 (the split search knows the model axes too)
    assert [(t["micro_batch"], t["update_freq"]) for t in trials] == [(8, 1), (4, 2)]
    assert all(t["step_s"] is not None and t["error"] is None for t in trials), trials
    assert decision["choice"]["distributed.tensor_parallel_degree"] == 2
    assert [r["step"] for r in result["history"] if r["split"] == "train"] == [1, 2]
