"""Communication volume: the collectives one optimizer step issues on a data-parallel layout (per FSDP unit, or DDP's
all-reduce), the bytes a rank sends for them in ring collectives, and the NCCL communicators a rank holds.
shardlab.memory.verify holds ``collectives`` against the real fully_shard; shardlab.memory.axes adds the model axes'
traffic on these pieces.
"""

from __future__ import annotations

from dataclasses import dataclass

from shardlab.memory.context import PlanContext
from shardlab.memory.layout import Layout, shard_numel
from shardlab.memory.profile import ModelProfile


def communicators(layout: Layout, ctx: PlanContext) -> int:
    """NCCL communicators a rank of ``layout`` holds: the default group, and each mesh dimension's."""
    if ctx.world_size == 1 or layout.backend == "single":
        return 0
    hybrid = layout.backend == "fully_sharded" and layout.sharding_degree < ctx.world_size
    return 1 + (2 if hybrid else 1 if layout.backend == "fully_sharded" else 0)


@dataclass(frozen=True)
class Collective:
    """One collective of a step as a rank issues it: what FSDP2 (or DDP) calls, on how many ranks, how many times."""

    op: str
    """all_gather, reduce_scatter, all_reduce, or send (a pipeline stage's point-to-point send)."""
    group_size: int
    bytes: int
    """The per-rank buffer: an all-gather's input, a reduce-scatter's output, an all-reduce's tensor."""
    count: int

    @property
    def sent(self) -> int:
        """Bytes one rank sends for all ``count`` of them in a ring: (n-1) buffers for a gather or scatter, 2(n-1)/n
        of the buffer for an all-reduce."""
        n = self.group_size
        if self.op == "send":
            return self.bytes * self.count
        per_call = 2 * (n - 1) * self.bytes // n if self.op == "all_reduce" else (n - 1) * self.bytes
        return per_call * self.count


def collectives(profile: ModelProfile, layout: Layout, ctx: PlanContext) -> list[Collective]:
    """The collectives of one optimizer step, per FSDP unit (then the root), as fully_sharded issues them: an
    all-gather per micro-batch in forward and again in backward for each resharded unit (all but the last unit and
    the root), a reduce-scatter per reduction, and on a hybrid mesh an all-reduce of each reduced shard across the
    replicas. ddp: one all-reduce of the gradients per reduction. The all-gathers carry every parameter; the
    reductions only the trainable ones' gradients (frozen weights have none: a LoRA run reduces its adapters)."""
    n = ctx.world_size
    if n == 1 or layout.backend == "single":
        return []
    reductions = ctx.update_freq if ctx.reduce_every_microbatch else 1
    if layout.backend == "ddp":
        return [Collective("all_reduce", n, profile.trainable_params * ctx.reduce_bytes, reductions)]
    f = layout.sharding_degree
    r = n // f
    groups = profile.groups()
    out = []
    for i, (shapes, trained) in enumerate(zip(groups, profile.trainable(), strict=True)):
        resharded = layout.reshard_after_forward and i < len(groups) - 2  # not the last unit, not the root
        out += group_collectives(ctx, shard_numel(shapes, f), shard_numel(trained, f), f, r, resharded)
    return out


def group_collectives(ctx: PlanContext, shard: int, reduced: int, f: int, r: int, resharded: bool) -> list[Collective]:
    """One FSDP2 parameter group's collectives in a step: ``shard`` elements per rank (padded) gathered over its
    ``f`` sharding ranks per micro-batch (twice when ``resharded`` after forward), the ``reduced`` ones' gradients
    reduce-scattered over them and all-reduced across its ``r`` replicas per reduction. None for a group without
    parameters (fully_shard makes none)."""
    if shard == 0:
        return []
    micro = ctx.update_freq
    reductions = micro if ctx.reduce_every_microbatch else 1
    out = []
    if f > 1:
        out.append(Collective("all_gather", f, shard * ctx.param_bytes, micro * (2 if resharded else 1)))
    if f > 1 and reduced:
        out.append(Collective("reduce_scatter", f, reduced * ctx.reduce_bytes, reductions))
    if r > 1 and reduced:
        out.append(Collective("all_reduce", r, reduced * ctx.reduce_bytes, reductions))
    return out


def comm_bytes(profile: ModelProfile, layout: Layout, ctx: PlanContext) -> int:
    return sum(c.sent for c in collectives(profile, layout, ctx))
