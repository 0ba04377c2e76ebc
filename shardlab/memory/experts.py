"""Mixture-of-experts layers in the memory plan (issue 49): total against active parameters, the routed experts each
rank holds under expert parallelism, the dispatch buffers and the all-to-all traffic of a step.

What a task says of its MoE layers is a shardlab.task.ExpertLayers (Task.expert_layers); ``expert_profile`` finds
their parameters in the model's FSDP units. Expert parallelism (distributed.expert_parallel_degree, ``ep``) borrows
its ranks from the data-sharding ones, as torchtitan does: each rank of an expert group holds ``E / ep`` consecutive
experts of every layer, and FSDP2 shards those over the ``f / ep`` sharding ranks outside the group (``f``:
distributed.sharding_degree), along the experts (dim 0) like every other parameter, or, where a rank has fewer
experts than those ranks, along each expert's rows (dim 1, ``rows_sharded``: torchtitan's placement), so no rank
holds a padded whole expert. Every other parameter shards over all ``f``; without expert parallelism the experts
shard with their block along dim 0, a rank with fewer experts than ranks holding one padded whole expert. So a
rank holds about the same expert state at any ``ep`` (1/f of the experts when ``E`` divides evenly);
what expert parallelism shrinks is what a layer gathers to compute (``E / ep`` experts, not ``E``) and the FSDP
traffic of the experts, paid for by all-to-all traffic of the tokens.

The tokens. Each rank routes its own ``T`` token rows (micro-batch samples x tokens per sample, over the context
ranks); every row goes to ``top_k`` experts, so ``T * top_k`` rows of width ``dim`` are dispatched per layer. The
meta forward (shardlab.memory.profile) counts what the block saves for backward on one rank (the router's logits and
probabilities, the permuted rows, the experts' hidden states), with every row through the experts: balanced
routing, the plan's assumption throughout (under expert parallelism a rank receives ``T * top_k`` rows on average;
an unbalanced router sends some rank more). Expert parallelism adds the all-to-all's send and receive buffers of one
layer (``dispatch_bytes`` each) while it exchanges, and per layer and micro-batch four exchanges (dispatch and
combine, in forward and again in backward; six for a layer that recomputes its forward), each sending the
``(ep - 1) / ep`` of the rows bound for other ranks.

Tensor parallelism with experts (shardlab.memory.axes): the MoE blocks are not split (each rank runs them on its
slice of the sequence, ``ExpertProfile.block_shapes`` stay whole in the rank's profile) and route ``T / tp`` rows each;
expert parallelism then places the experts over the data-sharding ranks as above (the expert mesh keeps 'tp'
innermost: shardlab.distributed.mesh.ParallelDims.expert_mesh). Pipeline and context axes with expert parallelism are
not composed (the pre-flight refuses them); with those axes the experts are planned as ordinary parameters.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from torch import nn

from shardlab.distributed.activation_checkpointing import checkpointed_units
from shardlab.memory.byte_model import MemoryEstimate, RankState, gathered_bytes, rank_state
from shardlab.memory.communication import Collective, collectives, group_collectives
from shardlab.memory.context import PlanContext
from shardlab.memory.devices import size_text
from shardlab.memory.layout import Layout, shard_numel, shard_rows
from shardlab.memory.profile import ExpertProfile, ModelProfile


def expert_profile(model: nn.Module, units: list[nn.Module], spec) -> ExpertProfile | None:
    """Where ``spec``'s (a shardlab.task.ExpertLayers) expert parameters sit among ``units`` (then the root), as
    (experts, rows, width) each; None for a dense model (``spec`` None)."""
    if spec is None:
        return None
    named = dict(model.named_parameters())
    wanted = {id(named[name]) for name in spec.expert_params}
    groups: list[list[tuple[int, int, int]]] = [[] for _ in range(len(units) + 1)]
    seen: set[int] = set()
    for i, unit in enumerate(units):
        for p in unit.parameters():
            if id(p) in wanted and id(p) not in seen:
                groups[i].append(_expert_shape(p))
                seen.add(id(p))
    groups[-1] = [_expert_shape(named[n]) for n in spec.expert_params if id(named[n]) not in seen]
    return ExpertProfile(spec, groups, _block_shapes(model, units, spec))


def _block_shapes(model: nn.Module, units: list[nn.Module], spec) -> list[list[tuple[int, int]]]:
    """ExpertProfile.block_shapes: the parameters under each module that holds an expert module (an expert weight
    ``<block>.<experts>.<name>``), per unit then the root."""
    blocks = {name.rsplit(".", 2)[0] + "." for name in spec.expert_params}
    in_block = {id(p) for name, p in model.named_parameters() if name.startswith(tuple(blocks))}
    seen: set[int] = set()
    groups = []
    for unit in [*units, model]:
        params = [p for p in unit.parameters() if id(p) in in_block and id(p) not in seen]
        seen.update(id(p) for p in params)
        groups.append([(p.shape[0], p.numel() // p.shape[0]) if p.dim() else (1, 1) for p in params])
    return groups


def _expert_shape(p: nn.Parameter) -> tuple[int, int, int]:
    experts, rows = p.shape[0], p.shape[1]
    return experts, rows, p.numel() // (experts * rows)


@dataclass(frozen=True)
class ExpertPlan:
    """One rank's share of the MoE layers under a layout and an expert-parallel degree."""

    total_params: int
    """Every parameter of the model."""
    active_params: int
    """Parameters one token computes with: all but the routed experts, plus top_k of each layer's experts."""
    expert_params: int
    """The routed experts' parameters, all layers."""
    ep: int
    """Expert-parallel degree (1: every rank computes every expert)."""
    experts_per_rank: int
    """Experts of each layer one expert-parallel rank holds (E / ep)."""
    expert_shard_ranks: int
    """Ranks FSDP2 shards those experts over (the sharding degree / ep; 1: not sharded)."""
    expert_numel: int
    """Expert parameters this rank holds (its padded shards)."""
    row_sharded_numel: int
    """What it would hold if FSDP2 sharded each expert's rows (dim 1) instead of the experts (torchtitan's choice
    when a rank has fewer experts than sharding ranks): the padding of whole experts gone."""
    gathered_layer_numel: int
    """Expert parameters one layer gathers to compute (its E / ep experts, padded shards of the group)."""
    tokens: int
    """Token rows each MoE layer routes per micro-batch on this rank."""
    dispatch_bytes: int
    """One copy of a layer's dispatched rows (tokens x top_k x dim in the compute dtype)."""
    router_bytes: int
    """A layer's router logits (compute dtype) and fp32 probabilities: tokens x experts each."""
    all_to_all_bytes: int
    """What this rank sends by all-to-all in one optimizer step (0 without expert parallelism)."""


