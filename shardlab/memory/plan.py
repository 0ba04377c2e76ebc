"""The memory plan of a run: what one rank will hold at its peak, predicted before anything is allocated, for the
configured layout and for the alternatives (ddp, fully_sharded with or without resharding, hybrid degrees, activation
checkpointing, CPU offload). ``plan_run`` is a run's planning step (the units and bytes per rank of the model its
caller built on meta, the lines printed before it allocates); what distributed.backend=auto chooses from the plan is
shardlab.memory.budget's.

The plan is three parts, entered here: the model's profile on meta (shardlab.memory.profile), the layouts
(shardlab.memory.layout), and each layout's bytes and the console's lines (shardlab.memory.estimate).

A run profiles its model once: inside ``one_profile_per_run`` (a rank's run, shardlab.runner) everything that asks
for the same model's profile again (backend=auto's budget and its trials, the run's own assembly) is handed the one
already made; the layouts and their bytes are cheap arithmetic on it, made for each asker's config.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from shardlab.distributed.units import describe_units, wrapped_units
from shardlab.memory import devices
from shardlab.memory.console import describe
from shardlab.memory.estimate import MemoryEstimate, PlanContext, estimate
from shardlab.memory.experts import expert_profile
from shardlab.memory.layout import layout_of
from shardlab.memory.profile import ModelProfile, profile_model


def profile_config(
    cfg, task, world_size: int, model: nn.Module, units: list[nn.Module] | None = None
) -> tuple[ModelProfile, PlanContext]:
    """Profile ``model`` (the task's, on meta, built by the caller: shardlab.distributed.units.model_on_meta) for
    ``cfg`` at ``world_size`` ranks. ``units``: the task's FSDP units of ``model`` (default: asked of the task)."""
    from shardlab.distributed.base import resolve_dtypes

    if units is None:
        units = task.fsdp_units(model)
    device, target, capacity, per_node = plan_target(cfg, world_size)
    ctx = PlanContext.from_config(cfg, world_size, per_node, device, target, capacity)
    # Each data-parallel rank's share of a micro-batch (tensor, pipeline and context ranks see the same samples)
    local_batch = cfg.optimization.batch_size // layout_of(cfg.distributed, world_size).data_ranks(world_size)
    units = wrapped_units(model, units, cfg.distributed)
    param_dtype = resolve_dtypes(cfg.distributed)[0]
    made = _RUN_PROFILES.get()
    if made is None:  # not inside a run: profiled for this caller alone
        return _profile(model, units, task, local_batch, param_dtype, device), ctx
    key = _profile_key(task, model, units, local_batch, param_dtype, device)
    if key not in made:
        made[key] = (task, _profile(model, units, task, local_batch, param_dtype, device))  # task kept: id not reused
    return made[key][1], ctx


def _profile(model: nn.Module, units, task, local_batch: int, param_dtype: torch.dtype, device: str) -> ModelProfile:
    profile = profile_model(model, units, task, local_batch, param_dtype)
    if param_dtype != torch.float32:  # single and ddp reach it through autocast: profiled as they run
        profile.autocast = profile_model(model, units, task, local_batch, param_dtype, autocast_device=device)
    ask = getattr(task, "expert_layers", None)  # a task method (tasks made outside shardlab.task.Task may lack it)
    profile.experts = expert_profile(model, units, ask(model) if ask is not None else None)
    if profile.autocast is not None:
        profile.autocast.experts = profile.experts
    return profile


_RUN_PROFILES: contextvars.ContextVar[dict | None] = contextvars.ContextVar("run_profiles", default=None)
"""The profiles made in the run open now (one_profile_per_run), by _profile_key; None outside a run."""


@contextlib.contextmanager
def one_profile_per_run() -> Iterator[None]:
    """Within the block (a run), profile_config profiles each model once: asked again for the same task's model of
    the same shape, units, micro-batch and dtype, it hands back the profile it made. A block inside another is the
    outer run's."""
    if _RUN_PROFILES.get() is not None:
        yield
        return
    token = _RUN_PROFILES.set({})
    try:
        yield
    finally:
        _RUN_PROFILES.reset(token)


def _profile_key(task, model: nn.Module, units, local_batch: int, dtype: torch.dtype, device: str) -> tuple:
    """What a profile depends on: the task (its example batch and loss), the model's modules and parameter shapes
    (a fresh model_on_meta of the same task gives the same), which modules are the units, the micro-batch, the dtype
    the meta forward casts to, the device autocast is planned for, and the process group a loss's collectives see."""
    names = {id(m): name for name, m in model.named_modules()}
    return (
        id(task),
        tuple((name, type(m).__qualname__) for name, m in model.named_modules()),
        tuple((name, tuple(p.shape), p.dtype) for name, p in model.named_parameters()),
        tuple(names.get(id(u), type(u).__qualname__) for u in units),
        local_batch,
        dtype,
        device,
        dist.get_world_size() if dist.is_initialized() else 1,
    )


def plan_target(cfg, world_size: int) -> tuple[str, str, int, int]:
    """distributed.plan_device resolved: (cpu or cuda, the device's name, its memory per rank, ranks per machine)."""
    import os

    from shardlab.distributed import env as dist_env
    from shardlab.errors import ConfigError

    name = getattr(cfg.distributed, "plan_device", "auto")  # configs recorded before the key existed lack it
    per_node = dist_env.ranks_per_node(world_size)
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cpu":
        return "cpu", "cpu", devices.machine_ram() // max(1, min(per_node, world_size)), per_node
    if name == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(
                "distributed.plan_device=cuda plans for this machine's GPU, but it has none; name the GPU to plan "
                f"for: {', '.join(devices.DEVICES)}"
            )
        props = torch.cuda.get_device_properties(0)
        return "cuda", props.name, props.total_memory, per_node
    if name not in devices.DEVICES:
        raise ConfigError(devices.unknown_device_message(name))
    target = devices.DEVICES[name]
    launched = os.environ.get("LOCAL_WORLD_SIZE") or "SLURM_PROCID" in os.environ
    # Planned from elsewhere (a laptop), a job on this device has the machines its table entry says.
    per_node = per_node if launched else min(target.ranks_per_node, world_size)
    return target.kind, name, target.memory_bytes, per_node


@dataclass
class RunPlan:
    """What a rank knows before it allocates: the model on meta, its FSDP units, and what the rank will hold."""

    model: nn.Module
    """The task's model on the meta device, as the caller built it (parallelized and materialized by the trainer)."""
    units: list[nn.Module]
    """The task's FSDP units, in forward order (empty: the backend's generic policy decides)."""
    estimate: MemoryEstimate
    """The configured layout's predicted bytes per rank."""
    lines: list[str]
    """The unit plan and the memory plan, for the console (``compare``: with the alternatives' table)."""


def plan_run(cfg, task, world_size: int, model: nn.Module, compare: bool = False) -> RunPlan:
    """List the units of ``model`` (the task's, on meta: built by the caller, shardlab.distributed.units.model_on_meta)
    and predict what each of ``world_size`` ranks will hold. Planning builds nothing: the run's assembly
    (shardlab.trainer.assemble) owns the model from meta to materialized."""
    units = task.fsdp_units(model)
    profile, ctx = profile_config(cfg, task, world_size, model, units)
    layout = layout_of(cfg.distributed, world_size)
    lines = describe_units(model, units, cfg.distributed) + describe(profile, layout, ctx, compare)
    return RunPlan(model, units, estimate(profile, layout, ctx), lines)
