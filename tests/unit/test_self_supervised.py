"""task=swav and task=simclr in one process: config checks, multi-crop views seeded per sample, the Sinkhorn and NT-Xent
maths, the trunk a checkpoint holds, the feature queue and frozen prototypes at work, and an exact resume with
workers. Distributed behaviour: tests/distributed/test_ssl_parity.py."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from shardlab.data import SeededSamples
from shardlab.distributed import env as dist_env
from shardlab.errors import ConfigError
from shardlab.runner import build_task, run_rank
from tests.ssl_configs import STEPS, simclr, swav


def losses(result: dict) -> torch.Tensor:
    return torch.tensor([r["loss"] for r in result["history"] if r["split"] == "train"], dtype=torch.float64)


def test_config_mistakes_are_named_together():
    cfg = swav(
        "task.queue_length=20",
        "task.crops_for_assign=[0,7]",
        "data.local_crop_scale=[0.5,0.2]",
        "data.blur_prob=1.5",
        "model.num_classes=10",
        "task.warmup_temperature=0",
    )
    with pytest.raises(ConfigError) as error:
        build_task(cfg)
    message = str(error.value)
    for key in (
        *("task.queue_length (20)", "task.crops_for_assign", "data.local_crop_scale", "data.blur_prob"),
        "task.warmup_temperature must be > 0",
    ):
        assert key in message, message
    assert "model.num_classes (10): task swav has no classifier" in message
    with pytest.raises(ConfigError, match=r"task=simclr contrasts two views: .*got 2 and 2"):
        build_task(simclr("data.num_local_crops=2"))


def test_views_have_the_configured_sizes_and_are_drawn_from_the_sample_offset():
    task = build_task(swav())
    task.prepare_data()
    samples = SeededSamples(task.train_dataset, seed=5)
    crops, label, skipped = samples[(40, 3)]
    assert [tuple(c.shape) for c in crops] == [(3, 16, 16)] * 2 + [(3, 8, 8)] * 2
    again, _, _ = samples[(40, 3)]
    assert all(torch.equal(a, b) for a, b in zip(crops, again, strict=True))  # same offset, same draws
    other, _, _ = samples[(41, 3)]  # the same image at another offset: other crops
    assert not torch.equal(crops[0], other[0])
    assert not torch.equal(crops[0], crops[1])  # two views of one image differ


def test_sinkhorn_codes_split_the_rows_equally_over_the_prototypes():
    from shardlab_tasks.self_supervised.swav import sinkhorn

    g = torch.Generator().manual_seed(0)  # seeded: how close 50 iterations come depends on the scores
    scores = (
        F.normalize(torch.randn(12, 8, generator=g), dim=1) @ F.normalize(torch.randn(4, 8, generator=g), dim=1).t()
    )
    codes = sinkhorn(scores, epsilon=0.05, iterations=50)
    torch.testing.assert_close(codes.sum(1), torch.ones(12))  # each row a distribution over prototypes
    torch.testing.assert_close(codes.sum(0), torch.full((4,), 3.0), rtol=1e-3, atol=1e-3)  # 12 rows / 4 prototypes


def test_hard_codes_are_each_rows_largest_sinkhorn_code():
    """With ``hard``, each crop predicts the other crop's argmax prototype: the cross-entropy to a one-hot target."""
    from shardlab_tasks.self_supervised.swav import sinkhorn, swav_loss

    g = torch.Generator().manual_seed(0)
    n, k, temperature = 6, 5, 0.1
    scores = F.normalize(torch.randn(2 * n, 8, generator=g), dim=1) @ F.normalize(torch.randn(k, 8, generator=g), 1).t()
    log_probs = F.log_softmax(scores / temperature, dim=1)
    expected = 0
    for crop, other in ((0, 1), (1, 0)):
        targets = sinkhorn(scores[crop * n : (crop + 1) * n], 0.05, 3).argmax(dim=1)
        expected = expected + F.nll_loss(log_probs[other * n : (other + 1) * n], targets) / 2
    hard = swav_loss(scores, n, [0, 1], temperature, 0.05, 3, [None, None], hard=True)
    torch.testing.assert_close(hard, expected)
    assert not torch.isclose(swav_loss(scores, n, [0, 1], temperature, 0.05, 3, [None, None]), hard)


