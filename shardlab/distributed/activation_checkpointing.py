"""Activation checkpointing per unit: recompute a unit's activations in backward instead of keeping them.

distributed.activation_checkpointing chooses how much (torchtitan's modes, through torch's public APIs):
  full             every unit keeps only its input and recomputes the rest in backward;
  selective_layer  every k-th unit (distributed.ac_every_k_units) does so, the others keep everything;
  selective_op     every unit keeps its input and the outputs of the ops in distributed.ac_save_ops (the matmuls and
                   attention, the costly ops) and recomputes the rest (norms, activations, residual adds, RoPE), through
                   torch.utils.checkpoint's selective-checkpoint policy. distributed.ac_matmul_save_every=2 keeps
                   only the 1st, 3rd, ... matmul output of each unit's forward and recomputes the others, as
                   torchtitan's selective op policy does ("save every other mm").
distributed.ac_skip_units names units that never recompute ([0, -1]: a Llama's embedding and output head, which
torchtitan leaves outside checkpointing, wrapping only the transformer blocks).
``checkpointed_units`` is the one place that says which units recompute; the memory plan asks it too.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from shardlab.errors import ConfigError


def _ops(*names: str) -> frozenset:
    """The aten overloads of ``names`` this torch build has (a CPU-only or older build lacks some)."""
    return frozenset(getattr(torch.ops.aten, n).default for n in names if hasattr(torch.ops.aten, n))


SAVE_OP_GROUPS: dict[str, frozenset] = {
    # What F.linear, matmul and @ become below autograd, where the policy sees ops.
    "matmul": _ops("mm", "addmm", "bmm", "baddbmm"),
    # The fused attention kernels: output and logsumexp (recomputing attention costs as much as the matmuls).
    "attention": _ops(
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
    ),
}
"""distributed.ac_save_ops names: the op groups whose outputs selective_op keeps."""


def checkpointed_units(num_units: int, mode: str, every_k: int, skip=()) -> list[int]:
    """Indices of the units that recompute under ``mode``. ``skip`` (distributed.ac_skip_units; negative: from the
    end) never do, and the modes choose among the others: selective_layer the k-th, 2k-th, ... of them, counting from
    1, as torchtitan counts its blocks, so the last units, whose activations backward needs first, are as likely as
    any."""
    if mode == "none":
        return []
    outside = [i for i in skip if not -num_units <= i < num_units]
    if outside:
        raise ConfigError(
            f"distributed.ac_skip_units={list(skip)} names units {outside}, but the task has {num_units} units "
            f"(0 to {num_units - 1}, or -1 to -{num_units} from the end); drop them"
        )
    skipped = {i % num_units for i in skip}
    candidates = [i for i in range(num_units) if i not in skipped]
    if mode == "selective_layer":
        return [i for n, i in enumerate(candidates, 1) if n % every_k == 0]
    return candidates


def save_ops(groups) -> frozenset:
    return frozenset().union(*(SAVE_OP_GROUPS[g] for g in groups))


def _policy(saved: frozenset, ctx, func, *args, **kwargs) -> CheckpointPolicy:
    # A pure function of the op, so torch.compile can apply it in its partitioner as eager does op by op.
    return CheckpointPolicy.MUST_SAVE if func in saved else CheckpointPolicy.PREFER_RECOMPUTE


class _EveryNthMatmul:
    """The policy of one checkpointed forward under ac_matmul_save_every=n: the matmuls counted from 1 in the order
    they run, the 1st, (n+1)-th, ... kept and the others recomputed; every other op as ``_policy``. torch asks the
    policy during forward only and replays its decisions in the recomputation (checkpoint's
    _CachedTorchDispatchMode), so one count per forward suffices; under torch.compile it is asked once per op, in
    the same order, while forward is traced, so inductor's partitioner keeps what eager keeps."""

    def __init__(self, saved: frozenset, every: int) -> None:
        self.saved, self.every, self.count = saved, every, 0

    def __call__(self, ctx, func, *args, **kwargs) -> CheckpointPolicy:
        if func in self.saved and func in SAVE_OP_GROUPS["matmul"]:
            self.count += 1
            keep = (self.count - 1) % self.every == 0
            return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE
        return _policy(self.saved, ctx, func)


def _selective_context(saved: frozenset, matmul_every: int = 1):
    # Called anew for each checkpointed forward: a counting policy starts from its first matmul every time.
    policy = functools.partial(_policy, saved) if matmul_every == 1 else _EveryNthMatmul(saved, matmul_every)
    return create_selective_checkpoint_contexts(policy)


def checkpoint_units(
    model: nn.Module, units: list[nn.Module], cfg, recomputed: Sequence[int] | None = None
) -> list[nn.Module]:
    """Apply ``cfg.activation_checkpointing`` (the distributed section) to ``units``: each unit that recomputes is
    replaced in its parent by a checkpoint wrapper. Returns the units, wrapped where they were, in the same order.
    ``recomputed``: the indices into ``units`` of those that recompute, where the caller decided it over more units
    than it passes (a pipeline stage's, over the whole model's: shardlab.distributed.pipeline.build_pipeline);
    by default checkpointed_units over ``units``."""
    mode = cfg.activation_checkpointing
    if mode == "none":
        return list(units)
    if recomputed is None:
        recomputed = checkpointed_units(len(units), mode, cfg.ac_every_k_units, cfg.ac_skip_units)
    picked = set(recomputed)
    if not picked:
        return list(units)
    context_fn = None
    if mode == "selective_op":
        context_fn = functools.partial(_selective_context, save_ops(cfg.ac_save_ops), cfg.ac_matmul_save_every)
    wrapped = wrap_units(model, [u for i, u in enumerate(units) if i in picked], context_fn)
    it = iter(wrapped)
    return [next(it) if i in picked else u for i, u in enumerate(units)]


def wrap_units(model: nn.Module, units: list[nn.Module], context_fn=None) -> list[nn.Module]:
    """Replace each unit in its parent by a checkpoint wrapper; returns the wrappers, in the same order.
    ``context_fn``: torch.utils.checkpoint's, e.g. a selective-checkpoint policy (non-reentrant checkpointing).

    The wrapper adds `_checkpoint_wrapped_module.` to parameter names; torch.distributed.checkpoint's state-dict
    helpers strip it, so checkpoints stay loadable with checkpointing on or off.
    """
    kwargs = {} if context_fn is None else {"context_fn": context_fn}
    wrapped = {id(u): checkpoint_wrapper(u, **kwargs) for u in units}
    for parent in list(model.modules()):
        for child_name, child in list(parent.named_children()):
            if id(child) in wrapped:
                parent.register_module(child_name, wrapped[id(child)])
    return [wrapped[id(u)] for u in units]
