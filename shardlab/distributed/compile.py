"""distributed.compile: torch.compile (inductor) per FSDP unit, placed as torchtitan places it.

Each unit the task declares (Task.fsdp_units, after activation-checkpoint wrapping) has its forward compiled in place
before fully_shard or DDP wraps the model: parameter names do not change (checkpoints move freely between compiled and
eager runs), and the hooks fully_shard registers afterwards (all-gather before a unit, reduce-scatter after its
backward) run eagerly around each unit's graph. What is in no unit (the root's embeddings and head under tied
embeddings, pooling) stays eager; the LM task compiles its loss too (shardlab_tasks/lm/task.py).

Compilation is lazy: the first training step traces and builds every graph (forward, and backward when it first
runs). ``FirstSteps`` runs that step under distributed.compile_timeout_s and reports what it cost. Validation runs
eagerly (``eager_for_inference``): its no-grad graphs would be a second compilation for a few percent of a run.

Inductor keeps what it built in an on-disk cache (``use_cache_dir``), keyed by the graph, its input shapes and
dtypes, the inductor config, the torch version and the device and compiler, so a requeue or the next sweep point
reloads the kernels instead of rebuilding them (docs/compile.md).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import shutil
import sys
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

DEFAULT_CACHE_DIR = "~/.cache/shardlab/inductor"
RECOMPILE_LIMIT = 64
"""Graphs dynamo may keep per compiled code object. Every unit of one class shares its forward's code (a RegNet's
blocks differ in shape, so each is a graph of its own), and torch's default of 8 would send the rest to eager."""


def compile_errors(d, num_cuda_devices: int) -> list[str]:
    """Why distributed.compile cannot work here (``d``: the distributed section), before anything starts."""
    if not d.compile:
        return []
    errors = []
    if d.compile_timeout_s < d.timeout_s:
        errors.append(
            f"distributed.compile_timeout_s ({d.compile_timeout_s}) is shorter than distributed.timeout_s "
            f"({d.timeout_s}); the first step compiles and needs at least as long: raise it or drop it"
        )
    return errors + _toolchain_errors(num_cuda_devices)


def _toolchain_errors(num_cuda_devices: int) -> list[str]:
    try:
        torch.compile(_identity)  # torch's own checks, e.g. a Python version torch.compile does not support yet
    except RuntimeError as e:
        return [f"distributed.compile: torch.compile cannot run here ({e}); drop distributed.compile"]
    if "inductor" not in torch.compiler.list_backends():
        return ["distributed.compile: this torch build has no inductor backend; drop distributed.compile"]
    if num_cuda_devices:
        return _cuda_errors()
    compiler = os.environ.get("CXX") or ("clang++" if sys.platform == "darwin" else "g++")  # inductor's choice
    if shutil.which(compiler) is None:
        return [
            f"distributed.compile: inductor builds CPU kernels with a C++ compiler, and {compiler} is not on PATH; "
            "install g++ (or set CXX to one) or drop distributed.compile"
        ]
    return []


def _cuda_errors() -> list[str]:
    major, minor = torch.cuda.get_device_capability(0)
    if (major, minor) < (7, 0):
        return [
            f"distributed.compile: inductor's GPU kernels (Triton) need compute capability 7.0 or newer; "
            f"{torch.cuda.get_device_name(0)} has {major}.{minor}: drop distributed.compile"
        ]
    if importlib.util.find_spec("triton") is None:
        return ["distributed.compile: inductor's GPU kernels need the triton package; install it (pip install triton)"]
    compiler = os.environ.get("CC") or next((c for c in ("cc", "gcc", "clang") if shutil.which(c)), None)
    if compiler is None or shutil.which(compiler) is None:
        return [
            "distributed.compile: Triton builds its kernel launcher with a C compiler, and none is on PATH (CC, cc, "
            "gcc, clang); install gcc or drop distributed.compile"
        ]
    return []


def _identity(x):
    return x


def use_cache_dir(d) -> Path:
    """Point inductor at distributed.compile_cache_dir (else $TORCHINDUCTOR_CACHE_DIR, else DEFAULT_CACHE_DIR), in
    this process, before its first compilation; returns the directory."""
    chosen = d.compile_cache_dir or os.environ.get("TORCHINDUCTOR_CACHE_DIR") or DEFAULT_CACHE_DIR
    path = Path(chosen).expanduser().absolute()
    path.mkdir(parents=True, exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(path)  # read by inductor at each lookup; Triton's cache lives inside
    return path


def compile_units(units: Sequence[nn.Module]) -> None:
    """Compile each unit's forward in place. The module's ``__call__`` stays eager, so the hooks that fully_shard (and
    the trainer's tools) register on a unit run around its graph, never inside it: ``nn.Module.compile`` would trace
    ``__call__`` where a unit's forward is torch's own (a Linear, a Sequential) and break the graph at FSDP's hooks.
    Static shapes: training sees one micro-batch shape (validation runs eager), and static graphs get the tightest
    kernels."""
    for unit in units:
        unit.forward = torch.compile(unit.forward, dynamic=False, recompile_limit=RECOMPILE_LIMIT)


@functools.cache
def compiled(fn: Callable) -> Callable:
    """``fn`` compiled once per process (a task's loss function), with static shapes."""
    return torch.compile(fn, dynamic=False)


@contextlib.contextmanager
def eager_for_inference() -> Iterator[None]:
    """Compiled code runs eagerly inside: validation (no-grad forwards) compiles nothing."""
    with torch.compiler.set_stance("force_eager"):
        yield


class FirstSteps:
    """The first training steps of a compiled run. Every rank compiles in the first, and one may wait in a collective
    for a slower one (another node, a colder cache): until that step ends the backend's process groups wait up to
    distributed.compile_timeout_s. Its end holds every rank at a barrier before distributed.timeout_s applies again, so
    no rank issues a collective under the short timeout while another is still compiling (torchtitan sets its init
    and train timeouts the same way). The second step's duration tells what the first spent compiling."""

    def __init__(self, d, groups: list[dist.ProcessGroup | None]) -> None:
        self.timeout_s = d.timeout_s
        self.groups = groups
        self.durations: list[float] = []
        self._set_timeout(max(d.compile_timeout_s, d.timeout_s))

    def ended(self, seconds: float) -> str | None:
        """After each training step, with its duration; returns the line reporting the compilation after the second
        step (once), else None."""
        self.durations.append(seconds)
        if len(self.durations) == 1:
            if dist.is_initialized():
                dist.barrier()
            self._set_timeout(self.timeout_s)
        if len(self.durations) != 2:
            return None
        first, second = self.durations
        return (
            f"compile: the first step took {first:.1f} s, the second {second:.2f} s: ~{max(first - second, 0):.1f} s "
            f"compiling (inductor cache {os.environ.get('TORCHINDUCTOR_CACHE_DIR')})"
        )

    def close(self) -> None:
        """timeout_s again if the first step never ended (it raised): a caller that goes on (backend=auto's next
        trial, the run) must not keep the compile timeout. No barrier: the others may have failed differently."""
        if not self.durations:
            self._set_timeout(self.timeout_s)

    def _set_timeout(self, seconds: float) -> None:
        if dist.is_initialized():
            for group in self.groups:
                dist.set_timeout(timedelta(seconds=seconds), group)
