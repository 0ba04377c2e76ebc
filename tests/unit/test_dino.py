"""task=dino: the loss and the center against a hand computation, the teacher temperature's warm-up, the refusals,
and an exact resume of the teacher and the center in one process."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from shardlab.cli.preflight import preflight
from shardlab.distributed import env as dist_env
from shardlab.errors import ConfigError
from shardlab.runner import run_rank
from shardlab_commands import evaluate
from shardlab_tasks.self_supervised.dino import Center, WeightNormLinear, collapse_stats, dino_loss, teacher_temperature
from tests.ssl_configs import STEPS, dino


def softmax(row: list[float], temperature: float) -> list[float]:
    exps = [math.exp(x / temperature) for x in row]
    return [e / sum(exps) for e in exps]


def test_loss_is_the_mean_cross_entropy_over_images_and_crop_pairs_by_hand():
    n, crops, num_global, k = 2, 3, 2, 4
    student = torch.randn(crops * n, k)
    teacher = torch.randn(num_global * n, k)
    center = torch.randn(1, k)
    ts, tt = 0.1, 0.04
    pairs = []
    for i in range(num_global):  # the teacher's crop i against every other crop of the student
        for v in range(crops):
            if v == i:
                continue
            per_image = []
            for b in range(n):
                q = softmax([float(x - c) for x, c in zip(teacher[i * n + b], center[0], strict=True)], tt)
                p = softmax([float(x) for x in student[v * n + b]], ts)
                per_image.append(-sum(qk * math.log(pk) for qk, pk in zip(q, p, strict=True)))
            pairs.append(sum(per_image) / n)
    expected = sum(pairs) / len(pairs)  # 2 teacher crops x 2 other crops = 4 pairs
    assert len(pairs) == 4
    assert float(dino_loss(student, teacher, center, num_global, ts, tt)) == pytest.approx(expected, rel=1e-5)


def test_center_moves_by_momentum_toward_the_batch_mean_of_the_teacher():
    center = Center(3, momentum=0.9, device=torch.device("cpu"))
    first, second = torch.randn(4, 3), torch.randn(4, 3)
    center.update(first)
    center.update(second)
    expected = 0.9 * (0.1 * first.mean(0)) + 0.1 * second.mean(0)
    torch.testing.assert_close(center.center[0], expected)


def test_teacher_temperature_warms_up_linearly_then_stays():
    t = SimpleNamespace(teacher_temperature=0.07, warmup_teacher_temperature=0.04, warmup_teacher_temperature_steps=30)
    assert teacher_temperature(t, 0) == pytest.approx(0.04)
    assert teacher_temperature(t, 15) == pytest.approx(0.055)
    assert teacher_temperature(t, 30) == teacher_temperature(t, 500) == 0.07


def test_last_layer_rows_are_normalized_so_its_scale_does_not_matter():
    layer = WeightNormLinear(4, 3)
    x = torch.randn(2, 4)
    before = layer(x)
    with torch.no_grad():
        layer.weight.mul_(torch.tensor([[2.0], [5.0], [0.5]]))
    torch.testing.assert_close(layer(x), before)


def test_collapse_stats_tell_uniform_targets_from_one_dimension_and_from_learning():
    n, k, dim = 8, 6, 4
    z = torch.nn.functional.normalize(torch.randn(n, dim), dim=1)
    same = torch.randn(1, k).expand(n, k)  # one output for every image: the center removes it, the targets are uniform
    uniform = collapse_stats(same, same[:1], 0.04, z[:1].expand(n, dim))
    assert float(uniform["teacher_entropy"]) == pytest.approx(math.log(k), rel=1e-5)
    assert float(uniform["batch_entropy"]) == pytest.approx(math.log(k), rel=1e-5)
    assert float(uniform["z_std"]) == 0
    one_dim = torch.zeros(n, k)
    one_dim[:, 2] = 1.0  # the sharpening won: every image on output 2
    dominant = collapse_stats(one_dim, torch.zeros(1, k), 0.04, z)
    assert float(dominant["teacher_entropy"]) < 0.01 and float(dominant["batch_entropy"]) < 0.01
    spread = torch.eye(k)[torch.arange(n) % k]  # sharp targets, different images on different outputs
    learning = collapse_stats(spread, torch.zeros(1, k), 0.04, z)
    assert float(learning["teacher_entropy"]) < 0.01 and float(learning["batch_entropy"]) > 0.9 * math.log(k)
    assert float(learning["z_std"]) > 0.1


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["optimization.ema.enabled=false"], "task=dino's teacher is the moving average of the weights: set"),
        (["task.center_momentum=1"], "task.center_momentum must be in [0, 1), got 1.0"),
        (["data.num_local_crops=0", "data.num_global_crops=1"], "task=dino predicts the teacher's view"),
    ],
)
def test_a_wrong_dino_setting_is_refused_in_one_line(overrides, expected):
    with pytest.raises(ConfigError) as e:
        preflight(["task=dino", *overrides])
    assert expected in str(e.value), str(e.value)


def _teacher_and_center(trainer) -> dict:
    return {
        "ema": {k: v.detach().clone() for k, v in trainer.ema.state_dict().items()},
        "center": trainer.task.center.center.clone(),
        "student_stem": trainer.model.state_dict()["trunk.stem.0.weight"].detach().clone(),
    }


def train_losses(result: dict) -> list[float]:
    return [r["loss"] for r in result["history"] if r["split"] == "train"]


def test_resume_restores_the_teacher_and_the_center_exactly(tmp_path):
    whole = run_rank(
        dino("checkpoint.interval_steps=2", "checkpoint.keep_last=3"),
        tmp_path / "whole",
        dist_env.detect(),
        _teacher_and_center,
    )
    step2 = tmp_path / "whole" / "checkpoints" / "step_00000002"
    resumed = run_rank(dino(f"checkpoint.resume={step2}"), tmp_path / "resumed", dist_env.detect(), _teacher_and_center)
    assert train_losses(resumed) == train_losses(whole)[2:] and len(train_losses(whole)) == STEPS
    assert torch.equal(resumed["center"], whole["center"]) and whole["center"].abs().sum() > 0
    for name, tensor in whole["ema"].items():
        assert torch.equal(resumed["ema"][name], tensor), name
    # shardlab-evaluate --ema probes the teacher: the checkpoint's average, not the student.
    _, teacher = evaluate.build_model(dino(), tmp_path / "whole" / "checkpoints" / "step_00000006", ema=True)
    weight = "prototypes.weight"
    assert torch.equal(teacher.state_dict()[weight], whole["ema"][weight])
    assert not torch.equal(teacher.state_dict()["trunk.stem.0.weight"], whole["student_stem"])
