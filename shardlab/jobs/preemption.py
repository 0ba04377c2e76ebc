"""Stop signals: Slurm's time-limit warning, preemption, `scancel --signal`, `kill`.

A signal only records that a stop was asked for; the trainer agrees on it across ranks at the end of a step
(``Backend.any_rank``), saves there, and stops. A rank that acted alone could enter the checkpoint's collectives
while another starts the next step, and the job would hang.

Whoever handled the signal before us keeps its say: under submitit that is its requeue handler, which
``forward()`` calls once the checkpoint is written, so submitit requeues the job (rank 0) after nothing is lost.
"""

from __future__ import annotations

import signal
from collections.abc import Callable
from typing import Any

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)
"""SIGUSR2 is submitit's (and `scancel --signal=USR2`'s); SIGUSR1 a common `sbatch --signal` choice; SIGTERM is what
Slurm sends on preemption and at cancellation."""

STOPPED_EXIT_CODE = 128 + signal.SIGTERM
"""Exit code of a run that a stop signal ended early, after its checkpoint (what a process ended by SIGTERM returns).
Under submitit this also means no result is written, so a job that Slurm requeues (preemption, `scontrol requeue`)
is still followed by its submitter, and one that was cancelled is reported as stopped."""


class StopSignals:
    def __init__(self) -> None:
        self.received: int | None = None
        """The first stop signal that arrived, if any."""
        self._previous: dict[int, Any] = {}
        self._forward_to: Any = None

    @property
    def name(self) -> str | None:
        return signal.Signals(self.received).name if self.received is not None else None

    def install(self) -> None:
        """Record stop signals from now on (main thread only; elsewhere, e.g. in a test harness thread, no-op)."""
        for sig in STOP_SIGNALS:
            try:
                self._previous[sig] = signal.signal(sig, self._record)
            except ValueError:  # not the main thread
                return

    def restore(self) -> None:
        """Put the previous handlers back, remembering the one the received signal is to be forwarded to."""
        if self.received is not None and self.received in self._previous:
            self._forward_to = self._previous[self.received]
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()

    def _record(self, signum: int, frame: Any) -> None:
        if self.received is None:
            self.received = signum

    def forward(self) -> None:
        """After the checkpoint: hand the signal to the handler it would have reached without us (submitit's
        requeue). Default and ignored dispositions need nothing: stopping cleanly was the point."""
        self.restore()
        handler: Callable | Any = self._forward_to
        if callable(handler):
            handler(self.received, None)
