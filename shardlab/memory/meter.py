"""What a rank really used: the peak of its training steps above the rank's idle baseline, to set beside the plan.

On CUDA the caching allocator's peak of allocated bytes. On a CPU rank the peak resident set size (VmHWM) minus the
resident size when the trainer started (torch imported, process group joined, nothing of the model yet), both
without the file-backed pages (RssFile: the shared libraries' code and data). Those pages are the page cache's, not
the rank's: the kernel maps them in as code first runs and drops them under memory pressure elsewhere on the
machine, which moved a 0.09 GiB reading by 13 MiB in CI. Linux lets a process reset the peak
(``/proc/self/clear_refs``), which the meter does after validation and saves so that only training steps count.
Elsewhere the peak includes them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from shardlab.distributed.cpu_allocator import glibc

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")


def _status_kib(field: str) -> int | None:
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


def resident_bytes() -> int:
    """This process's resident set size now (0 where /proc is missing)."""
    kib = _status_kib("VmRSS")
    return (kib or 0) * 1024


def file_backed_bytes() -> int:
    """This process's resident pages that map files (0 where /proc is missing)."""
    return (_status_kib("RssFile") or 0) * 1024


def private_resident_bytes() -> int:
    """This process's resident set size without its file-backed pages: what its own allocations hold."""
    return max(resident_bytes() - file_backed_bytes(), 0)


_FOLDED: dict[str, int] = {}
"""Per device, the highest kernel/allocator peak seen before a PeakMeter reset it (see process_peak)."""


def _kernel_peak(device: torch.device) -> int:
    """The peak the OS (VmHWM) or the CUDA allocator reports since it was last reset."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return (_status_kib("VmHWM") or 0) * 1024


def process_peak(device: torch.device) -> int:
    """This process's peak memory since it started (the CUDA allocator's on GPU, the resident set on CPU), as if no
    PeakMeter had reset the counters: every reading of a process-wide peak (the logged mem_gib, the benchmarks) goes
    through here, because the meter's resets would otherwise make it a peak of the last step only."""
    return max(_FOLDED.get(str(device), 0), _kernel_peak(device))


class PeakMeter:
    """Peak memory of training steps on one rank, in bytes above the baseline taken at construction."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        if not self.cuda:
            libc = glibc()
            if libc is not None:
                libc.malloc_trim(0)  # what a previous run in this process freed is not this run's baseline
        self.baseline = torch.cuda.memory_allocated(device) if self.cuda else private_resident_bytes()
        self.peak = 0
        self.total_peak = 0
        self.resettable = True
        self.reset()

    def current_peak(self) -> int:
        """The peak since the last reset, without the file-backed pages resident now (CPU)."""
        if self.cuda:
            return _kernel_peak(self.device)
        return max(_kernel_peak(self.device) - file_backed_bytes(), 0)

    def held(self) -> int:
        """Bytes held now above the baseline: allocated on CUDA, private resident memory on CPU."""
        if self.cuda:
            return torch.cuda.memory_allocated(self.device) - self.baseline
        return private_resident_bytes() - self.baseline

    def reset(self) -> None:
        """Forget the peak so far (after validation or a save, whose memory is not a training step's); the process
        peak keeps it (process_peak)."""
        key = str(self.device)
        _FOLDED[key] = max(_FOLDED.get(key, 0), _kernel_peak(self.device))
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
            return
        if self.resettable:
            try:
                _CLEAR_REFS.write_text("5")  # resets VmHWM to the current resident size (Linux >= 4.0)
            except OSError:
                self.resettable = False

    def sample(self) -> None:
        """After a training step: keep the highest peak seen."""
        self.peak = max(self.peak, self.current_peak())
        self.total_peak = max(self.total_peak, _kernel_peak(self.device))

    @property
    def peak_above_baseline(self) -> int:
        return max(self.peak - self.baseline, 0)


def memory_gib(device: torch.device) -> float:
    """Peak memory of this rank since it started: the CUDA allocator's peak on GPU; on CPU the process's peak resident
    set size."""
    return process_peak(device) / 2**30


def beside_plan(meter: PeakMeter, held: int, estimate: Any, backend: Any) -> tuple[dict[str, Any], str]:
    """The fullest rank's measured training-step peak and between-step bytes (``held``) beside the plan's prediction
    (``estimate``: a memory.plan.MemoryEstimate): the run's ``memory`` record and the line the trainer logs at the end
    of fit. A collective (``backend.max_over_ranks``): every rank calls it."""
    gib = 2**30
    peak, held, total = backend.max_over_ranks([meter.peak_above_baseline, held, meter.total_peak])
    memory: dict[str, Any] = {
        "peak_gib": peak / gib,
        "peak_total_gib": total / gib,  # with the rank's own baseline (what `top` shows on CPU)
        "predicted_peak_gib": estimate.peak / gib,
        "between_steps_gib": held / gib,
        "predicted_between_steps_gib": estimate.between_steps / gib,
    }
    where = "allocator peak" if backend.device.type == "cuda" else "peak RSS above the rank's start"
    caveat = ""
    if backend.cpu_allocator is not None:
        memory["cpu_allocator"] = backend.cpu_allocator
        if backend.cpu_allocator == "fast":
            caveat = " (the allocator keeps freed pages: distributed.cpu_allocator=lean measures against the plan)"
    line = (
        f"memory per rank (fullest rank): training-step peak {peak / gib:.2f} GiB ({where}), plan "
        f"{estimate.peak / gib:.2f}; held between steps {held / gib:.2f} GiB, plan {estimate.between_steps / gib:.2f}"
        f"{caveat}"
    )
    return memory, line