def test_nt_xent_is_the_cross_entropy_of_each_view_against_all_other_views():
    from shardlab_tasks.self_supervised.simclr import nt_xent

    n, temperature = 5, 0.3
    z = F.normalize(torch.randn(2 * n, 7), dim=1)
    expected = []
    for i in range(2 * n):
        positive = (i + n) % (2 * n)
        similarities = z @ z[i] / temperature
        others = [j for j in range(2 * n) if j != i]
        expected.append(-(similarities[positive] - torch.logsumexp(similarities[others], 0)))
    torch.testing.assert_close(nt_xent(z, n, temperature), torch.stack(expected).mean())


def test_checkpoint_trunk_is_the_supervised_regnet_without_its_classifier():
    """``trunk.<name>`` of a self-supervised model is ``<name>`` of the image-classification RegNet: loaded there (all
    but fc), the supervised model's pooled features are Task.features'."""
    from shardlab.registry import MODELS
    from shardlab_tasks.self_supervised.model import TRUNK_PREFIX

    task = build_task(swav())
    model = task.build_model()
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        task.init_tensor(name, tensor.data, torch.Generator().manual_seed(len(name)))
    trunk = {k.removeprefix(TRUNK_PREFIX): v for k, v in model.state_dict().items() if k.startswith(TRUNK_PREFIX)}
    supervised = MODELS.build("regnet_cifar", task.cfg.model, 10)
    result = supervised.load_state_dict(trunk, strict=False)
    assert sorted(result.missing_keys) == ["fc.bias", "fc.weight"] and not result.unexpected_keys
    supervised.fc = torch.nn.Identity()
    images = torch.randn(4, 3, 16, 16)
    features = task.features(model, images)
    assert features.shape == (4, model.projection[0].in_features)
    torch.testing.assert_close(features, supervised.eval()(images))


def test_a_last_batchnorm_standardizes_the_embedding_over_the_batch():
    """task.projection_last_bn=true (SimCLR v2's and lightly's head): the embedding layer has no bias and a BatchNorm of
    its own, so in training each embedding dimension has mean beta (0 at init) and variance gamma^2 (1) over the batch;
    the default head ends in a plain biased linear layer."""
    default, last_bn = (build_task(simclr(*o)).build_model() for o in ((), ("task.projection_last_bn=true",)))
    assert isinstance(default.projection[-1], torch.nn.Linear) and default.projection[-1].bias is not None
    assert isinstance(last_bn.projection[-1], torch.nn.BatchNorm1d) and last_bn.projection[-2].bias is None
    z = last_bn.projection(torch.randn(32, last_bn.projection[0].in_features) * 3 + 1)
    torch.testing.assert_close(z.mean(0), torch.zeros(z.shape[1]), atol=1e-5, rtol=0)
    torch.testing.assert_close(z.var(0, unbiased=False), torch.ones(z.shape[1]), atol=1e-3, rtol=0)


def test_a_checkpoint_from_before_the_last_batchnorm_key_builds_the_head_it_was_trained_with():
    """A checkpoint's config is read as it was saved (shardlab-evaluate, resumes): one written before
    task.projection_last_bn existed lacks it, and is the default head, not an error."""
    from omegaconf import OmegaConf

    from shardlab_tasks.self_supervised import model as ssl_model

    cfg = simclr()
    task = OmegaConf.masked_copy(cfg.task, [k for k in cfg.task if k != "projection_last_bn"])
    OmegaConf.set_struct(task, True)
    head = ssl_model.build(cfg.model, task).projection
    assert isinstance(head[-1], torch.nn.Linear) and head[-1].bias is not None


def test_the_temperature_warms_up_linearly_and_the_first_step_trains_at_its_start(tmp_path):
    """task.warmup_temperature=0.5 over 4 steps to task.temperature=0.1: 0.5, 0.4, 0.3, 0.2, then 0.1. The first
    step's loss is a run's at 0.5 without warm-up (same seed, same views); the second is not."""
    warm = ("task.temperature=0.1", "task.warmup_temperature=0.5", "task.warmup_temperature_steps=4")
    task = build_task(swav(*warm))
    assert [task.temperature(step) for step in range(6)] == pytest.approx([0.5, 0.4, 0.3, 0.2, 0.1, 0.1])
    assert task.temperature(None) == 0.1
    first = [losses(run_rank(swav(*o), tmp_path / str(i), dist_env.detect()))[:2] for i, o in enumerate(
        (warm, ("task.temperature=0.5",)))]  # fmt: skip
    assert first[0][0] == first[1][0] and first[0][1] != first[1][1]


