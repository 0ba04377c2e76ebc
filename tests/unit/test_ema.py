"""optimization.ema: the average against a hand computation, its schedule, exact resume, validation and export."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from shardlab.checkpoint import weights
from shardlab.cli.preflight import preflight
from shardlab.distributed import env as dist_env
from shardlab.errors import CheckpointError, ConfigError, IncompatibleCheckpointError
from shardlab.optim.ema import WeightAverage, ema_decay
from shardlab.runner import run_rank
from shardlab_commands import export_hf

EMA = ["optimization.ema.enabled=true", "optimization.ema.decay=0.8", "optimization.ema.start_step=2"]


def ema_cfg(**changes) -> SimpleNamespace:
    return SimpleNamespace(**{"decay": 0.9, "schedule": "constant", "final_decay": 1.0, "start_step": 0, **changes})


def test_average_equals_a_hand_computation_over_steps():
    model = nn.Linear(3, 2)
    average = WeightAverage(model, ema_cfg(decay=0.9, start_step=1), max_steps=10)
    history = []
    for step in range(4):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p))  # stands in for an optimizer step
        history.append([p.detach().clone() for p in model.parameters()])
        average.update(step)
    # step 0 < start_step copies the weights; steps 1, 2, 3 average with decay 0.9.
    expected = history[0]
    for weights_after in history[1:]:
        expected = [0.9 * e + 0.1 * w for e, w in zip(expected, weights_after, strict=True)]
    for name, got in average.state_dict().items():
        torch.testing.assert_close(got, expected[0 if name == "weight" else 1], rtol=1e-6, atol=1e-7)
    assert not torch.equal(average.state_dict()["weight"], model.weight)


def test_cosine_schedule_rises_from_decay_to_final_decay_as_dino_does():
    cfg = ema_cfg(decay=0.996, schedule="cosine", final_decay=1.0, start_step=0)
    assert ema_decay(cfg, 0, 100) == pytest.approx(0.996)
    assert ema_decay(cfg, 50, 100) == pytest.approx(0.998)
    assert ema_decay(cfg, 25, 100) == pytest.approx(1 - 0.004 * (1 + math.cos(math.pi / 4)) / 2)
    assert ema_decay(cfg, 100, 100) == pytest.approx(1.0)
    assert ema_decay(ema_cfg(decay=0.99), 77, 100) == 0.99  # constant ignores the step


def test_tied_parameters_are_averaged_once_and_saved_under_each_name():
    model = nn.Sequential(nn.Embedding(5, 4), nn.Linear(4, 5, bias=False))
    model[1].weight = model[0].weight
    average = WeightAverage(model, ema_cfg(), max_steps=10)
    assert len(average.params) == 1
    state = average.state_dict()
    assert sorted(state) == ["0.weight", "1.weight"] and state["0.weight"] is state["1.weight"]


def test_swapping_the_average_in_gives_the_weights_back_exactly():
    model = nn.Linear(3, 2)
    average = WeightAverage(model, ema_cfg(decay=0.5), max_steps=10)
    trained = [p.detach().clone() for p in model.parameters()]
    with torch.no_grad():
        average.local[0].add_(1.0)
    with average.swapped_into(model):
        assert torch.equal(model.weight, average.local[0])
    assert all(torch.equal(p, t) for p, t in zip(model.parameters(), trained, strict=True))


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["optimization.ema.decay=1.5"], "optimization.ema.decay must be in [0, 1], got 1.5"),
        (
            ["optimization.ema.schedule=linear"],
            "optimization.ema.schedule must be one of constant, cosine, got 'linear'",
        ),
        (["optimization.ema.start_step=-1"], "optimization.ema.start_step must be >= 0, got -1"),
        (["validation.ema=true"], "validation.ema validates with the average of optimization.ema; set optimization"),
    ],
)
def test_a_wrong_ema_setting_is_refused_in_one_line(overrides, expected):
    with pytest.raises(ConfigError) as e:
        preflight(overrides)
    assert str(e.value).startswith(expected), str(e.value)


def _inspect(trainer) -> dict:
    return {"ema": {k: v.detach().clone() for k, v in trainer.ema.state_dict().items()}}


def _losses(result: dict, split: str = "train") -> dict[int, float]:
    return {r["step"]: r["loss"] for r in result["history"] if r["split"] == split}


@pytest.fixture(scope="module")
def lm_runs(tiny_lm, tmp_path_factory):
    """Uninterrupted 10 steps validating with the average; the same resumed from its step 5; and without EMA."""
    whole_dir = tmp_path_factory.mktemp("whole")
    whole = run_rank(
        tiny_lm(*EMA, "validation.ema=true", "checkpoint.interval_steps=5"), whole_dir, dist_env.detect(), _inspect
    )
    step5 = whole_dir / "checkpoints" / "step_00000005"
    resumed = run_rank(
        tiny_lm(*EMA, f"checkpoint.resume={step5}"), tmp_path_factory.mktemp("resumed"), dist_env.detect(), _inspect
    )
    plain = run_rank(tiny_lm(), tmp_path_factory.mktemp("plain"), dist_env.detect())
    return {"whole": whole, "whole_dir": whole_dir, "resumed": resumed, "plain": plain}


def test_resume_with_ema_continues_the_same_losses_and_average_exactly(lm_runs):
    whole, resumed = lm_runs["whole"], lm_runs["resumed"]
    assert sorted(_losses(resumed)) == list(range(6, 11))
    assert all(_losses(resumed)[s] == _losses(whole)[s] for s in range(6, 11))
    assert sorted(resumed["ema"]) == sorted(whole["ema"])
    for name, tensor in whole["ema"].items():
        assert torch.equal(resumed["ema"][name], tensor), name


def test_validation_with_ema_reports_the_average_and_leaves_training_alone(lm_runs):
    whole, plain = lm_runs["whole"], lm_runs["plain"]
    assert _losses(whole) == _losses(plain)  # swapping the average in and out gives the weights back bit for bit
    assert _losses(whole, "valid")[10] != _losses(plain, "valid")[10]


def test_export_with_ema_writes_the_average_that_validation_measured(lm_runs, tmp_path):
    transformers = pytest.importorskip("transformers")
    from shardlab_commands import generate

    checkpoint = lm_runs["whole_dir"] / "checkpoints" / "step_00000010"
    state = weights.read_full(checkpoint, ema=True)
    for name, tensor in lm_runs["whole"]["ema"].items():
        assert torch.equal(state[name], tensor), name
    out = export_hf.main([str(checkpoint), "--ema", "--out", str(tmp_path / "hf")])
    _, task, cfg = generate.load_model(checkpoint)
    task.prepare_data()
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    samples = cfg.validation.num_batches * cfg.validation.batch_size  # validation reads the split in order
    batch = torch.stack([task.valid_dataset[i] for i in range(samples)])
    with torch.no_grad():
        logits = hf(batch[:, :-1]).logits
    loss = nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
    assert float(loss) == pytest.approx(_losses(lm_runs["whole"], "valid")[10], rel=1e-5)


def test_a_checkpoint_without_an_average_is_refused_in_one_line_by_export_and_resume(tmp_path, tiny_lm):
    run_rank(tiny_lm("optimization.max_steps=1"), tmp_path / "plain", dist_env.detect())
    step1 = tmp_path / "plain" / "checkpoints" / "step_00000001"
    with pytest.raises(CheckpointError, match="holds no EMA weights .* optimization.ema.enabled=false"):
        weights.read_full(step1, ema=True)
    # Refused, not taken for a torn checkpoint (which resume=auto would set aside and go back past).
    with pytest.raises(
        IncompatibleCheckpointError, match="holds no ema.* state, which this run keeps .*checkpoint.init_from"
    ):
        run_rank(tiny_lm(*EMA, f"checkpoint.resume={step1}"), tmp_path / "ema", dist_env.detect())
    assert step1.is_dir()


def test_the_memory_plan_counts_the_average_beside_the_optimizer_state():
    from shardlab.cli.preflight import compose_config
    from shardlab.memory.estimate import PlanContext

    def state_bytes(*overrides: str) -> int:
        return PlanContext.from_config(compose_config(list(overrides)), 1, 1, "cpu").optimizer_state_bytes

    assert state_bytes("optimization.ema.enabled=true") == state_bytes() + 4  # fp32 per local parameter element
    assert state_bytes("task=dino") == state_bytes("task=dino", "optimization.ema.enabled=false") + 4


def test_a_run_begun_from_init_from_weights_starts_its_average_there(lm_runs, tiny_lm, tmp_path):
    """decay=1 never moves the average: after training it still holds exactly the weights the run began from."""
    source = lm_runs["whole_dir"] / "checkpoints" / "step_00000010"
    frozen = ["optimization.ema.enabled=true", "optimization.ema.decay=1.0", "optimization.max_steps=2"]
    result = run_rank(tiny_lm(*frozen, f"checkpoint.init_from={source}"), tmp_path, dist_env.detect(), _inspect)
    loaded = weights.read_full(source)
    for name, tensor in result["ema"].items():
        assert torch.equal(tensor, loaded[name]), name
