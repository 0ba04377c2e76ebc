"""The memory plan of a run: what one rank will hold at its peak, predicted before anything is allocated, for the
configured layout and for the alternatives (ddp, fully_sharded with or without resharding, hybrid degrees, activation
checkpointing, CPU offload). ``plan_run`` is a run's planning step (the units and bytes per rank of the model its
caller built on meta, the lines printed before it allocates); what distributed.backend=auto chooses from the plan is
shardlab.memory.budget's.

The plan is three parts, entered here: the model's profile on meta (shardlab.memory.profile), the layouts
(shardlab.memory.layout), and each layout's bytes and the console's lines (shardlab.memory.estimate).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from shardlab.distributed.units import describe_units, wrapped_units
from shardlab.memory import devices
from shardlab.memory.estimate import MemoryEstimate, PlanContext, describe, estimate
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
    local_batch = cfg.optimization.batch_size // world_size
    units = wrapped_units(model, units, cfg.distributed)
    param_dtype = resolve_dtypes(cfg.distributed)[0]
    profile = profile_model(model, units, task, local_batch, param_dtype)
    if param_dtype != torch.float32:  # single and ddp reach it through autocast: profiled as they run
        profile.autocast = profile_model(model, units, task, local_batch, param_dtype, autocast_device=device)
    return profile, ctx


def plan_target(cfg, world_size: int) -> tuple[str, str, int, int]:
    """distributed.plan_device resolved: (cpu or cuda, the device's name, its memory per rank, ranks per machine)."""
    import os

    from shardlab.distributed import env as dist_env
    from shardlab.errors import ConfigError

    name = cfg.distributed.get("plan_device", "auto")  # configs recorded before the key existed lack it
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
