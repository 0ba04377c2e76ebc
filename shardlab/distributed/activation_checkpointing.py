"""Activation checkpointing per unit: recompute a unit's activations in backward instead of keeping them."""

from __future__ import annotations

from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper


def wrap_units(model: nn.Module, units: list[nn.Module]) -> list[nn.Module]:
    """Replace each unit in its parent by a checkpoint wrapper; returns the wrappers, in the same order.

    The wrapper adds `_checkpoint_wrapped_module.` to parameter names; torch.distributed.checkpoint's state-dict
    helpers strip it, so checkpoints stay loadable with checkpointing on or off.
    """
    wrapped = {id(u): checkpoint_wrapper(u) for u in units}
    for parent in list(model.modules()):
        for child_name, child in list(parent.named_children()):
            if id(child) in wrapped:
                parent.register_module(child_name, wrapped[id(child)])
    return [wrapped[id(u)] for u in units]
