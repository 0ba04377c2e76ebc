"""What a benchmark figure was measured with, recorded in the JSON beside it.

Every benchmark (shardlab_bench, through shardlab_bench/provenance.py) and shardlab-evaluate --out write
``"meta": collect(...)`` into their JSON: the commit (and the code files
that differed from it), the date, the machine (CPU model, vector extension, cores, memory, GPUs), the torch and
Python versions, the load average, and the exact command, so shardlab_bench/tables.py can print all of it under each
table in docs/ and rerun the command. Nothing here imports torch: the tools that do not need it stay light.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import shlex
import shutil
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent


def git_commit() -> tuple[str | None, list[str] | None]:
    """(HEAD's hash, the tracked files that differ from it); (None, None) outside a git checkout. Documentation
    (``docs/``, ``*.md``) does not count: it cannot change a measurement."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True)
        status = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO, capture_output=True, text=True
        )
    except (OSError, subprocess.CalledProcessError):
        return None, None
    changed = [line[3:].split(" -> ")[-1] for line in status.stdout.splitlines() if line.strip()]
    return head.stdout.strip(), [p for p in changed if not (p.startswith("docs/") or p.endswith(".md"))]


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_vector_isa() -> str | None:
    """The widest x86 vector extension the CPU reports (avx512f, avx2, avx), or None where /proc/cpuinfo does not say:
    machines of one model name differ in it here, and CPU matmul and inductor's code speed with it."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                return next((isa for isa in ("avx512f", "avx2", "avx") if isa in flags), None)
    except OSError:
        pass
    return None


def memory_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return None


def gpus() -> list[str]:
    """Names of the visible CUDA devices: through torch where the tool imported it, else nvidia-smi if present."""
    torch = sys.modules.get("torch")
    if torch is not None:
        if not torch.cuda.is_available():
            return []
        return [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    if shutil.which("nvidia-smi") is None:
        return []
    out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True)
    return [line.strip() for line in out.stdout.splitlines() if line.strip()] if out.returncode == 0 else []


def package_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def collect(tool_file: str, argv: list[str] | None = None, settings: dict[str, Any] | None = None) -> dict[str, Any]:
    """The metadata of a run of ``tool_file`` (the tool's ``__file__``) with command-line ``argv`` (default: this
    process's) and its resolved ``settings``, taken when the run starts."""
    argv = list(sys.argv[1:] if argv is None else argv)
    tool = Path(tool_file).resolve()
    shown = tool.relative_to(REPO) if tool.is_relative_to(REPO) else tool
    cwd = Path.cwd().resolve()
    commit, dirty = git_commit()
    return {
        "command": shlex.join(["python", str(shown), *argv]),
        "argv": [str(shown), *argv],
        "cwd": str(cwd.relative_to(REPO)) if cwd.is_relative_to(REPO) else str(cwd),
        "settings": settings or {},
        "commit": commit,
        "dirty": dirty,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": {
            "cpu": cpu_model(),
            "cpu_isa": cpu_vector_isa(),
            "cores": os.cpu_count(),
            "memory_gib": memory_gib(),
            "gpus": gpus(),
        },
        "torch": package_version("torch"),
        "python": platform.python_version(),
        "load_average_at_start": round(os.getloadavg()[0], 2),
        "_started": time.monotonic(),
    }


def finish(meta: dict[str, Any]) -> dict[str, Any]:
    """``meta`` completed when the run ends: its load average then and how long it took."""
    done = {k: v for k, v in meta.items() if k != "_started"}
    done["load_average_at_end"] = round(os.getloadavg()[0], 2)
    if "_started" in meta:
        done["seconds"] = round(time.monotonic() - meta["_started"], 1)
    return done
