"""A run that diverged: its loss not finite on optimization.max_nonfinite_steps steps in a row, or its weights gone NaN
or inf when a save comes. Either ends the run failed (TrainingDiverged) and saves nothing: NaN does not train back to
a number, and ending "completed" with a NaN checkpoint hid it. Both are agreed over ranks, so every rank stops at the
same step.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from shardlab.errors import TrainingDiverged


class NonfiniteStreak:
    """Steps in a row whose loss was not finite on some rank; at ``limit`` (optimization.max_nonfinite_steps) the run
    ends."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.steps = 0

    def count(
        self, nonfinite: bool, step: int, kept: Callable[[], str], log: Callable[[str], None], cause: Callable[[], str]
    ) -> None:
        """One more step (``step``, agreed over ranks) whose loss was not finite, or the streak ends. ``kept``: what
        the run has to go back to (Checkpointer.kept), named when the run ends; ``cause``: the advice for what was
        found (nonfinite_cause), asked then, on every rank (it may agree over ranks)."""
        limit = self.limit
        self.steps = self.steps + 1 if nonfinite else 0
        if nonfinite:
            log(f"[train] WARNING: the loss is not finite at step {step} ({self.steps} of {limit} in a row)")
        if self.steps >= limit:
            raise TrainingDiverged(
                f"the loss was not finite (NaN or inf) on {limit} steps in a row, the last step {step} "
                f"(optimization.max_nonfinite_steps={limit}); nothing non-finite was saved, "
                f"{kept()}; {cause()}"
            )


def nonfinite_cause(learning_rates: list[float], weights_finite: Callable[[], bool]) -> str:
    """The advice for a diverged run, by the cause found: a learning rate that is not finite (a schedule, or resumed
    state), else the weights (``weights_finite``: agreed over ranks), else the usual suspects."""
    bad = next((lr for lr in learning_rates if not math.isfinite(float(lr))), None)
    if bad is not None:
        return f"the learning rate is {float(bad)} (set by lr_scheduler or a resumed checkpoint): fix that first"
    if not weights_finite():
        return "the weights themselves are not finite (a resumed or init_from checkpoint, or an earlier step)"
    return "lower optimizer.lr or optimization.clip_norm, or look at that data"


@torch.no_grad()
def weights_finite(model: nn.Module, any_rank: Callable[..., list[bool]]) -> bool:
    """Whether every parameter of ``model`` is finite on every rank (each checks its own shards; ``any_rank``: the
    backend's agreement)."""
    local = [p.to_local() if hasattr(p, "to_local") else p for p in model.parameters()]
    # amax and amin carry NaN and inf through without a temporary the size of the tensor (isfinite makes one).
    ends = [e for t in local if t.is_floating_point() and t.numel() for e in (t.amax(), t.amin())]
    finite = not ends or bool(torch.isfinite(torch.stack(ends)).all())
    return not any_rank(not finite)[0]


def require_finite_weights(
    model: nn.Module, any_rank: Callable[..., list[bool]], step: int, kept: Callable[[], str]
) -> None:
    """Raise TrainingDiverged unless every parameter of ``model`` is finite on every rank (weights_finite). Asked
    before every save."""
    if not weights_finite(model, any_rank):
        raise TrainingDiverged(
            f"the weights are not finite (NaN or inf) at step {step}: not saved, {kept()}; lower optimizer.lr or "
            "optimization.clip_norm"
        )
