"""distributed.precision=auto: bf16 autocast where this machine multiplies bf16 measurably faster than fp32, else fp32.

CPUs differ by two orders of magnitude here: an AVX-512-BF16 (or AMX) core runs a bf16 matmul about twice as fast as
fp32, an AVX2-only core about a hundred times slower (torch emulates bf16 there). So the choice is measured, not
guessed from flags: one matmul of the issue's shape (1024x512x2048) in each dtype on this process's device, the best
of a few repeats, once per machine. The rates are cached in ``distributed.precision_cache`` under a key of the CPU
model, its flags, the GPU's name and the torch version, so every later run (a requeue, the next sweep point) on the
same machine reads the same rates and decides the same; a new torch or another machine measures again.

Every rank must compute in the same dtype. Ranks started here read the rates the launching process measured before
spawning them (``resolve`` in the launcher, then ``agree`` in each rank). Ranks started by torchrun or Slurm measure
per machine (a file lock lets one measure while the others wait), and then agree in one all-reduce: bf16 only if
every rank's machine is faster in bf16. On a mixed cluster the slowest machine sets the pace of every step, so one
machine that emulates bf16 makes the whole job fp32.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import platform
import time
from pathlib import Path

import torch

from shardlab.files.durable import write_json_atomic
from shardlab.files.regular_file import read_json_or_none

BF16_MARGIN = 1.2
"""bf16 must beat fp32 by this factor to be chosen: within it the two are a measurement's noise apart, and fp32 is
the exact one."""
SHAPE = (1024, 512, 2048)
"""(m, k, n) of the measured matmul: the issue's shape, about the size of the default LM's projections."""


ISA_CAPS = ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA")
"""oneDNN's instruction-set caps: ONEDNN_MAX_CPU_ISA=AVX2 on an AVX-512-BF16 CPU sends its bf16 matmuls down the
AVX2-only path (measured on this repository's AMD EPYC: 199 GFLOP/s bf16 without it, 0.6 with it; fp32 unchanged),
so a capped process has other rates than the same CPU uncapped."""


def machine_key(device: torch.device) -> str:
    """What the rates depend on: the CPU (model and instruction-set flags), oneDNN's instruction-set cap if one is set,
    the GPU's name, the torch version."""
    cpu, flags = platform.processor(), ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and not cpu:
                cpu = line.split(":", 1)[1].strip()
            elif line.startswith("flags"):
                flags = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else ""
    caps = [f"{v}={os.environ[v]}" for v in ISA_CAPS if v in os.environ]  # none set: the key it always had
    text = json.dumps([cpu, flags, gpu, torch.__version__, *caps])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def measure_rates(device: torch.device, repeats: int = 5) -> dict:
    """GFLOP/s of one (m x k) @ (k x n) matmul in fp32 and in bf16 on ``device``, the best of ``repeats``."""
    m, k, n = SHAPE
    rates = {}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        a = torch.randn(m, k, device=device).to(dtype)
        b = torch.randn(k, n, device=device).to(dtype)
        best = float("inf")
        for _ in range(repeats + 1):  # the first warms the kernel up (and may pick it)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            a @ b
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            best = min(best, time.perf_counter() - start)
        rates[f"{name}_gflops"] = 2 * m * k * n / best / 1e9
    return rates


def machine_rates(device: torch.device, cache_dir: str | None, measure=measure_rates) -> tuple[dict, str]:
    """This machine's rates and where they came from ('measured now' or the cache file). With a cache, one process
    per machine measures (under a file lock) and the others read what it wrote."""
    if cache_dir is None:
        return measure(device), "measured now, not cached (distributed.precision_cache=null)"
    folder = Path(cache_dir).expanduser()
    path = folder / f"{machine_key(device)}.json"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        return _cached(path, device, measure)
    except OSError as e:  # a read-only or full home: still a choice, only not kept
        return measure(device), f"measured now, not cached ({folder}: {e.strerror or e})"


def _cached(path: Path, device: torch.device, measure) -> tuple[dict, str]:
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        rates = read_json_or_none(path)  # the one reader: a damaged or absent file is measured again below
        if isinstance(rates, dict) and {"bf16_gflops", "fp32_gflops"} <= set(rates):
            return rates, f"cached in {path}"
        rates = measure(device)
        write_json_atomic(path, rates)  # whole or not at all: a process killed mid-write leaves the old file, or none
    return rates, f"measured now, cached in {path}"


def choice(rates: dict) -> str:
    return "bf16" if rates["bf16_gflops"] >= BF16_MARGIN * rates["fp32_gflops"] else "fp32"


def gflops(rate: float) -> str:
    """A rate as the line prints it: whole GFLOP/s, and two significant digits below 10 (emulated bf16 runs at
    0.6, which a whole number would print as 0 or 1)."""
    return f"{rate:.0f}" if rate >= 10 else f"{rate:.2g}"


def describe(chosen: str, rates: dict, source: str, device: torch.device) -> str:
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "this CPU"
    return (
        f"distributed.precision=auto chose {chosen}: a {'x'.join(map(str, SHAPE))} matmul on {where} runs "
        f"{gflops(rates['bf16_gflops'])} GFLOP/s in bf16, {gflops(rates['fp32_gflops'])} in fp32 (bf16 needs "
        f"{BF16_MARGIN}x; {source})"
    )


def resolve(d, device: torch.device) -> str | None:
    """``d`` (the distributed section) with precision=auto: decide for ``device`` and write the choice into ``d``;
    returns the line to print (None when precision is not auto)."""
    if d.precision != "auto":
        return None
    rates, source = machine_rates(device, d.precision_cache)
    d.precision = choice(rates)
    return describe(d.precision, rates, source, device)


def for_named_device(d, device) -> str | None:
    """A plan for a device of the table (distributed.plan_device, devices.Device): its published dense rates decide."""
    if d.precision != "auto" or not (device.bf16_flops and device.fp32_flops):
        return None
    rates = {"bf16_gflops": device.bf16_flops / 1e9, "fp32_gflops": device.fp32_flops / 1e9}
    d.precision = choice(rates)
    return (
        f"distributed.precision=auto plans {d.precision} for {device.title}: {rates['bf16_gflops'] / 1e3:.0f} "
        f"TFLOP/s bf16 against {rates['fp32_gflops'] / 1e3:.0f} fp32 (its published dense peaks)"
    )


def settle(d, backend) -> str | None:
    """In each rank, once the process group is up: resolve precision=auto for this rank's device (the machine's cached
    rates), agree over all ranks (fp32 if any rank's machine is not faster in bf16), and set the backend's dtypes.
    Returns the line rank 0 prints (None when precision is not auto)."""
    from shardlab.distributed.base import resolve_dtypes

    line = resolve(d, backend.device)
    if line is None:
        return None
    if backend.any_rank(d.precision != "bf16")[0] and d.precision == "bf16":
        d.precision = "fp32"
        line += "; fp32 on every rank, as another machine of this job is not faster in bf16"
    backend.param_dtype, backend.reduce_dtype = resolve_dtypes(d)
    return line
