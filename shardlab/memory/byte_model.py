"""The byte model of one data-parallel layout (single, ddp, fully_sharded, hybrid): what each rank holds at the peak
of a training step (``estimate_data_parallel``); the collectives it issues are shardlab.memory.communication's, what
the bytes depend on besides the layout shardlab.memory.context's. shardlab.memory.axes builds the model axes (tensor,
pipeline, context) on these pieces; shardlab.memory.estimate chooses between the two.

Parameters, gradients and optimizer state follow from parameter counts. Gathered units follow from the FSDP unit
sizes and the reshard/prefetch settings. Activations come from the model's profile on meta
(shardlab.memory.profile). Everything is in bytes per rank above an idle rank (torch imported, process group joined).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from shardlab.distributed.activation_checkpointing import checkpointed_units
from shardlab.memory import devices
from shardlab.memory.communication import comm_bytes, communicators
from shardlab.memory.context import PlanContext
from shardlab.memory.layout import Layout, shard_numel, shard_rows
from shardlab.memory.profile import ModelProfile


@dataclass
class MemoryEstimate:
    layout: Layout
    params: int
    optimizer: int
    grad_buffers: int
    """Gradient memory kept between steps (DDP's buckets)."""
    grads: int
    """Gradients allocated during backward and freed by zero_grad (param.grad, or the local gradient shards)."""
    gathered: int
    """Unsharded parameters and unsharded gradients of the units in flight (fully_sharded)."""
    activations: int | None
    runtime: int
    """What a CPU rank keeps after its first step besides the model: kernels' workspaces, thread pools, library
    caches (0 on CUDA, where the allocator's peak, which the meter reads, leaves them out: see ``outside``)."""
    host: int
    """Bytes moved to host memory (cpu_offload, offload_activations) on CUDA; on CPU they stay counted above."""
    comm_bytes: int
    """Bytes each rank sends per optimizer step (ring collectives)."""
    accumulating: bool = False
    """update_freq > 1: an earlier micro-batch's gradients are held while the next one's activations build up."""
    allocator: int = 0
    """CUDA: what the caching allocator reserves beyond the tensors (block rounding and the fragmentation allowance)."""
    outside: int = 0
    """CUDA: device memory outside the allocator: the CUDA context and NCCL's buffers."""
    axes: Any = None
    """A layout with tensor, pipeline or context axes: its stages, schedule and traffic by axis, a
    shardlab.memory.axes.AxesDetail (not named here: that module builds on this one); else None."""

    @property
    def state(self) -> int:
        return self.params + self.optimizer + self.grad_buffers + self.grads

    @property
    def between_steps(self) -> int:
        """What stays allocated between steps: parameters, optimizer state, gradient buffers and the runtime."""
        return self.params + self.optimizer + self.grad_buffers + self.runtime

    @property
    def peak(self) -> int:
        """The step's peak of live tensors (and a CPU rank's runtime): what the meter reads, the allocator's peak on
        CUDA. Gradients fill in as backward frees activations, so it holds the larger of the two (both when gradients
        accumulate over micro-batches)."""
        activations = self.activations or 0
        work = activations + self.grads if self.accumulating else max(activations, self.grads)
        return self.between_steps + self.gathered + work

    @property
    def device_peak(self) -> int:
        """What the device must have free for the step: the peak, the allocator's rounding and fragmentation, and
        (CUDA) the context and NCCL's buffers. Equal to ``peak`` on CPU."""
        return self.peak + self.allocator + self.outside


CPU_RUNTIME_BYTES = 13 * 2**20
"""A CPU rank's private resident growth over its first step that is neither model nor activations (kernel and
thread-pool set-up; not traced further): measured on 13M-28M-parameter LMs at world sizes 2 and 4, every layout
(tests/distributed/test_memory_plan.py; docs/memory-plan.md). The meter leaves out file-backed pages (library code
mapped in as it first runs, 15 MiB more here, and dropped again under memory pressure), so neither counts them. On
CUDA such memory lives outside the allocator, whose peak the plan predicts there; MemoryEstimate.outside counts the
context and NCCL's buffers beside it."""


@dataclass(frozen=True)
class RankState:
    """Bytes of one rank's parameters, gradients and optimizer state, as FSDP2 allocates them."""

    params: int
    """The sharded parameters' storage: every rank allocates the padded shard (FSDP2 pads to the first shard)."""
    local_params: int
    """Of those, the DTensor local shards (unpadded): what this rank's optimizer state is shaped like."""
    grads: int
    """The sharded gradients: views of the padded reduce-scatter output when it is already in the parameters' dtype
    (fp32), else a cast copy of the local shards."""
    optimizer: int


def rank_state(profile: ModelProfile, layout: Layout, ctx: PlanContext, rank: int = 0) -> RankState:
    """What rank ``rank`` of the shard group holds (rank 0 holds the most: the first chunks are the full ones)."""
    if layout.backend != "fully_sharded":
        P, T = profile.params, profile.trainable_params
        return RankState(4 * P, 4 * P, 4 * T, ctx.optimizer_state_bytes * T)
    f = layout.sharding_degree
    groups, trained = profile.groups(), profile.trainable()
    padded = sum(shard_numel(g, f) for g in groups)
    local = sum(shard_numel(g, f, rank) for g in groups)
    # Gradients and optimizer state: of the trainable parameters only (a LoRA run's adapters).
    grads_padded, grads_local = sum(shard_numel(g, f) for g in trained), sum(shard_numel(g, f, rank) for g in trained)
    grads = 4 * grads_padded if ctx.reduce_bytes == 4 else 4 * grads_local
    return RankState(4 * padded, 4 * local, grads, ctx.optimizer_state_bytes * grads_local)


def estimate_data_parallel(profile: ModelProfile, layout: Layout, ctx: PlanContext) -> MemoryEstimate:
    """Per-rank bytes of a training step of the data-parallel ``layout`` on the fullest rank: what is held between
    steps and what the step adds."""
    if layout.backend != "fully_sharded" and profile.autocast is not None:
        profile = profile.autocast  # low precision through autocast, with its weight copies
    sharded = layout.backend == "fully_sharded"
    ranked = rank_state(profile, layout, ctx)
    params, optimizer, grads = ranked.params, ranked.optimizer, ranked.grads
    # DDP copies gradients into bucket buffers of the same size that survive zero_grad (gradient_as_bucket_view off).
    grad_buffers = 4 * profile.trainable_params if layout.backend == "ddp" else 0
    gathered = 0
    if sharded:
        f = layout.sharding_degree
        groups, trained = profile.groups(), profile.trainable()
        # A unit's all-gather output is one flat buffer of f padded shards; its parameters are views of it. The
        # reduce-scatter's input holds the gradients of the unit's trainable parameters only (FSDP2 reduces those
        # with a gradient: a LoRA run's adapters), padded as their shards are.
        gathered = gathered_bytes(
            layout, ctx, [f * shard_numel(g, f) for g in groups[:-1]], [sum(r * w for r, w in g) for g in trained[:-1]],
            [f * shard_numel(g, f) for g in trained[:-1]], f * shard_numel(groups[-1], f) if profile.root_params else 0,
        )  # fmt: skip
        if ctx.update_freq > 1 and not ctx.reduce_every_microbatch:
            T = profile.trainable_params  # unsharded gradients kept across micro-batches (a trap the plan warns of)
            gathered += 4 * (T - -(-T // f))
    activations = _activations(profile, layout)
    host = 0
    if ctx.device == "cuda":
        if layout.cpu_offload:
            host += params + grads + optimizer
            params = grads = optimizer = 0
        if ctx.offload_activations and activations is not None:
            host += activations
            activations = _transient(profile)
    runtime = CPU_RUNTIME_BYTES if ctx.device == "cpu" else 0
    comm = comm_bytes(profile, layout, ctx)
    est = MemoryEstimate(
        layout, params, optimizer, grad_buffers, grads, gathered, activations, runtime, host, comm, ctx.update_freq > 1
    )
    if ctx.device == "cuda":
        est.outside = devices.CUDA_CONTEXT + communicators(layout, ctx) * devices.NCCL_PER_COMMUNICATOR
        est.allocator = _allocator_overhead(profile, layout, ctx, est)
    return est


def gathered_bytes(
    layout: Layout, ctx: PlanContext, unit_gathered: list[int], unit_grads: list[int], unit_reduced: list[int],
    root: int,
) -> int:  # fmt: skip
    """fully_sharded: the gathered parameters and unsharded gradients in flight at the peak, from each unit's
    all-gather output, unsharded gradient and reduce-scatter input (elements) and the root's all-gather output."""
    biggest = max(unit_gathered, default=0)
    if layout.reshard_after_forward:
        # Backward of the last unit: the root (never resharded) and that unit still gathered, the previous unit
        # prefetched, plus the unit's unsharded gradient and its reduce-scatter buffer.
        in_flight = 2 + max(ctx.prefetch_units - 1, 0)
        gathered = ctx.param_bytes * (root + in_flight * biggest)
    else:  # every unit stays gathered from its forward to its backward
        gathered = ctx.param_bytes * (root + sum(unit_gathered) + biggest)
    return gathered + ctx.param_bytes * max(unit_grads, default=0) + ctx.reduce_bytes * max(unit_reduced, default=0)


def _allocator_overhead(profile: ModelProfile, layout: Layout, ctx: PlanContext, est: MemoryEstimate) -> int:
    """CUDA: the caching allocator's block rounding of the state tensors (one per parameter and Adam moment; one flat
    gradient buffer per unit) and of the saved activations, plus the fragmentation allowance on the whole peak."""
    rounding = 0
    if not layout.cpu_offload or ctx.device != "cuda":
        f = layout.sharding_degree if layout.backend == "fully_sharded" else 1
        tensors = [4 * shard_rows(rows, f) * width for g in profile.groups() for rows, width in g]
        moments = ctx.optimizer_state_bytes // 4
        rounding = (1 + moments) * sum(devices.allocator_bytes(n) - n for n in tensors)
    if est.activations and profile.activations:
        rounding += int(profile.activation_slack * est.activations / profile.activations)
    return rounding + int(devices.FRAGMENTATION * (est.peak + rounding))


def _transient(profile: ModelProfile) -> int:
    # Backward starts with the loss gradient of the largest saved output (the logits) and its input's gradient.
    return 2 * profile.largest_outside


def _activations(profile: ModelProfile, layout: Layout) -> int | None:
    if profile.activations is None:
        return None
    kept, recomputed = unit_activation_bytes(profile, layout)
    outside = profile.activations - sum(profile.unit_activations)
    return outside + sum(kept) + max(recomputed, default=0) + profile.backward_workspace + _transient(profile)


def unit_activation_bytes(profile: ModelProfile, layout: Layout) -> tuple[list[int], list[int]]:
    """Per unit: the bytes it keeps from its forward to its backward, and what its backward saves again on top
    (0 unless it recomputes). A checkpointed unit keeps its input (and under selective_op its kept ops' outputs)
    instead of what it saved; backward recomputes one unit at a time, saving again all but the kept outputs."""
    acts, inputs = profile.unit_activations, profile.unit_inputs
    picked = set(checkpointed_units(len(acts), layout.checkpointing, layout.ac_every_k_units, layout.ac_skip_units))
    if not picked:
        return list(acts), [0] * len(acts)
    ops_kept, reused = _kept_op_bytes(profile, layout)
    kept = [inputs[i] + ops_kept[i] if i in picked else acts[i] for i in range(len(acts))]
    return kept, [acts[i] - reused[i] if i in picked else 0 for i in range(len(acts))]


def _kept_op_bytes(profile: ModelProfile, layout: Layout) -> tuple[list[int], list[int]]:
    """Per unit: the bytes selective_op keeps (its op groups' outputs), and the part of them the unit saved anyway."""
    n = len(profile.unit_activations)
    if not layout.ac_save_ops or profile.unit_op_outputs is None or profile.unit_op_overlap is None:
        return [0] * n, [0] * n
    groups = layout.ac_save_ops
    kept = [sum(unit[g] for g in groups) for unit in profile.unit_op_outputs]
    reused = [sum(unit[g] for g in groups) for unit in profile.unit_op_overlap]
    every = layout.ac_matmul_save_every
    if every > 1 and "matmul" in groups and profile.unit_matmuls is not None:
        # Only the 1st, (every+1)-th, ... matmul of a unit is kept: the others' outputs leave what it keeps (and
        # its recomputation saves them again where the unit saved them).
        for i, matmuls in enumerate(profile.unit_matmuls):
            dropped = [m for j, m in enumerate(matmuls) if j % every]
            kept[i] -= sum(out for out, _ in dropped)
            reused[i] -= sum(overlap for _, overlap in dropped)
    return kept, reused