def prototype_norms(trainer) -> dict:
    return {"norms": trainer.model.prototypes.weight.detach().norm(dim=1)}


@pytest.fixture(scope="module")
def swav_runs(tmp_path_factory):
    def run(name, *overrides):
        return run_rank(swav(*overrides), tmp_path_factory.mktemp(name), dist_env.detect(), after_fit=prototype_norms)

    return {
        "queue": run("queue"),
        "no_queue": run("no_queue", "task.queue_length=0"),
        "frozen_throughout": run("frozen", "optimization.max_steps=3"),
    }


def test_queue_joins_the_assignment_once_full(swav_runs):
    """Filled from step 1 (0-based), full after two batches: the first three losses are those of a run without one."""
    queue, none = losses(swav_runs["queue"]), losses(swav_runs["no_queue"])
    assert torch.equal(queue[:3], none[:3])
    assert not torch.isclose(queue[3], none[3], rtol=1e-4)


def test_frozen_prototypes_are_left_at_their_normalized_values(swav_runs):
    """Prototypes are normalized before every training forward; frozen, nothing moves them afterwards."""
    torch.testing.assert_close(swav_runs["frozen_throughout"]["norms"], torch.ones(24))
    assert not torch.allclose(swav_runs["queue"]["norms"], torch.ones(24), atol=1e-4)  # updated from step 4 on


def test_collapse_diagnostics_tell_uniform_codes_from_hard_ones_and_are_logged(swav_runs):
    """ln K for uniform codes and flat predictions (SwAV's collapse), 0 for one-hot ones; every logged step has them."""
    from shardlab_tasks.self_supervised.swav import collapse_stats

    k = 8
    flat = collapse_stats(torch.full((4, k), 1 / k), torch.zeros(4, k), torch.full((4, k), -math.log(k)))
    torch.testing.assert_close(flat["code_entropy"], torch.tensor(math.log(k)))
    torch.testing.assert_close(flat["pred_entropy"], torch.tensor(math.log(k)))
    assert flat["score_spread"] == 0
    hard = collapse_stats(torch.eye(k)[:4], torch.eye(k)[:4], F.log_softmax(50 * torch.eye(k)[:4], dim=1))
    assert hard["code_entropy"] == 0 and hard["pred_entropy"] < 1e-6 and hard["score_spread"] > 0.3
    rows = [r for r in swav_runs["no_queue"]["history"] if r["split"] == "train"]
    assert rows and all(0 < r["code_entropy"] <= math.log(24) + 1e-4 and r["score_spread"] > 0 for r in rows)


@pytest.mark.parametrize(
    "optimizer, ac",
    [("lars", False), ("adamw", False), ("sgd", False), ("adamw", True)],
    ids=["lars", "adamw", "sgd", "adamw-activation-checkpointing"],
)
def test_resume_while_prototypes_are_frozen_and_the_queue_fills_repeats_the_losses_exactly(tmp_path, optimizer, ac):
    """Multi-crop augmentation drawn in 2 DataLoader workers; saved after step 2 (prototypes frozen for one more
    step, the queue half full). torch's optimizers hold no state for the frozen prototypes then (LARS holds one);
    activation checkpointing's wrappers change the module paths the optimizer state is found by."""
    lr = {"lars": 2.0, "adamw": 0.01, "sgd": 0.1}[optimizer]
    overrides = [f"optimizer={optimizer}", f"optimizer.lr={lr}", "data.num_workers=2", "checkpoint.interval_steps=2"]
    overrides += ["checkpoint.keep_last=3", *(["distributed.activation_checkpointing=full"] if ac else [])]
    whole = run_rank(swav(*overrides), tmp_path / "whole", dist_env.detect())
    resume = f"checkpoint.resume={tmp_path / 'whole' / 'checkpoints' / 'step_00000002'}"
    resumed = run_rank(swav(*overrides, resume), tmp_path / "resumed", dist_env.detect())
    assert [r["step"] for r in resumed["history"] if r["split"] == "train"] == list(range(3, STEPS + 1))
    assert torch.equal(losses(resumed), losses(whole)[2:])
