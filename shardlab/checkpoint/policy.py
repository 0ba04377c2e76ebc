"""When a run saves: checkpoint.interval_steps, keep_every_steps milestones and interval_minutes.

The trainer asks at every step end; whether the clock says a save is overdue is read on rank 0 alone (its own
monotonic clock; the clocks of two hosts are never compared) and agreed across ranks before anyone acts on it, so
every rank saves at the same step. A failed periodic save restarts the clock, so that a full disk is not retried at
every step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass


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
