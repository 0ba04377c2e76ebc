"""What an MoE model does after each optimizer step (issue 49, item 4): DeepSeek-V3's bias balancing update, and the
warning line when an expert has received no token for ``model.moe.idle_expert_warning_steps`` steps.

Both read the step's load: each layer's assignments per expert, summed over the step's training micro-batches on
this rank (``StepLoad.add``, from the task's loss) and then over the data-parallel ranks (one all-reduce), so every
rank holds the same numbers and decides the same: the biases stay identical on every rank (the router is
replicated, and a checkpoint saves the one value), and one load means the same warning at any layout. The bias
moves only after a step whose update was applied (a step skipped for non-finite gradients leaves the model as it
was); the idle count runs on every step.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from shardlab_tasks.lm.config import MoEConfig
from shardlab_tasks.lm.models.moe import MoEBlock


class StepLoad:
    """Each MoE layer's assignments per expert over the current step, and each expert's run of steps without any."""

    def __init__(self, cfg: MoEConfig) -> None:
        self.cfg = cfg
        self.load: torch.Tensor | None = None
        """(layers, experts) this rank's assignments since the last optimizer step (int64)."""
        self.idle_steps: torch.Tensor | None = None
        """(layers, experts) consecutive steps each expert got no assignment on any rank."""

    @property
    def active(self) -> bool:
        """Whether anything reads the load after a step (the bias update or the warning), else nothing is kept."""
        return (self.cfg.score_bias and self.cfg.bias_update_rate > 0) or self.cfg.idle_expert_warning_steps > 0

    def add(self, tokens_per_expert: list[torch.Tensor]) -> None:
        """One training micro-batch's per-layer loads (RoutingStats.tokens_per_expert, in layer order)."""
        if not self.active or not tokens_per_expert or tokens_per_expert[0].is_meta:  # the memory plan's trace
            return
        load = torch.stack(tokens_per_expert).detach()
        self.load = load if self.load is None else self.load + load

    def after_update(
        self, model: nn.Module, all_reduce_sum: Callable[[torch.Tensor], torch.Tensor], applied: bool
    ) -> list[str]:
        """The step's load summed over the data-parallel ranks; the biases moved if ``applied``; the warning lines
        (one per step at most) for experts that just reached idle_expert_warning_steps idle steps."""
        if self.load is None:
            return []
        load, self.load = all_reduce_sum(self.load), None
        if applied:
            for block, layer_load in zip(moe_blocks(model), load, strict=True):
                block.update_score_bias(layer_load)
        limit = self.cfg.idle_expert_warning_steps
        if limit <= 0:
            return []
        idle = torch.zeros_like(load) if self.idle_steps is None else self.idle_steps
        self.idle_steps = torch.where(load == 0, idle + 1, 0)
        just_idle = (self.idle_steps == limit).nonzero().tolist()
        if not just_idle:
            return []
        return [
            f"warning: model.moe: {idle_list(just_idle)} received no token for {limit} steps in a row "
            "(model.moe.idle_expert_warning_steps): "
            "the router sends its tokens elsewhere; raise model.moe.aux_loss_coef or turn on bias balancing "
            "(model.moe.score_bias=true, model.moe.bias_update_rate)"
        ]


def idle_list(pairs: list[list[int]], shown: int = 8) -> str:
    """'layer 0: 3 experts (1, 4, 7); layer 2: 1 expert (5)' of (layer, expert) pairs, at most ``shown`` experts
    named per layer."""
    parts = []
    for layer in sorted({layer for layer, _ in pairs}):
        experts = [expert for at, expert in pairs if at == layer]
        names = ", ".join(map(str, experts[:shown])) + (", ..." if len(experts) > shown else "")
        parts.append(f"layer {layer}: {len(experts)} expert{'s' if len(experts) > 1 else ''} ({names})")
    return "; ".join(parts)


def moe_blocks(model: nn.Module) -> list[MoEBlock]:
    """The model's MoE blocks in layer order (the order their RoutingStats come in)."""
    return [module for module in model.modules() if isinstance(module, MoEBlock)]
