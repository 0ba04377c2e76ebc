"""Materialize a model built on the meta device and initialise it identically on every rank, without a broadcast.

Each parameter's full value is drawn from a generator seeded by (seed, parameter name), so the result depends on
neither the wrap order nor the world size: a sharded rank keeps only its chunk of the same full tensor that a single
process would hold. One full parameter exists at a time, so peak extra memory is the largest parameter.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

InitFn = Callable[[str, torch.Tensor, torch.Generator], None]
"""Fills a full (unsharded) tensor in place, given its fully qualified name and a seeded generator."""


def _generator(seed: int, name: str) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    return g


@torch.no_grad()
def materialize(
    model: nn.Module, device: torch.device, init_fn: InitFn, seed: int, loaded: Callable[[str], bool] | None = None
) -> None:
    """``to_empty`` on ``device`` then fill every parameter and buffer through ``init_fn``, except those ``loaded``
    names: weights a file will overwrite before anything reads them (Task.pretrained_keys), left as allocated, since
    drawing them would cost time that grows with the model (minutes at 8B on a CPU) for values never used. Each name
    has its own generator, so skipping some leaves the others' values as they were."""
    shared = shared_parameter_slots(model)
    model.to_empty(device=device)
    # to_empty gives every module its own new tensor, silently untying shared weights (tied embeddings): re-tie.
    for slots in shared:
        first_module, first_name = slots[0]
        for module, name in slots[1:]:
            module._parameters[name] = first_module._parameters[first_name]
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        name = clean_name(name)
        if loaded is not None and loaded(name):
            continue
        if isinstance(tensor, DTensor):
            full = torch.empty(tensor.shape, dtype=tensor.dtype)
            init_fn(name, full, _generator(seed, name))
            local = distribute_tensor(full, tensor.device_mesh, tensor.placements, src_data_rank=None).to_local()
            tensor.to_local().copy_(local)
        else:
            full = torch.empty(tensor.shape, dtype=tensor.dtype)
            init_fn(name, full, _generator(seed, name))
            tensor.copy_(full)


def shared_parameter_slots(model: nn.Module) -> list[list[tuple[nn.Module, str]]]:
    """(module, attribute) slots that hold the same parameter object, for every parameter held by more than one."""
    slots: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is not None:
                slots.setdefault(id(param), []).append((module, name))
    return [s for s in slots.values() if len(s) > 1]


def clean_name(name: str) -> str:
    """Strip wrapper prefixes (activation checkpointing, DDP) so names match the unwrapped model's."""
    return name.replace("_checkpoint_wrapped_module.", "").removeprefix("module.")
