"""The memory plan as the console shows it (``describe``): the chosen layout's breakdown, its model axes and experts,
the plan's warnings, what the device must have, and (dry_run) the table of the alternatives.
"""

from __future__ import annotations

from dataclasses import replace

from shardlab.memory.context import PlanContext
from shardlab.memory.devices import GiB
from shardlab.memory.estimate import MemoryEstimate, estimate
from shardlab.memory.experts import expert_degree, experts_line
from shardlab.memory.layout import Layout, alternatives, axis_alternatives
from shardlab.memory.plan_warnings import warnings
from shardlab.memory.profile import ModelProfile


def _gib(n: int | None) -> str:
    return "?" if n is None else f"{n / GiB:.2f}"


def describe(profile: ModelProfile, chosen: Layout, ctx: PlanContext, compare: bool) -> list[str]:
    """Lines for the console: the chosen layout's breakdown, then (``compare``) a table of the alternatives."""
    est = estimate(profile, chosen, ctx)
    autocast = chosen.backend != "fully_sharded" and profile.autocast is not None
    copies = profile.autocast.autocast_copies if autocast else 0
    lines = [
        f"memory plan per rank ({chosen.label(ctx.world_size)}, {profile.local_batch} samples per micro-batch): "
        f"peak ~{_gib(est.peak)} GiB = params {_gib(est.params)} + optimizer {_gib(est.optimizer)}"
        + (f" + grad buckets {_gib(est.grad_buffers)}" if est.grad_buffers else "")
        + f" + runtime {_gib(est.runtime)} + gathered {_gib(est.gathered)} + "
        + ("" if est.accumulating else "max of ")
        + f"activations {_gib(est.activations)}"
        + (f" (autocast's weight copies {_gib(copies)})" if copies else "")
        + f", grads {_gib(est.grads)}"
        + (f"; host {_gib(est.host)} GiB" if est.host else "")
        + f"; sends {est.comm_bytes / GiB:.2f} GiB per step"
    ]
    if est.axes is not None:
        lines.append(axes_line(est, ctx))
    if (moe := experts_line(profile, chosen, ctx)) is not None:
        lines.append(moe)
    if profile.activation_error:
        lines.append(f"activations not planned: the model's forward fails on meta ({profile.activation_error})")
    lines += list(warnings(profile, chosen, ctx))
    if ctx.device == "cuda":
        lines.append(
            f"  on {ctx.target}: + allocator rounding and fragmentation {_gib(est.allocator)} + CUDA context and "
            f"NCCL buffers {_gib(est.outside)} = {_gib(est.device_peak)} GiB of {_gib(ctx.capacity)}"
            f"{'' if est.device_peak <= ctx.capacity else ' (does not fit)'}"
        )
    if not compare:
        return lines
    if profile.unit_op_outputs is None or any(ops.get("attention") for ops in profile.unit_op_outputs):
        lines.append(f"  attention: {attention_kernel(ctx)}")  # not for a model without any (RegNet)
    return lines + _alternatives_table(profile, chosen, ctx)


