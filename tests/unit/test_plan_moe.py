"""shardlab_bench/plan_moe.py: MoE models planned from their published config.json alone (tests/data), the table in
docs/models.md holding what the plan gives now, and the parameter counts the configs' fields give."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch.distributed.tensor import Shard

from shardlab_bench import plan_moe

REPO = Path(__file__).resolve().parents[2]

JSON = REPO / "docs" / "bench" / "plan_moe.json"
STALE = "the plan changed since docs/bench/plan_moe.json was written: run python -m shardlab_bench plan_moe"


def qwen3_30b_a3b_params(hf: dict) -> tuple[int, int]:
    """(total, active per token) parameters of a Qwen3-MoE config.json, counted from its fields: embedding and
    untied head, per layer attention (q, k, v, o; q/k norms), two norms, the router and the routed experts."""
    dim, layers, heads, kv, head = (hf[k] for k in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                                                    "num_key_value_heads", "head_dim"))  # fmt: skip
    experts, top_k, ffn = hf["num_experts"], hf["num_experts_per_tok"], hf["moe_intermediate_size"]
    attention = dim * head * (2 * heads + 2 * kv) + 2 * head
    dense = layers * (attention + 2 * dim + experts * dim) + 2 * hf["vocab_size"] * dim + dim
    return dense + layers * experts * 3 * ffn * dim, dense + layers * top_k * 3 * ffn * dim


def test_qwen3_30b_a3b_from_its_config_json_alone_holds_todays_plan_and_its_published_size():
    hf = json.loads((REPO / "tests/data/qwen3_30b_a3b/config.json").read_text())
    total, active = qwen3_30b_a3b_params(hf)
    assert round(total / 1e9, 1) == 30.5 and 3.3e9 < active < 3.4e9  # the model card: 30.5B total, 3.3B activated
    rows = json.loads(JSON.read_text())["plans"]
    row = next(r for r in rows if r["model"] == "Qwen3-30B-A3B" and r["ep"] == 8)
    now = plan_moe.plan(row["overrides"], 8)
    assert now == row["plan"], STALE
    assert now["total_params"] == total and now["active_params"] == active
    assert now["experts_per_rank"] == 16 and now["device_bytes"] < now["capacity_bytes"]
    assert [(r["model"], r["ep"], r["overrides"]) for r in rows] == [
        (m, ep, [*plan_moe.keys(m, w, b, s), *extra]) for m, w, b, s, ep, extra in plan_moe.SETUPS
    ], STALE


def test_verify_plan_holds_the_qwen3_30b_a3b_plan_to_fully_shard_at_8_ranks():
    """48 layers of 128 experts sharded by the real fully_shard over 8 fake ranks (seconds, nothing allocated)."""
    result = plan_moe.verify(plan_moe.keys("Qwen3-30B-A3B", 8, 8, 4096))
    assert "matches the plan" in result["line"] and "world size 8" in result["line"]


@pytest.mark.parametrize(("world", "ep"), [(8, 2), (16, 8)])
def test_verify_plan_holds_the_qwen3_30b_a3b_plan_to_the_expert_mesh_and_fully_shard(world, ep):
    """Qwen3-30B-A3B from its config.json at expert-parallel degree ``ep``: 128 experts of 48 layers split over the
    backend's expert mesh on ``world`` fake ranks and sharded by FSDP2 over the ranks outside each group; the state
    matches the plan on the first and the last rank, the collectives group by group, and what they send is the
    plan's per-step traffic less its all-to-all (which verify_plan does not see: the task's, not FSDP2's)."""
    overrides = [*plan_moe.keys("Qwen3-30B-A3B", world, world, 4096), f"distributed.expert_parallel_degree={ep}"]
    line = plan_moe.verify(overrides)["line"]
    planned = plan_moe.plan(overrides, ep)
    fsdp_sent = (planned["sent_bytes"] - planned["all_to_all_bytes"]) / 2**30
    assert "matches the plan" in line and f"world size {world}" in line and f"+ EP {ep}" in line
    assert f"params {planned['params_bytes'] / 2**30:.3f} GiB per rank" in line
    assert f"sending {fsdp_sent:.2f} GiB per step" in line


TP2_EP2 = ["model=moe_tiny", "distributed=fully_sharded", "distributed.world_size=8", "optimization.batch_size=8",
           "validation.batch_size=8", "distributed.tensor_parallel_degree=2", "distributed.expert_parallel_degree=2",
           "dry_run=true"]  # fmt: skip


