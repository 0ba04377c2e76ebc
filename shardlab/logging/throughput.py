"""The throughput a train line reports: units per second and milliseconds per step over the steps since the last
line (a window). Windows time training only: validation and saving inside a window are taken out (``paused``) and
timed on their own lines."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any


@dataclass
class ThroughputWindow:
    """The steps since the last train line."""

    sums: dict[str, Any] = field(default_factory=dict)
    """Each statistic of the task's loss, and the units processed, summed over the window's micro-batches."""
    started: float = field(default_factory=time.perf_counter)
    steps: int = 0
    paused: float = 0.0
    """Seconds of the window spent outside training steps (validation, saves)."""

    def rates(self, units: float, unit: str) -> dict[str, float]:
        """``{unit}_per_s`` for the ``units`` the window's steps processed (on all ranks), and ``ms_per_step``."""
        elapsed = time.perf_counter() - self.started - self.paused
        return {f"{unit}_per_s": units / max(elapsed, 1e-9), "ms_per_step": 1000 * elapsed / max(self.steps, 1)}
