"""Memory as a config key: distributed.memory_budget_gb checked before launch, and the layouts the memory plan
(shardlab.memory.plan) predicts to fit it, for distributed.backend=auto.

With distributed.auto_tune (the default) the ranks measure those layouts and keep the fastest
(shardlab.runner.autotune); here it is only checked that one fits. With auto_tune=false auto takes the first that fits
in a fixed order (cheap: nothing measured). Every rank resolves the same config with the same inputs (world size,
ranks per machine, device type) and a fixed runtime allowance, so all of them make the same choice without a
collective; a local launch resolves it once, before spawning, and hands the ranks the resolved config.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from dataclasses import dataclass, replace

from shardlab.errors import ConfigError
from shardlab.memory.devices import GiB
from shardlab.memory.estimate import MemoryEstimate, PlanContext, estimate
from shardlab.memory.layout import Layout, alternatives, layout_of
from shardlab.memory.plan import profile_config
from shardlab.memory.profile import ModelProfile

RUNTIME_ALLOWANCE = int(1.0 * GiB)
"""What an idle rank already uses before the plan's bytes (torch, the process group, the data; a CPU plan's only
allowance, as a CUDA plan counts its context and buffers itself): added when a plan is held against
distributed.memory_budget_gb. A constant, not a measurement of this process, so every rank of a job decides the same
thing. Measured on CPU: 0.68-0.88 GiB resident for one install of torch 2.14.1, as its shared libraries' mapped pages
vary by ~200 MiB with the page cache (`import torch` alone: 508 MiB, or 718 MiB right after the install wrote them);
0.5 GiB let a budget test's rank exceed the budget it was planned into."""

PLAN_MARGIN = 1.10
"""A layout fits a budget when its predicted peak times this, plus RUNTIME_ALLOWANCE, is within it."""


def auto_candidates(world_size: int, ranks_per_node: int, sharded_only: bool) -> list[Layout]:
    """What distributed.backend=auto tries, fastest first: no sharding, then sharding without re-gathering in
    backward (hybrid over a machine first when there are several), full sharding, then recomputation (about a third
    more compute), then offload (state crosses the host link every step)."""
    layouts = [
        layout
        for layout in alternatives(world_size, ranks_per_node)
        if layout.sharding_degree in (1, world_size, ranks_per_node) or layout.backend != "fully_sharded"
    ]
    if sharded_only:
        layouts = [layout for layout in layouts if layout.backend == "fully_sharded"]
    return layouts


@dataclass(frozen=True)
class ModelAxes:
    """The model axes backend=auto may add to the data-parallel layouts, as the task allows them."""

    tp_degrees: tuple[int, ...]
    """Tensor-parallel degrees the task can split over (inside one machine, dividing the world)."""
    pp_degrees: tuple[int, ...]
    """Pipeline degrees the task can be cut into (with at least that many micro-batches: optimization.update_freq)."""
    profile_at: Callable[[Layout], ModelProfile]
    """The model's profile at a layout's samples per data-parallel rank (fewer data ranks: more samples each)."""