def _alternatives_table(profile: ModelProfile, chosen: Layout, ctx: PlanContext) -> list[str]:
    """The table of the layouts dry_run compares with ``chosen`` (marked *)."""
    lines: list[str] = []
    if chosen.multi_axis:
        layouts = axis_alternatives(chosen, ctx.world_size, ctx.ranks_per_node)
    else:
        layouts = alternatives(ctx.world_size, ctx.ranks_per_node)
    if chosen.ep > 1:  # the chosen expert-parallel degree, on the layouts it applies to
        layouts = [replace(lay, ep=chosen.ep) if expert_degree(replace(lay, ep=chosen.ep), profile) > 1 else lay
                   for lay in layouts]  # fmt: skip
    if chosen not in layouts:
        layouts.insert(0, chosen)
    cap = f"of {_capacity(ctx.capacity)}" if ctx.capacity else "of ?"
    width = max(40, *(len(layout.label(ctx.world_size)) for layout in layouts))
    lines.append(
        f"  {'layout':<{width}} {'peak GiB':>9} {'state':>7} {'gathered':>9} {'activ.':>7} {'host':>6} "
        f"{'sent/step':>10} {'device':>7} {cap:>7}"
    )
    for layout in layouts:
        e = estimate(profile, layout, ctx)
        mark = "*" if layout == chosen else " "
        share = _share(e.device_peak, ctx.capacity)
        lines.append(
            f"{mark} {layout.label(ctx.world_size):<{width}} {_gib(e.peak):>9} {_gib(e.state):>7} "
            f"{_gib(e.gathered):>9} {_gib(e.activations):>7} {_gib(e.host):>6} {e.comm_bytes / GiB:>9.2f}G "
            f"{_gib(e.device_peak):>7} {share:>7}"
        )
    if ctx.device == "cpu":
        lines.append("  (planned for a CPU, where cpu_offload moves nothing; on GPUs it frees device memory)")
    else:
        lines.append(
            f"  (planned for {ctx.target}, {ctx.ranks_per_node} ranks per machine; peak: the allocator's peak of "
            "live tensors; device: what the GPU must have, with rounding, fragmentation, context and NCCL; host: "
            "what cpu_offload keeps in each rank's host memory)"
        )
    return lines


def axes_line(est: MemoryEstimate, ctx: PlanContext) -> str:
    """The model axes of a multi-axis layout: its stages, micro-batches in flight, bubble, and traffic by axis."""
    layout, axes = est.layout, est.axes
    assert axes is not None  # only asked for a multi-axis estimate
    text = "  axes:"
    if layout.pp > 1:
        stages = ", ".join(str(len(s)) for s in axes.stage_layers[axes.rank])
        text += (
            f" pipeline rank {axes.rank} of {layout.pp} is the fullest: stages of {stages} units; "
            f"{ctx.update_freq} micro-batches, {axes.in_flight} in flight at its peak; bubble "
            f"{axes.bubble:.0%} ({layout.schedule});"
        )
    if layout.tp > 1:
        text += f" TP {layout.tp} with sequence-parallel activations (each rank keeps 1/{layout.tp});"
    if layout.cp > 1:
        text += f" CP {layout.cp} (each rank keeps 1/{layout.cp} of each sequence; keys and values pass around a ring);"
    sent = ", ".join(f"{name.upper()} {n / GiB:.2f}" for name, n in axes.traffic.items() if n)
    return text + f" sends per step (GiB): {sent or 'nothing'}"


def _capacity(capacity: int) -> str:
    """The device column's capacity in GiB, with the digits a small one needs (this machine's memory shared by many
    planned ranks is a fraction of a GiB: 'of 0' said nothing)."""
    gib = capacity / GiB
    return f"{gib:.0f}" if gib >= 10 else f"{gib:.1f}" if gib >= 1 else f"{gib:.3f}"


def _share(needed: float, capacity: int) -> str:
    """What a layout needs as a share of the device; over 10 times what it has is '>999%' (a figure like 32884256%
    only says it does not fit)."""
    if not capacity:
        return "?"
    return ">999%" if needed > 9.99 * capacity else f"{needed / capacity:.0%}"


def attention_kernel(ctx: PlanContext) -> str:
    """Which fused attention the planned device runs and what it keeps: the plan counts q, k, v, the output and one
    float per query row (no length x length scores) on every device (shardlab.memory.profile._FusedAttentionShapes)."""
    if ctx.device == "cuda":
        kernel = "flash" if ctx.param_bytes == 2 else "memory-efficient (fp32: flash needs bf16/fp16)"
        return f"{kernel} SDPA on {ctx.target}: q, k, v, output and a logsumexp per row kept; no length x length scores"
    return "torch's CPU flash SDPA kernel: q, k, v, output and a logsumexp per row kept; no length x length scores"