def test_verify_plan_holds_the_tp_x_ep_plan_where_the_moe_blocks_stay_whole_under_tensor_parallelism(monkeypatch):
    """TP 2 x EP 2 on 8 fake ranks (dp_shard 4): the LM's tensor-parallel plan splits attention, embedding and head
    while each MoE block stays whole on every tensor-parallel rank, the experts split on the expert mesh and
    fully_shard-ed over the ranks outside each group; the plan's bytes are the real ones. A plan that split the MoE
    blocks like every other matrix does not match."""
    from shardlab.memory import experts as plan_experts_module
    from shardlab.memory.verify import PlanMismatch, verify_plan
    from tests.unit.test_memory_axes import tiny_task

    cfg, task = tiny_task(TP2_EP2, 8)
    line = verify_plan(cfg, task, 8)[0]
    assert "dp_shard 4 x tp 2" in line and "the task's tensor-parallel plan applied" in line, line
    monkeypatch.setattr(plan_experts_module, "_block_shapes", lambda model, units, spec: None)
    cfg, task = tiny_task(TP2_EP2, 8)
    with pytest.raises(PlanMismatch, match="bytes of params"):
        verify_plan(cfg, task, 8)


def test_the_tp_x_ep_plan_routes_each_ranks_slice_of_the_sequence_and_sends_its_all_to_all_on_the_ep_axis():
    """At TP 2 a rank routes half of each sample's tokens: half the dispatch and all-to-all of TP 1 at the same
    EP 2, the all-to-all counted on its own 'ep' axis beside FSDP's and TP's traffic."""
    from shardlab.distributed.units import model_on_meta
    from shardlab.memory import budget
    from shardlab.memory.estimate import estimate
    from shardlab.memory.experts import plan_experts
    from shardlab.memory.layout import Layout
    from shardlab.memory.plan import profile_config
    from tests.unit.test_memory_axes import tiny_task

    cfg, task = tiny_task(TP2_EP2, 8)
    model = model_on_meta(task)
    profile, ctx = profile_config(cfg, task, 8, model)
    tp_ep = Layout("fully_sharded", 4, tp=2, ep=2)
    axes = budget.task_axes(cfg, task, 8, model, ctx.ranks_per_node)
    est = estimate(axes.profile_at(tp_ep), tp_ep, ctx)
    with_tp, without = plan_experts(profile, tp_ep, ctx), plan_experts(profile, Layout("fully_sharded", 8, ep=2), ctx)
    assert with_tp.ep == 2 and with_tp.tokens * 2 == without.tokens
    tp1 = plan_experts(axes.profile_at(tp_ep), Layout("fully_sharded", 4, ep=2), ctx)
    assert 2 * est.axes.traffic["ep"] == tp1.all_to_all_bytes > 0
    assert est.axes.traffic["tp"] > 0 and est.axes.traffic["fsdp"] > 0


def test_experts_fewer_than_their_sharding_ranks_are_sharded_by_rows_and_planned_so(monkeypatch):
    """EP 8 on 16 ranks: each rank's 1 expert of every layer is sharded over the 2 ranks outside its group by rows
    (Shard(1), expert_parallel.expert_shard_placement), half an expert each, not a padded whole one; the plan holds
    to the real fully_shard, and a plan that padded whole experts does not."""
    from shardlab.distributed.expert_parallel import expert_shard_placement
    from shardlab.memory import experts as plan_experts_module
    from shardlab.memory.verify import PlanMismatch, verify_plan
    from tests.unit.test_memory_axes import tiny_task

    overrides = ["model=moe_tiny", "distributed=fully_sharded", "distributed.world_size=16", "dry_run=true",
                 "optimization.batch_size=16", "validation.batch_size=16",
                 "distributed.expert_parallel_degree=8"]  # fmt: skip
    assert expert_shard_placement(torch.empty(1, 384, 192), 2) == Shard(1)
    assert expert_shard_placement(torch.empty(2, 384, 192), 2) is None and expert_shard_placement(
        torch.empty(1, 383, 192), 2) is None  # fmt: skip
    cfg, task = tiny_task(overrides, 16)
    assert "matches the plan" in verify_plan(cfg, task, 16)[0]
    monkeypatch.setattr(plan_experts_module, "rows_sharded", lambda shape, ep, degree: False)
    with pytest.raises(PlanMismatch):
        verify_plan(cfg, task, 16)
