"""shardlab/optim/divergence.py: a loss not finite for optimization.max_nonfinite_steps steps in a row ends the run,
a finite step ends the streak, and weights not finite on any rank are never saved."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from shardlab.errors import TrainingDiverged
from shardlab.optim.divergence import NonfiniteStreak, require_finite_weights


def kept() -> str:
    return "the newest checkpoint, step_00000004, is kept"


def usual_suspects() -> str:
    return "lower optimizer.lr or optimization.clip_norm, or look at that data"


def test_a_finite_step_ends_the_streak_and_the_limit_in_a_row_ends_the_run():
    lines: list[str] = []
    streak = NonfiniteStreak(limit=3)
    for step, nonfinite in enumerate([True, True, False, True, True], start=1):
        streak.count(nonfinite, step, kept, lines.append, usual_suspects)
    assert lines == [
        "[train] WARNING: the loss is not finite at step 1 (1 of 3 in a row)",
        "[train] WARNING: the loss is not finite at step 2 (2 of 3 in a row)",
        "[train] WARNING: the loss is not finite at step 4 (1 of 3 in a row)",
        "[train] WARNING: the loss is not finite at step 5 (2 of 3 in a row)",
    ]
    with pytest.raises(TrainingDiverged) as raised:
        streak.count(True, 6, kept, lines.append, usual_suspects)
    assert str(raised.value) == (
        "the loss was not finite (NaN or inf) on 3 steps in a row, the last step 6 "
        "(optimization.max_nonfinite_steps=3); nothing non-finite was saved, the newest checkpoint, step_00000004, "
        "is kept; lower optimizer.lr or optimization.clip_norm, or look at that data"
    )


def one_rank(*flags: bool) -> list[bool]:
    return list(flags)


def test_weights_are_checked_on_this_rank_and_agreed_with_the_others():
    model = nn.Linear(3, 2)
    require_finite_weights(model, one_rank, 7, kept)  # finite everywhere: nothing happens
    with pytest.raises(TrainingDiverged, match="another rank"):
        require_finite_weights(model, lambda *flags: [True], 7, lambda: "another rank")  # another rank saw NaN
    with torch.no_grad():
        model.bias[1] = float("inf")
    with pytest.raises(TrainingDiverged) as raised:
        require_finite_weights(model, one_rank, 7, kept)
    assert str(raised.value) == (
        "the weights are not finite (NaN or inf) at step 7: not saved, the newest checkpoint, step_00000004, is kept; "
        "lower optimizer.lr or optimization.clip_norm"
    )