def expert_degree(layout: Layout, profile: ModelProfile) -> int:
    """The layout's expert-parallel degree where the plan applies it: fully_sharded layouts of data axes (and
    tensor parallelism) whose sharding degree it divides; else 1."""
    ep = layout.ep
    beside = layout.pp == 1 and layout.cp == 1  # the data axes and tensor parallelism; not composed with pp or cp
    if ep > 1 and layout.backend == "fully_sharded" and beside and profile.experts is not None:
        if layout.sharding_degree % ep == 0 and profile.experts.spec.num_experts % ep == 0:
            return ep
    return 1


def rows_sharded(shape: tuple[int, int, int], ep: int, degree: int) -> bool:
    """Whether FSDP2 shards an expert weight of ``shape`` by rows (dim 1) rather than by experts: under expert
    parallelism, when a rank's E / ep experts are fewer than the ``degree`` sharding ranks and the rows split evenly
    (shardlab.distributed.expert_parallel.expert_shard_placement, as the backend shards them)."""
    experts, rows, _ = shape
    return ep > 1 and experts // ep < degree and rows % degree == 0


def expert_numel(shape: tuple[int, int, int], ep: int, degree: int, index: int | None = None) -> int:
    """Elements of one expert weight of ``shape`` (experts, rows, width) rank ``index`` (None: the padded shard) of
    ``degree`` holds: its E / ep experts sharded by FSDP2 along the experts (dim 0, padded to the first shard), or by
    rows (even: no padding) where ``rows_sharded``."""
    experts, rows, width = shape
    if rows_sharded(shape, ep, degree):
        return experts // ep * (rows // degree) * width
    return shard_rows(experts // ep, degree, index) * rows * width


def plan_experts(profile: ModelProfile, layout: Layout, ctx: PlanContext) -> ExpertPlan | None:
    """The MoE figures of ``layout`` (None for a dense model)."""
    ex = profile.experts
    if ex is None:
        return None
    spec, ep = ex.spec, expert_degree(layout, profile)
    f = layout.sharding_degree if layout.backend == "fully_sharded" else 1
    degree = max(f // ep, 1)
    shapes = [s for g in ex.group_shapes for s in g]
    expert_total = sum(e * r * w for e, r, w in shapes)
    active = profile.params - expert_total + expert_total * spec.top_k // spec.num_experts
    per_layer = [s for s in shapes[: max(len(shapes) // max(spec.num_layers, 1), 1)]]
    tokens = profile.local_batch * spec.tokens_per_sample // (max(layout.cp, 1) * max(layout.tp, 1))
    rows = tokens * spec.top_k
    dispatch = rows * spec.dim * ctx.param_bytes
    return ExpertPlan(
        total_params=profile.params,
        active_params=active,
        expert_params=expert_total,
        ep=ep,
        experts_per_rank=spec.num_experts // ep,
        expert_shard_ranks=degree,
        expert_numel=sum(expert_numel(s, ep, degree) for s in shapes),
        row_sharded_numel=sum(e // ep * shard_rows(r, degree) * w for e, r, w in shapes),
        gathered_layer_numel=sum(degree * expert_numel(s, ep, degree) for s in per_layer),
        tokens=tokens,
        dispatch_bytes=dispatch,
        router_bytes=tokens * spec.num_experts * (ctx.param_bytes + 4),
        all_to_all_bytes=_all_to_all_bytes(profile, layout, ctx, ep, dispatch),
    )


def _all_to_all_bytes(profile: ModelProfile, layout: Layout, ctx: PlanContext, ep: int, dispatch: int) -> int:
    """Sent per step by one expert-parallel rank: per MoE layer and micro-batch, dispatch and combine in forward and
    in backward, and again in a recomputed forward; each exchange sends the share of the rows bound for the other
    ep - 1 ranks (balanced routing)."""
    if ep == 1:
        return 0
    ex = profile.experts
    picked = checkpointed_units(len(profile.unit_params), layout.checkpointing, layout.ac_every_k_units,
                                layout.ac_skip_units)  # fmt: skip
    per_layer = sum(len(g) for g in ex.group_shapes) // max(ex.spec.num_layers, 1)  # expert tensors of one layer
    recomputed = sum(len(ex.group_shapes[i]) for i in picked) // max(per_layer, 1)  # MoE layers that recompute
    exchanges = 4 * ex.spec.num_layers + 2 * recomputed
    return ctx.update_freq * exchanges * dispatch * (ep - 1) // ep


def with_expert_parallel(est: MemoryEstimate, profile: ModelProfile, ctx: PlanContext) -> MemoryEstimate:
    """``est`` (the data-parallel byte model, which shards the experts like every parameter over all the sharding
    ranks) with the experts as expert parallelism places them: held state from E / ep experts over f / ep ranks
    (``expert_rank_state``), each layer gathering only its E / ep experts, the experts' FSDP traffic over their
    smaller group (``expert_collectives``), the all-to-all traffic, and one layer's send and receive buffers in
    flight."""
    layout = est.layout
    ep = expert_degree(layout, profile)
    if ep == 1:
        return est
    one, placed = rank_state(profile, layout, ctx), expert_rank_state(profile, layout, ctx)
    gathered = est.gathered - _gathered(profile, layout, ctx, 1) + _gathered(profile, layout, ctx, ep)
    plan = plan_experts(profile, layout, ctx)
    comm = sum(c.sent for c in expert_collectives(profile, layout, ctx))
    activations = None if est.activations is None else est.activations + 2 * plan.dispatch_bytes
    moved = {"params": placed.params - one.params, "grads": placed.grads - one.grads,
             "optimizer": placed.optimizer - one.optimizer}  # fmt: skip
    if layout.cpu_offload and ctx.device == "cuda":  # the state lives on the host (byte_model: host, not params)
        state = {"host": est.host + sum(moved.values())}
    else:
        state = {key: getattr(est, key) + value for key, value in moved.items()}
    return replace(est, **state, gathered=gathered, activations=activations, comm_bytes=comm + plan.all_to_all_bytes)


def expert_rank_state(profile: ModelProfile, layout: Layout, ctx: PlanContext, rank: int = 0) -> RankState:
    """byte_model.rank_state of rank ``rank`` of the shard group (its dp_shard index) with the experts as expert
    parallelism places them: each expert tensor's E / ep rows of the rank's group (the 'ep' index, rank % ep)
    sharded over the f / ep ranks outside it, where the rank is rank // ep (mesh.ParallelDims.expert_mesh: 'ep'
    innermost). Gradients: views of the padded reduce-scatter output in fp32, else cast copies of the local shard;
    optimizer state shaped like the local shard; neither for frozen experts (a LoRA base)."""
    base = rank_state(profile, layout, ctx, rank)
    ep = expert_degree(layout, profile)
    if ep == 1:
        return base
    f = layout.sharding_degree
    shapes = [s for g in profile.experts.group_shapes for s in g]

    def held(ep: int, degree: int, index: int | None) -> int:
        return sum(expert_numel(shape, ep, degree, index) for shape in shapes)

    padded = held(ep, f // ep, None) - held(1, f, None)
    local = held(ep, f // ep, rank // ep) - held(1, f, rank)
    trains = profile.trainable_shapes is None
    grads = 4 * (padded if ctx.reduce_bytes == 4 else local) if trains else 0
    optimizer = ctx.optimizer_state_bytes * local if trains else 0
    return RankState(base.params + 4 * padded, base.local_params + 4 * local, base.grads + grads,
                     base.optimizer + optimizer)  # fmt: skip


def expert_collectives(profile: ModelProfile, layout: Layout, ctx: PlanContext) -> list[Collective]:
    """communication.collectives as the fully_sharded backend issues them under expert parallelism: per FSDP unit
    (then the root), first its experts' group (each expert module is its own FSDP2 unit over the f / ep ranks
    outside the expert group and the replicas; resharded after forward whenever distributed.reshard_after_forward
    is set, the last unit's too: FullyShardedBackend.shard_experts), then the unit's other parameters over all f."""
    ep = expert_degree(layout, profile)
    if ep == 1:
        return collectives(profile, layout, ctx)
    f, r = layout.sharding_degree, ctx.world_size // layout.sharding_degree
    groups, trained = profile.groups(), profile.trainable()
    trains = profile.trainable_shapes is None
    out = []
    for i, experts in enumerate(profile.experts.group_shapes):
        shard = sum(expert_numel(s, ep, f // ep) for s in experts)
        out += group_collectives(ctx, shard, shard if trains else 0, f // ep, r, layout.reshard_after_forward)
        whole = [(e, rows * w) for e, rows, w in experts]
        rest, rest_trained = _without(groups[i], whole), _without(trained[i], whole) if trains else trained[i]
        resharded = layout.reshard_after_forward and i < len(groups) - 2  # not the last unit, not the root
        out += group_collectives(ctx, shard_numel(rest, f), shard_numel(rest_trained, f), f, r, resharded)
    return out


def _without(shapes: list[tuple[int, int]], taken: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """``shapes`` less one entry for each of ``taken`` (the unit's parameters less its experts)."""
    left = list(shapes)
    for shape in taken:
        left.remove(shape)
    return left


def _gathered(profile: ModelProfile, layout: Layout, ctx: PlanContext, ep: int) -> int:
    """byte_model.gathered_bytes with each unit's experts gathered as expert parallelism ``ep`` gathers them: the
    f / ep padded shards of its E / ep experts in place of the f padded shards of all E."""
    f, degree = layout.sharding_degree, layout.sharding_degree // ep
    groups, trained, experts = profile.groups(), profile.trainable(), profile.experts.group_shapes
    trains = profile.trainable_shapes is None  # experts train unless some weights are frozen (then: assumed frozen)

    def expert_gathered(i: int) -> int:
        return sum(degree * expert_numel(s, ep, degree) - f * expert_numel(s, 1, f) for s in experts[i])

    def expert_unsharded(i: int) -> int:
        return sum(e // ep * r * w - e * r * w for e, r, w in experts[i])

    units = range(len(groups) - 1)
    return gathered_bytes(
        layout, ctx, [f * shard_numel(groups[i], f) + expert_gathered(i) for i in units],
        [sum(r * w for r, w in trained[i]) + (expert_unsharded(i) if trains else 0) for i in units],
        [f * shard_numel(trained[i], f) + (expert_gathered(i) if trains else 0) for i in units],
        f * shard_numel(groups[-1], f) + expert_gathered(len(groups) - 1) if profile.root_params else 0,
    )  # fmt: skip


def experts_line(profile: ModelProfile, layout: Layout, ctx: PlanContext) -> str | None:
    """The console's line of an MoE model: total and active parameters, experts per rank, dispatch and all-to-all."""
    plan = plan_experts(profile, layout, ctx)
    if plan is None:
        return None
    spec = profile.experts.spec
    text = (
        f"  experts: {spec.num_layers} MoE layers x {spec.num_experts} experts, top {spec.top_k}: params "
        f"{_count(plan.total_params)} total, {_count(plan.active_params)} active per token (routed experts "
        f"{_count(plan.expert_params)}); "
    )
    if plan.ep > 1:
        text += f"EP {plan.ep}: {plan.experts_per_rank} experts of each layer per EP rank"
    else:
        text += f"no EP: all {plan.experts_per_rank} experts of each layer computed on every rank"
    if plan.expert_shard_ranks > 1:
        text += f", sharded over {plan.expert_shard_ranks} FSDP ranks"
    text += f": {size_text(4 * plan.expert_numel)} of fp32 expert weights held per rank"
    if plan.expert_numel > 1.01 * plan.row_sharded_numel:
        rows = size_text(4 * plan.row_sharded_numel)
        text += f" (whole experts padded: sharding each expert's rows would hold {rows})"
    text += (
        f", {size_text(ctx.param_bytes * plan.gathered_layer_numel)} gathered per layer; {plan.tokens} tokens per "
        f"micro-batch: dispatch {size_text(plan.dispatch_bytes)} per copy, router logits and probs "
        f"{size_text(plan.router_bytes)} per layer"
    )
    if plan.ep > 1:
        text += f"; all-to-all sends {size_text(plan.all_to_all_bytes)} per step per EP rank (balanced routing)"
    elif layout.ep > 1:
        text += f"; distributed.expert_parallel_degree={layout.ep} not planned for {layout.label(ctx.world_size)}"
    return text


def _count(n: int) -> str:
    """A parameter count as people say it: 30.53B, 3.35M, 12.3K."""
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return str(n)
