"""Stop signals: Slurm's time-limit warning, preemption, `scancel --signal`, `kill`.

A signal only records that a stop was asked for; the trainer agrees on it across ranks at the end of a step
(``Backend.any_rank``), saves there, and stops. A rank that acted alone could enter the checkpoint's collectives
while another starts the next step, and the job would hang.

Whoever handled the signal before us keeps its say: under submitit that is its requeue handler, which
``forward()`` calls once the checkpoint is written, so submitit requeues the job (rank 0) after nothing is lost. A
Slurm job that submitit does not run (``sbatch`` with ``srun`` tasks, or torchrun, inside) has no such handler: there
global rank 0 requeues the job itself after a time-limit warning (USR1/USR2), with ``scontrol requeue``, as submitit
would. SIGTERM needs nothing: Slurm sends it when it preempts or requeues a job itself, and at ``scancel``.

With ``checkpoint.save_on_error``, Ctrl-C (SIGINT) is a stop signal too: the ranks stop after the step, save, and end;
a second Ctrl-C interrupts at once.
"""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Callable
from typing import Any

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)
"""SIGUSR2 is submitit's (and `scancel --signal=USR2`'s); SIGUSR1 a common `sbatch --signal` choice; SIGTERM is what
Slurm sends on preemption and at cancellation."""

REQUEUE_SIGNALS = (signal.SIGUSR1, signal.SIGUSR2)
"""Time-limit warnings (``sbatch --signal``, submitit's USR2): the job continues after a requeue."""

STOPPED_EXIT_CODE = 128 + signal.SIGTERM
"""Exit code of a run that a stop signal ended early, after its checkpoint (what a process ended by SIGTERM returns).
Under submitit this also means no result is written, so a job that Slurm requeues (preemption, `scontrol requeue`)
is still followed by its submitter, and one that was cancelled is reported as stopped."""


class StopSignals:
    """Records the first stop signal; ``on_signal(signum)`` (e.g. forwarding it to spawned ranks) runs on each.
    ``interrupt``: Ctrl-C is a stop signal too (checkpoint.save_on_error), and a second one raises KeyboardInterrupt."""

    def __init__(self, interrupt: bool = False, on_signal: Callable[[int], None] | None = None) -> None:
        self.received: int | None = None
        """The first stop signal that arrived, if any."""
        self.agreed: int | None = None
        """The stop signal the ranks agreed on (``agree``): this rank's own, else one another rank received."""
        self.signals = (*STOP_SIGNALS, signal.SIGINT) if interrupt else STOP_SIGNALS
        self.on_signal = on_signal
        self._previous: dict[int, Any] = {}
        self._forward_to: Any = None
        self._forwarded = False

    @property
    def name(self) -> str | None:
        signum = self.received or self.agreed
        if signum is None:
            return None
        return signal.Signals(signum).name + ("" if self.received else " (on another rank)")

    def agree(self, signum_on_some_rank: int) -> None:
        """The ranks' stop, agreed: ``signum_on_some_rank`` is the largest signal number received on any rank, so a
        rank that got none (a ``kill`` of one process) forwards what another got, and rank 0 can requeue the job."""
        self.agreed = self.received or signum_on_some_rank or None

    def install(self, only: tuple[int, ...] | None = None) -> None:
        """Record stop signals from now on (main thread only; elsewhere, e.g. in a test harness thread, no-op): all of
        them, or ``only`` those (a rank's start-up records the time-limit warnings alone: a SIGTERM then still ends
        the process, which has no progress to save yet). Signals already recorded stay so."""
        for sig in self.signals if only is None else only:
            if sig in self._previous:
                continue
            try:
                self._previous[sig] = signal.signal(sig, self._record)
            except ValueError:  # not the main thread
                return

    def restore(self) -> None:
        """Put the previous handlers back, remembering the one the stop's signal is to be forwarded to."""
        signum = self.received or self.agreed
        if signum is not None and signum in self._previous:
            self._forward_to = self._previous[signum]
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()

    def _record(self, signum: int, frame: Any) -> None:
        if self.received is None:
            self.received = signum
        if signum == signal.SIGINT:  # the next Ctrl-C interrupts at once
            signal.signal(signal.SIGINT, signal.default_int_handler)
        if self.on_signal is not None:
            self.on_signal(signum)

    def forward(self, speaks_for_job: bool) -> None:
        """After the checkpoint: hand the signal to the handler it would have reached without us (submitit's
        requeue). Default and ignored dispositions need nothing (stopping cleanly was the point), except a time-limit
        warning in a Slurm job submitit does not run: the process that ``speaks_for_job`` (global rank 0, or the
        launcher of local ranks) requeues it. Once: a handler that ends the process by raising is not called again
        on the way out."""
        if self._forwarded:
            return
        self._forwarded = True
        self.restore()
        handler: Callable | Any = self._forward_to
        signum = self.received or self.agreed
        if signum == signal.SIGINT:
            return
        if callable(handler) and handler is not signal.default_int_handler:
            handler(signum, None)
        elif speaks_for_job and signum in REQUEUE_SIGNALS and requeue_is_ours():
            print(requeue_slurm_job(), flush=True)


def requeue_is_ours() -> bool:
    """Inside a Slurm job that submitit does not run (submitit requeues its own jobs)."""
    return bool(os.environ.get("SLURM_JOB_ID")) and not os.environ.get("SUBMITIT_EXECUTOR")


def requeue_slurm_job() -> str:
    """``scontrol requeue`` this job (it restarts with the same command, id and run directory); a one-line report."""
    job = os.environ["SLURM_JOB_ID"]
    try:
        done = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"[run] could not requeue Slurm job {job} ({e}); rerun the same command to resume"
    if done.returncode != 0:
        reason = (done.stderr or done.stdout).strip().splitlines()[-1:] or [f"exit code {done.returncode}"]
        return f"[run] could not requeue Slurm job {job} ({reason[0]}); rerun the same command to resume"
    return f"[run] requeued Slurm job {job}: it resumes from this checkpoint"


def torchrun_agent_warning() -> str | None:
    """A warning for a torchrun worker in a Slurm job whose agent does not pass the time-limit warning on: Slurm
    signals every process of the step, the agent dies of USR1/USR2 (their default action), and srun then ends the
    workers with it before they can save. torchrun tells its workers what it handles (TORCHELASTIC_SIGNALS_TO_HANDLE,
    set from its --signals-to-handle)."""
    handled = os.environ.get("TORCHELASTIC_SIGNALS_TO_HANDLE")
    if handled is None or not os.environ.get("SLURM_JOB_ID"):
        return None
    names = [name.strip() for name in handled.split(",") if name.strip()]
    if any(signal.Signals(sig).name in names for sig in REQUEUE_SIGNALS):
        return None  # the one the job's --signal names, presumably
    wanted = ",".join([*names, "SIGUSR2"])
    return (
        f"warning: torchrun's agent handles only {handled}: a Slurm time-limit warning (USR1/USR2) ends it, and the "
        f"ranks with it, before they save; start it with torchrun --signals-to-handle={wanted}"
    )
