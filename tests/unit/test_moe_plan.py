"""The memory plan of a mixture-of-experts model (issue 49, item 5; shardlab/memory/experts.py): the meta forward
runs through the MoE block and counts what a real forward saves, total against active parameters match the model's
tensors, expert parallelism shrinks what a layer gathers and adds the all-to-all, and verify_plan holds the plan to
the real fully_shard on the fake process group."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from shardlab.distributed.materialize import materialize
from shardlab.distributed.units import meta_model, model_on_meta
from shardlab.memory.console import describe
from shardlab.memory.estimate import estimate
from shardlab.memory.experts import plan_experts
from shardlab.memory.layout import Layout
from shardlab.memory.plan import profile_config
from shardlab.runner import build_task
from shardlab_tasks.lm.models.moe_experts import dispatch
from tests.conftest import compose_config

SMALL_MOE = ["model=moe_tiny", "model.num_layers=2", "model.dim=64", "model.num_heads=4", "model.num_kv_heads=2",
             "model.moe.num_experts=8", "model.moe.ffn_dim=32", "data.seq_len=16", "optimization.batch_size=4",
             "validation.batch_size=4"]  # fmt: skip


def planned(world: int, *overrides: str):
    cfg = compose_config([*SMALL_MOE, *overrides])
    task = build_task(cfg, world_size=world)
    profile, ctx = profile_config(cfg, task, world, model_on_meta(task))
    return task, profile, ctx


def expert_tensors(model) -> list[torch.Tensor]:
    return [p for name, p in model.named_parameters() if ".experts." in name]


def test_total_and_active_parameters_are_the_models_tensors_and_top_k_of_its_experts():
    task, profile, ctx = planned(1)
    model = meta_model(task.build_model)
    experts = expert_tensors(model)
    assert len(experts) == 2 * 2  # gate_up and down of each layer
    total = sum(p.numel() for p in model.parameters())
    top_k = sum(p[:2].numel() for p in experts)  # two experts' worth of each expert tensor
    plan = plan_experts(profile, Layout("single"), ctx)
    assert plan.total_params == total == profile.params
    assert plan.expert_params == sum(p.numel() for p in experts)
    assert plan.active_params == total - plan.expert_params + top_k
    assert plan.tokens == 4 * 16 and plan.dispatch_bytes == 4 * 16 * 2 * 64 * 4  # fp32 rows of 64, top 2
    assert plan.router_bytes == 4 * 16 * 8 * (4 + 4)


FAMILIES = {
    "mixtral": [],
    "qwen2_moe": ["model.moe.shared_ffn_dim=48", "model.moe.shared_expert_gate=true", "model.moe.norm_topk_prob=false"],
    "deepseek_v3": ["model.moe.score_func=sigmoid", "model.moe.num_groups=4", "model.moe.topk_groups=2",
                    "model.moe.score_bias=true", "model.moe.routed_scaling=2.5", "model.moe.shared_ffn_dim=32"],
}  # fmt: skip


@pytest.mark.parametrize("family", FAMILIES)
def test_the_meta_forward_runs_through_the_moe_block_and_counts_what_a_real_forward_saves(family):
    """A real fp32 CPU forward of the task's loss under a saved-tensor hook (each storage once, parameters left
    out) saves what the plan's meta forward counted, within the 5% the plan's other measured checks allow (the
    three routings and their shared experts; measured: within 0.01%)."""
    task, profile, _ = planned(1, *FAMILIES[family])
    assert profile.activation_error is None and profile.activations > 0
    model = meta_model(task.build_model)
    materialize(model, torch.device("cpu"), task.init_tensor, 0)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    kept: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            kept[storage.data_ptr()] = storage.nbytes()
        return t

    batch = torch.randint(0, 256, (4, 17), generator=torch.Generator().manual_seed(0))
    model.train()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        task.loss(model, batch, torch.device("cpu"))
    assert profile.activations == pytest.approx(sum(kept.values()), rel=0.05)


def test_the_dispatch_on_meta_keeps_every_assignment_or_at_most_full_experts_with_a_capacity():
    indices = torch.empty(10, 2, dtype=torch.long, device="meta")
    weights = torch.empty(10, 2, device="meta")
    assert dispatch(indices, weights, 4, None).token.shape == (20,)
    assert dispatch(indices, weights, 4, 0.5).token.shape == (4 * 3,)  # ceil(0.5 * 20 / 4) = 3 per expert
    assert dispatch(indices, weights, 4, 2.0).token.shape == (20,)


def test_expert_parallel_splits_the_experts_a_layer_gathers_keeps_the_state_and_adds_the_all_to_all():
    """At 8 sharding ranks, EP 1, 2, 4, 8: each EP rank computes 8 / ep experts of a layer, so what a layer gathers
    halves when ep doubles, while the expert state a rank holds stays 1/8 of the experts (E / ep experts over
    8 / ep FSDP ranks); the all-to-all sends (ep - 1) / ep of the dispatched rows four times per layer."""
    _, profile, ctx = planned(8, "distributed=fully_sharded", "optimization.batch_size=8", "validation.batch_size=8")
    layers, dispatch_bytes = 2, 1 * 16 * 2 * 64 * 4  # one sample of 16 tokens per rank, top 2, fp32 rows of 64
    plans = {ep: plan_experts(profile, Layout("fully_sharded", 8, ep=ep), ctx) for ep in (1, 2, 4, 8)}
    estimates = {ep: estimate(profile, Layout("fully_sharded", 8, ep=ep), ctx) for ep in (1, 2, 4, 8)}
    expert_total = plans[1].expert_params
    for ep, plan in plans.items():
        assert plan.ep == ep and plan.experts_per_rank == 8 // ep and plan.expert_shard_ranks == 8 // ep
        assert plan.expert_numel == expert_total // 8  # held: the same share at every degree
        assert plan.gathered_layer_numel == expert_total // layers // ep
        assert plan.all_to_all_bytes == 4 * layers * dispatch_bytes * (ep - 1) // ep
        assert estimates[ep].state == estimates[1].state
        if ep > 1:
            assert estimates[ep].gathered < estimates[ep // 2].gathered
            assert estimates[ep].activations == estimates[1].activations + 2 * dispatch_bytes
    # The experts' FSDP traffic shrinks with their group (none at EP 8), the tokens' all-to-all grows
    fsdp = {ep: e.comm_bytes - plans[ep].all_to_all_bytes for ep, e in estimates.items()}
    assert fsdp[8] < fsdp[4] < fsdp[2] < fsdp[1]
    lines = describe(profile, Layout("fully_sharded", 8, ep=4), ctx, compare=True)
    moe = next(line for line in lines if line.startswith("  experts:"))
    assert "active per token" in moe and "EP 4: 2 experts of each layer per EP rank" in moe
    assert "all-to-all sends" in moe
    assert any(line.startswith("*") and "+ EP 4" in line for line in lines)  # the table keeps the chosen degree


def test_full_checkpointing_recomputes_the_dispatch_and_combine_of_each_recomputed_layer():
    _, profile, ctx = planned(8, "distributed=fully_sharded", "optimization.batch_size=8", "validation.batch_size=8")
    plain = plan_experts(profile, Layout("fully_sharded", 8, ep=2), ctx)
    ckpt = plan_experts(profile, Layout("fully_sharded", 8, ep=2, activation_checkpointing=True), ctx)
    assert ckpt.all_to_all_bytes == plain.all_to_all_bytes * (4 + 2) // 4


def test_a_degree_the_experts_or_the_shard_group_do_not_divide_is_not_planned_and_said_so():
    _, profile, ctx = planned(8, "distributed=fully_sharded", "optimization.batch_size=8", "validation.batch_size=8")
    plan = plan_experts(profile, Layout("fully_sharded", 8, ep=16), ctx)
    assert plan.ep == 1
    lines = describe(profile, dataclasses.replace(Layout("ddp"), ep=2), ctx, compare=False)
    assert any("expert_parallel_degree=2 not planned for ddp" in line for line in lines)


def test_verify_plan_holds_the_moe_plan_to_fully_shard_with_fewer_experts_than_ranks():
    """8 experts over 16 ranks: FSDP2 pads each expert tensor's 8 rows to one row on every rank (the last 8 ranks
    hold none of the data); the plan's state and collectives match the real fully_shard on the fake process group."""
    from shardlab.memory.verify import verify_plan

    cfg = compose_config(
        [*SMALL_MOE, "distributed=fully_sharded", "optimization.batch_size=16", "validation.batch_size=16"]
    )
    lines = verify_plan(cfg, build_task(cfg, world_size=16), 16)
    assert "matches the plan" in lines[0]


