"""The MoE block wired into the Llama model and the LM task (issue 49): model.moe builds, initialises and checks it,
the task's loss carries the auxiliary loss, the metrics the per-layer expert load, and the axes without an MoE path
are refused in one line."""

from __future__ import annotations

import pytest
import torch

from shardlab.distributed.materialize import materialize
from shardlab.distributed.units import meta_model
from shardlab.errors import ConfigError
from shardlab.runner import build_task
from shardlab_tasks.lm.models.moe import MoEBlock, auxiliary_loss
from shardlab_tasks.lm.task import next_token_loss
from tests.conftest import compose_config

SMALL_MOE = ["model=moe_tiny", "model.num_layers=2", "model.dim=64", "model.num_heads=4", "model.num_kv_heads=2",
             "model.moe.num_experts=4", "model.moe.ffn_dim=32", "data.seq_len=16"]  # fmt: skip


def built(*overrides: str, seed: int = 7):
    task = build_task(compose_config([*SMALL_MOE, *overrides]), world_size=1)
    model = meta_model(task.build_model)
    materialize(model, torch.device("cpu"), task.init_tensor, seed=seed)
    return task, model


def test_model_moe_replaces_every_mlp_and_initialises_seeded_with_scaled_residual_projections():
    _, a = built()
    _, b = built()
    _, other = built(seed=8)
    assert all(isinstance(block.mlp, MoEBlock) for block in a.blocks)
    for (name, pa), pb in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        assert torch.equal(pa, pb), name
    experts = a.blocks[0].mlp.experts
    assert not torch.equal(experts.gate_up_proj, other.blocks[0].mlp.experts.gate_up_proj)
    assert experts.gate_up_proj.shape == (4, 2 * 32, 64) and experts.down_proj.shape == (4, 64, 32)
    std, residual = experts.gate_up_proj.std().item(), experts.down_proj.std().item()
    assert abs(std - 0.02) < 0.002 and abs(residual - 0.02 / 2) < 0.002  # scaled by 1/sqrt(2 * layers)
    assert abs(a.blocks[1].mlp.router.weight.std().item() - 0.02) < 0.004


def test_the_task_loss_adds_the_auxiliary_loss_and_reports_each_layers_load():
    task, model = built()
    batch = torch.randint(0, 256, (3, 17), generator=torch.Generator().manual_seed(0))
    loss, sums = task.loss(model, batch, torch.device("cpu"))
    logits = model(batch[:, :-1])
    stats = model.take_routing_stats()
    assert len(stats) == 2 and model.take_routing_stats() == []  # let go of after one take
    aux = auxiliary_loss(stats, task.cfg.model.moe).detach()
    assert aux > 0
    torch.testing.assert_close(loss, next_token_loss(logits, batch[:, 1:]) + aux)
    loss.backward()  # the router learns through the auxiliary loss too
    assert model.blocks[0].mlp.router.weight.grad.abs().sum() > 0
    totals = {k: float(v) for k, v in sums.items()}
    assert sum(totals[f"moe_load/0/{e}"] for e in range(4)) == 3 * 16 * 2  # every token's two choices
    metrics = task.summarize(dict(totals))
    loads = torch.tensor([totals[f"moe_load/1/{e}"] for e in range(4)])
    assert metrics["moe_load/1"] == pytest.approx(float(loads.max() / loads.mean()))
    assert metrics["aux_loss"] == pytest.approx(aux.item()) and "moe_load/0/0" not in metrics
    assert metrics["loss"] == pytest.approx(totals["loss_sum"] / totals["count"])


def test_a_dense_llama_reports_no_routing_metrics():
    task = build_task(compose_config(["model=llama_tiny", "model.num_layers=1", "model.dim=64", "model.num_heads=4",
                                     "model.num_kv_heads=2", "data.seq_len=16"]), world_size=1)  # fmt: skip
    model = meta_model(task.build_model)
    materialize(model, torch.device("cpu"), task.init_tensor, seed=0)
    _, sums = task.loss(model, torch.zeros(1, 17, dtype=torch.long), torch.device("cpu"))
    assert set(task.summarize({k: float(v) for k, v in sums.items()})) == {"loss", "ppl"}


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["model.moe.top_k=5"], "model.moe.top_k (5) must be <= model.moe.num_experts (4)"),
        (["model.moe.score_func=relu"], "model.moe.score_func must be one of softmax, sigmoid, got 'relu'"),
        (["distributed=fully_sharded", "distributed.world_size=2", "distributed.tensor_parallel_degree=2",
          "model.num_kv_heads=1"], "distributed.tensor_parallel_degree (2) must divide model.num_kv_heads (1)"),
        (["distributed=fully_sharded", "distributed.world_size=2", "distributed.pipeline_parallel_degree=2"],
         "model.moe: the pipeline stages do not carry the MoE blocks' auxiliary loss"),
    ],
)  # fmt: skip
def test_bad_moe_configs_and_axes_without_an_moe_path_are_refused_before_launch(overrides, expected):
    with pytest.raises(ConfigError) as error:
        world_size = 2 if "distributed.world_size=2" in overrides else 1
        build_task(compose_config([*SMALL_MOE, *overrides]), world_size=world_size)
    assert expected in str(error.value)
