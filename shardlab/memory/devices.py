"""The devices a memory plan can be made for (distributed.plan_device), and what a CUDA rank holds besides its
tensors. Pure Python (no torch): the pre-flight checks a plan_device name before anything is imported or written.

Extend the table from a user_dir module (imported before the config is checked), e.g.::

    from shardlab.memory.devices import DEVICES, Device
    DEVICES["l4_24gb"] = Device("NVIDIA L4", "cuda", 23034 * MiB, 121e12, 30.3e12, 32, 8)

Figures are the vendors' published dense peaks (no structured sparsity) and the totals their tools report; the
sources are in docs/memory-plan.md ("Planning for another device"). Peak FLOP/s and link speeds only turn the plan's
FLOPs and bytes into lower bounds on a step's time; memory is what decides whether a layout fits.
"""

from __future__ import annotations

import difflib
import os
from dataclasses import dataclass

MiB = 2**20
GiB = 2**30


def size_text(n: int) -> str:
    """Bytes in GiB, or MiB below a tenth of one (a small model's buffers: '0.00 GiB' said nothing)."""
    return f"{n / GiB:.2f} GiB" if n >= GiB / 10 else f"{n / 2**20:.2f} MiB"


@dataclass(frozen=True)
class Device:
    title: str
    """What the vendor calls it."""
    kind: str
    """cuda (NVIDIA, and AMD through ROCm, which torch also calls cuda) or cpu: which kernels and allocator apply."""
    memory_bytes: int
    """Memory one rank may use: the device's total as nvidia-smi / rocm-smi report it (cpu: this machine's RAM)."""
    bf16_flops: float | None
    """Dense bf16 peak, FLOP/s (tensor cores; no sparsity); None: unknown."""
    fp32_flops: float | None
    """Dense fp32 peak, FLOP/s (no TF32); None: unknown."""
    link_gbps: float | None
    """GB/s one rank can send to the others of its machine (one direction: NVLink's total / 2)."""
    ranks_per_node: int = 8
    """Ranks per machine a job on this device usually has (an HGX board: 8), for hybrid layouts planned off-device."""


DEVICES: dict[str, Device] = {
    "h100_80gb": Device("NVIDIA H100 80GB HBM3 (SXM5)", "cuda", 81559 * MiB, 989.4e12, 66.9e12, 450),
    "h200_141gb": Device("NVIDIA H200 (SXM)", "cuda", 143771 * MiB, 989.4e12, 66.9e12, 450),
    "a100_80gb": Device("NVIDIA A100-SXM4-80GB", "cuda", 81920 * MiB, 312e12, 19.5e12, 300),
    "a100_40gb": Device("NVIDIA A100-SXM4-40GB", "cuda", 40960 * MiB, 312e12, 19.5e12, 300),
    "l40s_48gb": Device("NVIDIA L40S (PCIe)", "cuda", 46068 * MiB, 362.05e12, 91.6e12, 32),
    "mi300x": Device("AMD Instinct MI300X", "cuda", 192 * GiB, 1307.4e12, 163.4e12, 448),
}
"""Named devices: distributed.plan_device=<name>."""

LOCAL = ("auto", "cpu", "cuda")
"""auto: the device this machine would train on (its GPU, else its CPU); cpu: this machine's CPU; cuda: its GPU."""


def known() -> list[str]:
    return [*LOCAL, *DEVICES]


def unknown_device_message(name: str) -> str:
    """The one line for an unknown distributed.plan_device (the registry's wording; config.py cannot import it)."""
    close = difflib.get_close_matches(name, known(), n=1, cutoff=0.5)
    hint = f" Did you mean '{close[0]}'?" if close else ""
    return f"distributed.plan_device: '{name}' is not a known plan device; known: {', '.join(known())}.{hint}"


def machine_ram() -> int:
    """This machine's physical memory, the capacity a CPU plan is held to."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def cpu_device() -> Device:
    return Device("this machine's CPU", "cpu", machine_ram(), None, None, None, ranks_per_node=1)


def named_like(gpu_name: str) -> Device | None:
    """The table's entry for a GPU torch names (e.g. 'NVIDIA H100 80GB HBM3'), for its peak rates."""
    words = gpu_name.lower().replace("-", " ").split()
    for key, device in DEVICES.items():
        model, *size = key.split("_")
        if model in words and all(s in gpu_name.lower() for s in size):
            return device
    return None


# ---- what a CUDA rank holds besides its tensors ----------------------------------------------------------------------
# PyTorch's CUDA caching allocator (c10/cuda/CUDACachingAllocator.cpp; ROCm's is the same code, hipified):
ALLOC_BLOCK = 512
"""kMinBlockSize: every allocation is rounded up to a multiple of 512 bytes."""
ALLOC_LARGE = 10 * MiB
"""kMinLargeAlloc: from this size a request gets a segment of its own (smaller ones share 2 MiB / 20 MiB segments)."""
ALLOC_ROUND_LARGE = 2 * MiB
"""kRoundLarge: such a segment is rounded up to 2 MiB; its tail is split off only when over 1 MiB (kSmallSize), and
then serves other large requests only, so the plan counts the rounded segment."""
FRAGMENTATION = 0.05
"""Reserved over allocated at the step's peak: freed blocks of one size that a request of another size cannot use.
An allowance, not a measurement (no GPU was lent to this work): torch.cuda.memory_stats()'s
reserved_bytes.all.peak / allocated_bytes.all.peak is what to measure (tools/gpu_check.sh); expandable_segments:True
in PYTORCH_CUDA_ALLOC_CONF lowers it."""
CUDA_CONTEXT = 500 * MiB
"""The CUDA context and torch's kernels loaded into it (lazily, CUDA_MODULE_LOADING=LAZY, the default since CUDA
11.7): outside the allocator, seen by nvidia-smi. Commonly 300-600 MiB on A100/H100 with CUDA 12; not measured here."""
NCCL_PER_COMMUNICATOR = 256 * MiB
"""NCCL's buffers per communicator: NCCL_BUFFSIZE (4 MiB by default) for send and for receive on each channel, up to
32 channels on NVLink machines (4 MiB x 2 x 32); NVLS (NVLink SHARP, H100/H200 with NVSwitch) can add more, which
NCCL_NVLS_ENABLE=0 turns off. An upper-end derivation from NCCL's documented defaults, not a measurement."""


def allocator_bytes(n: int) -> int:
    """What the caching allocator reserves for one tensor of ``n`` bytes."""
    if n <= 0:
        return 0
    n = -(-n // ALLOC_BLOCK) * ALLOC_BLOCK
    if n >= ALLOC_LARGE:
        n = -(-n // ALLOC_ROUND_LARGE) * ALLOC_ROUND_LARGE
    return n
