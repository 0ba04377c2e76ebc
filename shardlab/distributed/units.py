"""The model's shape before anything is allocated: its size and its FSDP units (the bytes per rank are
shardlab.memory.plan's)."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn


def count_params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def describe_units(model: nn.Module, units: list[nn.Module], cfg) -> list[str]:
    """Lines for the console: the model's size and its FSDP units (the task's, else the generic size policy's) with
    their parameters. ``cfg`` is the distributed section."""
    return list(_unit_lines(model, units, cfg))


def wrapped_units(model: nn.Module, units: list[nn.Module], cfg) -> list[nn.Module]:
    """The units a sharded run wraps: the task's, else (fully_sharded or auto) the generic size policy's."""
    if units or cfg.backend not in ("fully_sharded", "auto"):
        return list(units)
    return generic_units(model, cfg.wrap_min_num_params)


def generic_units(model: nn.Module, min_num_params: int) -> list[nn.Module]:
    """For models without a unit plan: the largest submodules holding >= min_num_params params that do not contain
    another such submodule (a size-based auto-wrap policy, as FSDP1's size_based_auto_wrap_policy)."""
    if min_num_params <= 0:
        return []
    units: list[nn.Module] = []

    def visit(module: nn.Module) -> int:
        own = sum(p.numel() for p in module.parameters(recurse=False))
        rest = 0
        for child in module.children():
            rest += visit(child)
        remaining = own + rest
        if module is not model and remaining >= min_num_params:
            units.append(module)
            return 0  # its params now live in its own unit
        return remaining

    visit(model)
    return units


def _unit_lines(model: nn.Module, units: list[nn.Module], cfg) -> Iterator[str]:
    units = wrapped_units(model, units, cfg) if cfg.backend == "fully_sharded" else []
    total = count_params(model)
    names = {id(m): n for n, m in model.named_modules()}
    yield f"model: {total:,} parameters ({total * 4 / 2**30:.2f} GiB in fp32)"
    if units:
        in_units = 0
        yield f"FSDP units ({len(units)} + root):"
        for u in units:
            n = count_params(u)
            in_units += n
            yield f"  {names.get(id(u), type(u).__name__):<24} {type(u).__name__:<20} {n:>14,}"
        yield f"  {'(root)':<24} {type(model).__name__:<20} {total - in_units:>14,}"


def meta_model(build) -> nn.Module:
    with torch.device("meta"):
        return build()


def model_on_meta(task) -> nn.Module:
    """The task's model on the meta device, nothing allocated: what a run's assembly (shardlab.trainer.assemble) builds
    and hands to its plan, and what a plan-only caller (a dry run, verify_plan, the tools) builds to plan with."""
    return meta_model(task.build_model)