def test_the_layout_reads_distributed_expert_parallel_degree_where_the_config_has_it():
    """Configs without the key (before expert parallelism, or recorded by older runs) plan EP 1."""
    from omegaconf import OmegaConf

    from shardlab.memory.layout import layout_of

    section = compose_config([*SMALL_MOE, "distributed=fully_sharded"]).distributed
    assert layout_of(section, 8).ep == 1
    with_key = OmegaConf.create({**OmegaConf.to_container(section), "expert_parallel_degree": 4})
    layout = layout_of(with_key, 8)
    assert layout.ep == 4 and layout.label(8).endswith("+ EP 4")
    assert layout.overrides(8)["expert_parallel_degree"] == 4


def ep_config(world: int, ep: int, *overrides: str):
    return compose_config([*SMALL_MOE, *ep_keys(world, ep, *overrides)])


def ep_keys(world: int, ep: int, *overrides: str) -> list[str]:
    return ["distributed=fully_sharded", f"optimization.batch_size={world}", f"validation.batch_size={world}",
            f"distributed.expert_parallel_degree={ep}", *overrides]  # fmt: skip


@pytest.mark.parametrize(
    ("world", "ep", "extra"), [(8, 2, ()), (8, 8, ()), (16, 4, ("distributed.sharding_degree=8",))]
)
def test_verify_plan_holds_expert_parallelism_to_the_backends_expert_mesh_and_fully_shard(world, ep, extra):
    """The backend's own expert split and FSDP2 on the fake group: each expert module its own FSDP2 unit over the
    f / ep ranks outside its expert group (and the replicas, hybrid), holding E / ep experts of (experts, rows,
    width) as a DTensor on the expert mesh; the rest over all f. Its state on the first and the last rank and its
    collectives group by group are the plan's (shardlab.memory.experts.expert_rank_state, expert_collectives)."""
    from shardlab.memory import verify
    from shardlab.memory.experts import expert_collectives
    from shardlab.memory.layout import layout_of

    cfg = ep_config(world, ep, *extra)
    task = build_task(cfg, world_size=world)
    f = 8 if extra else world
    with verify.fake_process_group(world, world - 1):
        _, modules = verify.shard_on_fake_group(cfg, task, world, world - 1)
        experts = [m for m in modules if type(m).__name__.startswith("FSDPGroupedExperts")]
        assert len(experts) == 2  # one per MoE layer
        for module in experts:
            group = verify._group(module)
            assert group.mesh_info.shard_mesh_size == f // ep
            assert getattr(group.mesh_info, "replicate_mesh_size", 1) == world // f
            weight = group.fsdp_params[0].sharded_param
            assert weight.device_mesh.mesh_dim_names[-1] == "ep" and weight.shape[0] == 8  # the global experts
            assert weight.to_local().shape[0] == max(8 // ep // (f // ep), 0)  # 8 experts: E / ep over f / ep
        measured = verify.measured_collectives(modules, 1, 1)
    _, profile, ctx = planned(world, *ep_keys(world, ep, *extra))
    planned_ = expert_collectives(profile, layout_of(cfg.distributed, world), ctx)
    assert measured == planned_
    assert (f // ep in {c.group_size for c in measured}) == (f > ep)  # the experts' own groups (none at ep = f)
    lines = verify.verify_plan(cfg, task, world)
    assert "matches the plan" in lines[0] and f"+ EP {ep}" in lines[0]


def test_verify_plan_reports_experts_the_backend_did_not_split_and_experts_it_reshards_unplanned(monkeypatch):
    """Planted mismatches: the backend leaving the experts whole (FSDP2 then shards all 8 experts over the 4 ranks
    outside the group: twice the plan's expert bytes), and the backend keeping the experts gathered after forward
    (one all-gather per step where the plan has two)."""
    from shardlab.distributed import fully_sharded
    from shardlab.memory.verify import PlanMismatch, verify_plan

    cfg = ep_config(8, 2)
    task = build_task(cfg, world_size=8)
    with monkeypatch.context() as patch:
        patch.setattr(fully_sharded, "split_experts", lambda modules, mesh: None)
        with pytest.raises(PlanMismatch, match=r"rank 0 of 8: fully_shard gives [\d,]+ bytes of params, the memory"):
            verify_plan(cfg, task, 8)
    kept = fully_sharded.FullyShardedBackend.shard_experts

    def unresharded(backend, modules, mesh, kwargs):
        backend.cfg.reshard_after_forward = False
        try:
            kept(backend, modules, mesh, kwargs)
        finally:
            backend.cfg.reshard_after_forward = True

    monkeypatch.setattr(fully_sharded.FullyShardedBackend, "shard_experts", unresharded)
    with pytest.raises(PlanMismatch, match=r"differ at collective \d+: fully_shard .*all_gather.*count=1\)"):
        verify_plan(cfg, task, 8)
