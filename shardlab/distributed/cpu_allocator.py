"""How glibc treats a CPU rank's freed memory (distributed.cpu_allocator), set once as the rank starts.

A process setting of CPU ranks, beside the other CPU-only workarounds of this package: the backend applies it in
``setup`` before the process group is up; shardlab.memory.meter reads what a rank then holds.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os


def glibc():
    """glibc, or None where the C library is another (musl's malloc behaves differently) or there is none."""
    if os.name != "posix":
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.gnu_get_libc_version  # noqa: B018  (only glibc has it: musl's malloc behaves differently)
        return libc
    except (OSError, AttributeError):
        return None


M_TRIM_THRESHOLD = -1  # glibc's mallopt parameter numbers (malloc.h)
M_MMAP_THRESHOLD = -3

MMAP_THRESHOLD_BYTES = 64 << 10
"""cpu_allocator=lean: CPU ranks serve allocations of this size and more with their own mmap (docs/memory-plan.md,
"CPU ranks and glibc"): 1 MiB kept a small model's sub-MiB activations resident after they were freed - RegNet with
synced BN at 32 images per rank then used 15% more than it held (0.0956 GiB peak against a plan of 0.0813); at 64 KiB
it used 0.0786."""

FAST_MMAP_THRESHOLD_BYTES = 32 << 20
"""cpu_allocator=fast: glibc's own ceiling for the threshold on 64-bit machines (its dynamic threshold stops there)."""

FAST_TRIM_THRESHOLD_BYTES = 1 << 30
"""cpu_allocator=fast: free heap kept at the top before glibc gives it back (the default 128 KiB gives back, and then
faults in again, every step's activations)."""

GLIBC_TRIM_THRESHOLD = 128 << 10
"""glibc's default trim threshold (lean restores it in a process that ran fast before, as the test suite's do)."""


def resolve_cpu_allocator(dist_cfg) -> str:
    """distributed.cpu_allocator as a CPU rank applies it: auto is lean where a memory budget is set (the plan that
    chose the layout must then hold for resident memory), else fast."""
    if dist_cfg.cpu_allocator == "auto":
        return "lean" if dist_cfg.memory_budget_gb > 0 else "fast"
    return dist_cfg.cpu_allocator


def configure_cpu_allocator(mode: str) -> bool:
    """How glibc treats a CPU rank's freed memory (docs/benchmarks.md "Memory versus speed on CPU").

    lean: allocations of MMAP_THRESHOLD_BYTES and more get their own mmap, so freeing one returns it to the OS.
    Otherwise glibc raises its threshold to the largest block freed (up to 32 MiB) and serves later blocks from heaps
    it keeps: FSDP's per-unit all-gather and gradient buffers and activations then stay resident, and a rank's memory
    grows far past what it holds. Every such allocation pays its page faults again.
    fast: the threshold at glibc's ceiling and no trimming below 1 GiB, so a step reuses the pages the last one freed
    instead of faulting them in again; resident memory stays at the steps' high-water mark.
    A no-op where the C library is not glibc or the user set MALLOC_MMAP_THRESHOLD_ (the user's choice wins)."""
    if "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    libc = glibc()
    if libc is None:
        return False
    if mode == "lean":
        mmap_threshold, trim_threshold = MMAP_THRESHOLD_BYTES, GLIBC_TRIM_THRESHOLD
    else:
        mmap_threshold, trim_threshold = FAST_MMAP_THRESHOLD_BYTES, FAST_TRIM_THRESHOLD_BYTES
    return bool(libc.mallopt(M_MMAP_THRESHOLD, mmap_threshold) and libc.mallopt(M_TRIM_THRESHOLD, trim_threshold))
