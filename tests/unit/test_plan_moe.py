"""shardlab_bench/plan_moe.py: MoE models planned from their published config.json alone (tests/data), the table in
docs/models.md holding what the plan gives now, and the parameter counts the configs' fields give."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

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
