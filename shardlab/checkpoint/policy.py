"""When a run saves: checkpoint.interval_steps, keep_every_steps milestones and interval_minutes; and after an error,
checkpoint.save_on_error (``save_after_error``), which saves only a consistent state.

The trainer asks at every step end; whether the clock says a save is overdue is read on rank 0 alone (its own
monotonic clock; the clocks of two hosts are never compared) and agreed across ranks before anyone acts on it, so
every rank saves at the same step. A failed periodic save restarts the clock, so that a full disk is not retried at
every step.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shardlab.errors import RunFolderInUse, TrainingDiverged, first_cause

if TYPE_CHECKING:
    from torch import nn

    from shardlab.checkpoint.manager import Checkpointer


@dataclass
class SavePolicy:
    interval_steps: int
    keep_every_steps: int
    interval_minutes: float
    last_step: int
    """The step the newest save (or the start) holds: save_on_error saves only a step not already saved."""
    last_time: float
    """When the newest save (or the start, or a failed save) happened, on this process's monotonic clock."""

    @classmethod
    def from_config(cls, c, step: int) -> SavePolicy:
        return cls(c.interval_steps, c.keep_every_steps, c.interval_minutes, step, time.monotonic())

    def overdue(self, is_main: bool) -> bool:
        """interval_minutes passed since the last save, on rank 0's clock (the others say no: agree the answer)."""
        minutes = self.interval_minutes
        return minutes > 0 and is_main and time.monotonic() - self.last_time >= 60 * minutes

    def due(self, step: int, overdue: bool) -> bool:
        """A save at ``step``: interval_steps, a keep_every_steps milestone, or ``overdue`` as the ranks agreed it."""
        return bool(
            (self.interval_steps and step % self.interval_steps == 0)
            or (self.keep_every_steps and step % self.keep_every_steps == 0)
            or overdue
        )

    def saved(self, step: int) -> None:
        self.last_step, self.last_time = step, time.monotonic()

    def failed(self) -> None:
        """A periodic save failed: the step saved last stays, the clock restarts (not again at every step)."""
        self.last_time = time.monotonic()

    def unsaved(self, step: int) -> bool:
        return self.last_step != step


def save_after_error(
    error: BaseException,
    c: Any,
    policy: SavePolicy,
    step: int,
    inconsistent: Callable[[], str | None],
    ckpt: Checkpointer,
    save: Callable[[], Path],
    timeout_s: float,
    log: Callable[[str], None],
) -> None:
    """checkpoint.save_on_error (``c``: the checkpoint section): save the last completed step, and only a consistent
    one: at world size 1 (a rank that failed alone cannot save through collectives the others never join), and only
    if the error came before this step changed anything a checkpoint holds (``inconsistent()`` says why not, or
    None). Otherwise nothing is saved and the log says why; a save already in flight is completed where that needs
    no collective (``timeout_s``: how long to wait for it). (Ctrl-C never gets here with save_on_error: it is an
    agreed stop at the end of the step, at any world size.)"""
    unsaved = policy.unsaved(step) and not isinstance(error, RunFolderInUse)  # the folder is another job's now
    reason = inconsistent() if c.save and c.save_on_error and unsaved else None
    if not (c.save and c.save_on_error and unsaved) or reason:
        if reason:
            log(f"[ckpt] save_on_error: nothing saved after {type(error).__name__}: {reason}")
        ckpt.abandon(timeout_s)
        return
    try:
        path = save()
        ckpt.finish()
        name = type(error).__name__
        log(f"[ckpt] saved {path} (the last completed step) after {name} in step {step + 1}; re-raising it")
    except BaseException as e:  # noqa: B036  (best effort: the original error is what the user must see)
        log(f"[ckpt] save after {type(error).__name__} failed too ({first_cause(e)})")


def inconsistent_state(
    error: BaseException, phase: str, world_size: int, step: int, kept: str, model: nn.Module
) -> str | None:
    """Why the state in memory is not the last completed step's (``step``), or None if it is. ``phase``: where the
    loop was (Trainer.phase); ``kept``: what the run has to go back to (Checkpointer.kept)."""
    if isinstance(error, TrainingDiverged):
        return f"the run diverged (a checkpoint of it would hold NaN or inf); {kept}"
    if world_size > 1:
        return (
            f"at world size {world_size} the other ranks cannot join a save after one rank's error; {kept}. Ctrl-C "
            "(SIGINT) saves at any world size"
        )
    if phase == "update":
        return (
            f"it came while step {step + 1}'s update was being applied, so the model is neither step {step} nor "
            f"step {step + 1}; {kept}"
        )
    buffers = {name for name, _ in model.named_buffers()}
    if phase == "forward" and any(key in buffers for key in model.state_dict()):
        return f"the model's buffers (e.g. BatchNorm statistics) already took step {step + 1}'s batches; {kept}"
    return None


def save_on_error_notice(c: Any, world_size: int) -> str | None:
    """The line a run at world size > 1 with checkpoint.save_on_error prints at its start: what it can save."""
    if not (c.save_on_error and world_size > 1):
        return None
    return (
        "[ckpt] checkpoint.save_on_error at world size > 1: Ctrl-C (SIGINT) stops every rank after the step "
        "and saves; an error on one rank saves nothing (the others cannot join the save's collectives)"
    )
