"""The model's shape before anything is allocated: its size and its FSDP units (the bytes per rank are
shardlab.memory_plan's)."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn


def count_params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def describe_plan(model: nn.Module, units: list[nn.Module], cfg) -> list[str]:
    """Lines for the console: the model's size and its FSDP units (the task's, else the generic size policy's) with
    their parameters. ``cfg`` is the distributed section."""
    return list(_plan_lines(model, units, cfg))


def wrapped_units(model: nn.Module, units: list[nn.Module], cfg) -> list[nn.Module]:
    """The units a sharded run wraps: the task's, else (fully_sharded or auto) the generic size policy's."""
    if units or cfg.backend not in ("fully_sharded", "auto"):
        return list(units)
    from shardlab.distributed.fully_sharded import generic_units

    return generic_units(model, cfg.wrap_min_num_params)


def _plan_lines(model: nn.Module, units: list[nn.Module], cfg) -> Iterator[str]:
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