def axis_candidates(axes: ModelAxes, world_size: int) -> list[Layout]:
    """The layouts with model axes, fastest first: TP inside a machine with FSDP over the rest, smallest TP first;
    then with activation checkpointing; then TP x PP under 1F1B and interleaved 1F1B (the pipeline's bubble), with
    activation checkpointing."""
    out = []
    for checkpointing in (False, True):
        for tp in axes.tp_degrees:
            out.append(Layout("fully_sharded", world_size // tp, tp=tp, activation_checkpointing=checkpointing))
    for tp in (max(axes.tp_degrees, default=1),):
        for pp in axes.pp_degrees:
            if world_size % (tp * pp) == 0 and world_size > tp * pp:
                base = Layout("fully_sharded", world_size // (tp * pp), tp=tp, pp=pp, activation_checkpointing=True)
                out += [base, replace(base, schedule="interleaved_1f1b", stages_per_rank=2)]
    return out


def task_axes(cfg, task, world_size: int, model, ranks_per_node: int) -> ModelAxes | None:
    """What ``task`` allows (Task.tensor_parallel_plan and tensor_parallel_errors, Task.pipeline_cut, where the task
    has them) at ``world_size``; None when it allows neither."""
    ask_tp, ask_pp = getattr(task, "tensor_parallel_plan", None), getattr(task, "pipeline_cut", None)
    tp: tuple[int, ...] = ()
    if ask_tp is not None and ask_tp(model) is not None:
        errors = getattr(task, "tensor_parallel_errors", lambda degree: [])
        tp = tuple(d for d in (2, 4, 8) if d <= ranks_per_node and world_size % d == 0 and not errors(d))
    pp: tuple[int, ...] = ()
    if ask_pp is not None and ask_pp() is not None:
        pp = tuple(d for d in (2, 4, 8) if d <= cfg.optimization.update_freq and world_size % d == 0)
    if not tp and not pp:
        return None

    def profile_at(layout: Layout) -> ModelProfile:
        at = copy.deepcopy(cfg)
        for key, value in layout.overrides(world_size).items():
            at.distributed[key] = value
        return profile_config(at, task, world_size, model)[0]

    return ModelAxes(tp, pp, profile_at)


def budget_per_rank(d, ranks_per_node: int) -> int:
    """distributed.memory_budget_gb in bytes per rank."""
    budget = d.memory_budget_gb * GiB
    return int(budget / ranks_per_node if d.memory_budget_per == "machine" else budget)


def needed(est: MemoryEstimate) -> int:
    """Bytes per rank a layout needs from the budget: its peak with margin, plus an idle rank's runtime. A CUDA plan
    counts what is outside the tensors itself (allocator, context, NCCL: MemoryEstimate.device_peak), so the margin
    applies to the tensors only and no allowance is added."""
    if est.outside:
        return int(est.peak * PLAN_MARGIN) + est.allocator + est.outside
    return int(est.peak * PLAN_MARGIN) + RUNTIME_ALLOWANCE


@dataclass
class Choice:
    layout: Layout
    estimate: MemoryEstimate
    reason: str


def candidates(ctx: PlanContext, sharded_only: bool, axes: ModelAxes | None) -> list[Layout]:
    """auto_candidates, with the model axes' layouts (``axes``) before the ones that recompute or offload."""
    layouts = auto_candidates(ctx.world_size, ctx.ranks_per_node, sharded_only)
    if axes is None:
        return layouts
    light = [layout for layout in layouts if not (layout.activation_checkpointing or layout.cpu_offload)]
    return light + axis_candidates(axes, ctx.world_size) + [layout for layout in layouts if layout not in light]


def fitting(
    profile: ModelProfile, cfg, ctx: PlanContext, sharded_only: bool = False, axes: ModelAxes | None = None
) -> list[Choice]:
    """Every layout of ``candidates`` predicted to fit distributed.memory_budget_gb, in their order; raises
    ConfigError naming the smallest budget that would fit when none does. ``axes``: the model axes the task allows
    (task_axes), each of their layouts planned at its own samples per data-parallel rank."""
    d = cfg.distributed
    budget = budget_per_rank(d, ctx.ranks_per_node)
    scale = ctx.ranks_per_node if d.memory_budget_per == "machine" else 1
    fits, tried = [], []
    for layout in candidates(ctx, sharded_only, axes):
        at = axes.profile_at(layout) if axes is not None and layout.multi_axis else profile
        est = estimate(at, layout, ctx)
        if needed(est) <= budget:
            skipped = ", ".join(f"{label} needs {need / GiB:.2f}" for label, need in tried)
            reason = f"fits in {d.memory_budget_gb:g} GiB per {d.memory_budget_per}"
            fits.append(Choice(layout, est, reason + (f" ({skipped} GiB per rank)" if skipped else "")))
        tried.append((layout.label(ctx.world_size), needed(est)))
    if fits:
        return fits
    label, need = min(tried, key=lambda t: t[1])
    smallest = math.ceil(need * scale / GiB * 100) / 100  # rounded up: that budget does fit
    raise ConfigError(
        f"distributed.memory_budget_gb={d.memory_budget_gb:g} (per {d.memory_budget_per}) fits no layout at world size "
        f"{ctx.world_size}: the smallest ({label}) needs {smallest:.2f} GiB per {d.memory_budget_per}; raise the "
        "budget, lower optimization.batch_size, or add ranks"
    )


def choose(
    profile: ModelProfile, cfg, ctx: PlanContext, sharded_only: bool = False, axes: ModelAxes | None = None
) -> Choice:
    """The first layout of ``candidates`` predicted to fit distributed.memory_budget_gb (the fixed preference,
    distributed.auto_tune=false)."""
    return fitting(profile, cfg, ctx, sharded_only, axes)[0]


def sharded_only(d) -> bool:
    """Keys only fully_sharded has (set away from their defaults) keep backend=auto on sharded layouts."""
    from shardlab.config import DistributedConfig

    defaults = DistributedConfig()
    return any(d[key] != getattr(defaults, key) for key in ("prefetch_units", "reduce_scatter", "wrap_min_num_params"))


def apply_choice(cfg, choice: Choice, world_size: int) -> None:
    """Write the chosen layout into cfg.distributed (and cpu_adam for an offloaded adamw)."""
    for key, value in choice.layout.overrides(world_size).items():
        cfg.distributed[key] = value
    if choice.layout.cpu_offload and cfg.optimizer.name == "adamw":
        cfg.optimizer.name = "cpu_adam"  # the same update, fused over the offloaded shards on the CPU


def resolve(cfg, task, world_size: int, model) -> str | None:
    """Apply distributed.memory_budget_gb to ``cfg``: backend=auto becomes the chosen layout (written into cfg), an
    explicit backend predicted over the budget is refused (ConfigError). Returns a line saying what was chosen.
    ``model``: the task's model on meta, built by the caller (shardlab.distributed.units.model_on_meta)."""
    d = cfg.distributed
    if d.memory_budget_gb <= 0:
        return None
    profile, ctx = profile_config(cfg, task, world_size, model)
    axes = task_axes(cfg, task, world_size, model, ctx.ranks_per_node) if d.backend == "auto" else None
    if d.backend == "auto" and not ctx.local:  # another machine's device: nothing can be measured on it from here
        choice = choose(profile, cfg, ctx, sharded_only(d), axes)
        apply_choice(cfg, choice, world_size)
        return (
            f"distributed.backend=auto chose {choice.layout.label(world_size)} for {ctx.target} by the plan alone (no "
            f"trial can run on a {ctx.target} from this machine, so distributed.auto_tune measured nothing): "
            f"{choice.reason}"
        )
    if d.backend == "auto" and d.auto_tune:  # measured on the ranks (shardlab.runner.autotune); check a fit exists
        fits = fitting(profile, cfg, ctx, sharded_only(d), axes)
        return (
            f"distributed.backend=auto: {len(fits)} layout(s) fit {d.memory_budget_gb:g} GiB per "
            f"{d.memory_budget_per}; the ranks measure them and their micro-batch splits, and keep the fastest"
        )
    if d.backend == "auto":
        choice = choose(profile, cfg, ctx, sharded_only(d), axes)
        apply_choice(cfg, choice, world_size)
        return f"distributed.backend=auto chose {choice.layout.label(world_size)}: {choice.reason}"
    est = estimate(profile, layout_of(d, world_size), ctx)
    budget = budget_per_rank(d, ctx.ranks_per_node)
    if needed(est) > budget:
        raise ConfigError(
            f"distributed.memory_budget_gb={d.memory_budget_gb:g} (per {d.memory_budget_per}): the memory plan "
            f"predicts {needed(est) / GiB:.2f} GiB per rank for {layout_of(d, world_size).label(world_size)} "
            "(peak with margin, plus an idle rank's runtime); use distributed.backend=auto to pick a layout that fits"
        )
    return None
