"""Model FLOPs and peak FLOP/s: what train.py needs for MFU (model FLOPs utilization).

Model FLOPs are counted, not derived from a formula per task: torch's FlopCounterMode watches one forward of the real
model on a real batch (matmuls, convolutions, attention) and a training step is taken as 3x that (backward = 2x
forward, the PaLM/Megatron convention), so activation-checkpoint recomputation does not inflate MFU.
"""

from __future__ import annotations

import time

import torch
from torch.utils.flop_counter import FlopCounterMode, sdpa_flop_count

BF16_DENSE_PEAK_TFLOPS = {  # per GPU, dense (no sparsity), from the vendors' data sheets; matched in the device name
    "H200": 989.4,
    "H100": 989.4,  # SXM; PCIe parts are lower: pass --peak-tflops
    "A100": 312.0,
}


def _cpu_flash_attention_flops(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    return sdpa_flop_count(query_shape, key_shape, value_shape)


def flop_counter() -> FlopCounterMode:
    """A FlopCounterMode that also knows the CPU flash-attention kernel (torch's table has only the GPU ones)."""
    mapping = {}
    op = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    if op is not None:
        mapping[op] = _cpu_flash_attention_flops
    return FlopCounterMode(display=False, custom_mapping=mapping)


def peak_flops_per_s(device: torch.device, threads: int) -> tuple[float | None, str]:
    """This device's peak, and how it was found. GPUs: the bf16 dense peak of known parts (None if unknown).
    CPU: there is no data sheet to trust, so the fp32 GEMM rate of one thread is measured here and scaled by the
    threads the run uses (at most the cores)."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for part, tflops in BF16_DENSE_PEAK_TFLOPS.items():
            if part in name:
                return tflops * 1e12, f"bf16 dense peak of {part} (data sheet)"
        return None, f"unknown GPU {name!r}: pass --peak-tflops"
    per_thread = measure_cpu_gemm_flops()
    return per_thread * threads, f"measured fp32 GEMM, {per_thread / 1e9:.1f} GFLOP/s per thread x {threads} threads"


def measure_cpu_gemm_flops(n: int = 1024, seconds: float = 2.0) -> float:
    """FLOP/s of an n x n fp32 matmul on one thread: the best of the runs that fit in ``seconds`` (a shared machine's
    rate varies by tens of percent from second to second, so compare MFU within one session)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        a, b = torch.randn(n, n), torch.randn(n, n)
        torch.mm(a, b)  # warm-up
        best, deadline = 0.0, time.perf_counter() + seconds
        while time.perf_counter() < deadline:
            t = time.perf_counter()
            torch.mm(a, b)
            best = max(best, 2 * n**3 / (time.perf_counter() - t))
        return best
    finally:
        torch.set_num_threads(threads)
