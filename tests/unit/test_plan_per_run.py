"""A run enters the memory plan once: its model is profiled on meta one time, however many parts of the run ask for
the plan (backend=auto's budget and each of its trials, the run's own assembly), and what each is handed is what a
fresh plan of its config gives."""

from __future__ import annotations

import dataclasses
import json

import pytest

from shardlab.distributed import env as dist_env
from shardlab.distributed.units import model_on_meta
from shardlab.memory import plan
from shardlab.runner import rank_task, run_rank


@pytest.fixture
def meta_profiles(monkeypatch) -> list[int]:
    """The micro-batch of every profile of a model on meta made from now on (plan.profile_model, the meta forward;
    the autocast profile that a low-precision config adds beside it is left out)."""
    made: list[int] = []
    real = plan.profile_model

    def counted(model, units, task, local_batch, dtype, autocast_device=None):
        if autocast_device is None:
            made.append(local_batch)
        return real(model, units, task, local_batch, dtype, autocast_device)

    monkeypatch.setattr(plan, "profile_model", counted)
    return made


def planned_as_new(cfg):
    """The estimate a fresh plan (outside any run) gives ``cfg`` at world size 1."""
    task = rank_task(cfg)
    return plan.plan_run(cfg, task, 1, model_on_meta(task)).estimate


def estimate_of(trainer) -> dict:
    return {"estimate": trainer.memory_estimate}


def test_a_run_started_by_run_rank_profiles_its_model_once(tiny_lm, tmp_path, meta_profiles):
    cfg = tiny_lm("optimization.max_steps=1", "validation.num_batches=1")
    result = run_rank(cfg, tmp_path, dist_env.detect(), after_fit=estimate_of)
    assert meta_profiles == [8], meta_profiles
    assert result["estimate"] == planned_as_new(cfg)


def test_a_run_started_by_run_rank_enters_profile_config_once(tiny_lm, tmp_path, monkeypatch):
    """Every module that asks for a profile (the plan's entry, the budget, autotune, the plan's verification) is
    counted: a run with an explicit backend walks through the plan in one pass."""
    from shardlab.memory import budget, verify
    from shardlab.runner import autotune

    entered: list[str] = []
    real = plan.profile_config

    def counted(cfg, task, world_size, model, units=None):
        entered.append(cfg.distributed.backend)
        return real(cfg, task, world_size, model, units)

    for module in (plan, budget, autotune, verify):
        monkeypatch.setattr(module, "profile_config", counted)
    cfg = tiny_lm("optimization.max_steps=1", "validation.num_batches=1")
    run_rank(cfg, tmp_path, dist_env.detect())
    assert entered == [cfg.distributed.backend], entered


def test_backend_auto_its_trial_and_the_run_share_one_profile(tiny_lm, tmp_path, meta_profiles):
    """The budget's fit, the one trial's assembly and the run's assembly: three asks, one profile."""
    cfg = tiny_lm(
        "distributed.backend=auto",
        "distributed.memory_budget_gb=4",
        "distributed.auto_tune_steps=2",
        "distributed.auto_tune_max_trials=1",
        "distributed.auto_tune_cache=null",  # measured here, not taken from an earlier run's decision
        "optimization.max_steps=1",
        "validation.num_batches=1",
    )
    result = run_rank(cfg, tmp_path, dist_env.detect(), after_fit=estimate_of)
    assert cfg.distributed.backend != "auto"
    assert "autotune" in json.loads((tmp_path / "status.json").read_text())  # measured, and recorded by the runner
    assert meta_profiles == [8], meta_profiles
    assert result["estimate"] == planned_as_new(cfg)


def test_inside_a_run_a_profile_is_made_once_per_micro_batch_and_matches_a_fresh_one(tiny_lm, meta_profiles):
    cfg, half = tiny_lm(), tiny_lm("optimization.batch_size=4")
    task = rank_task(cfg)
    with plan.one_profile_per_run():
        first, _ = plan.profile_config(cfg, task, 1, model_on_meta(task))
        again, _ = plan.profile_config(cfg, task, 1, model_on_meta(task))  # a new model of the same shape
        smaller, _ = plan.profile_config(half, task, 1, model_on_meta(task))
        with plan.one_profile_per_run():  # nested: the outer run's profiles
            inner, _ = plan.profile_config(cfg, task, 1, model_on_meta(task))
    assert meta_profiles == [8, 4]
    assert again is first and inner is first
    assert smaller.activations < first.activations
    fresh, _ = plan.profile_config(half, task, 1, model_on_meta(task))  # outside a run: profiled anew
    assert meta_profiles == [8, 4, 4]
    assert dataclasses.asdict(smaller) == dataclasses.asdict(fresh)
