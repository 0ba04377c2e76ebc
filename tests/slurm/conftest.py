"""A real one-node Slurm for the tests marked `slurm`, brought up and down by tools/slurm_cluster.sh (or shared, when
one is already up).

Without root (a laptop) these tests skip with the reason; under CI (CI=true) a cluster that does not start fails them.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tools" / "slurm_cluster.sh"
CLUSTER_DIR = Path(os.environ.get("SHARDLAB_SLURM_DIR", "/tmp/shardlab-slurm"))


def _unavailable(reason: str):
    if os.environ.get("CI"):
        pytest.fail(f"Slurm cluster unavailable under CI: {reason}")
    pytest.skip(reason)


@pytest.fixture(scope="session")
def slurm_env() -> dict[str, str]:
    """The environment in which sbatch/squeue/scancel reach the test cluster (and the sacct stand-in answers)."""
    if os.geteuid() != 0:
        _unavailable("needs root to start munge, slurmctld and slurmd (run the suite as root, or in CI)")
    if shutil.which("apt-get") is None and shutil.which("slurmctld") is None:
        _unavailable("Slurm is not installed and there is no apt-get to install it")
    env = {**os.environ, "SHARDLAB_SLURM_DIR": str(CLUSTER_DIR)}
    env["SLURM_CONF"] = str(CLUSTER_DIR / "etc" / "slurm.conf")
    env["PATH"] = f"{CLUSTER_DIR / 'bin'}:{env['PATH']}"
    env["OMP_NUM_THREADS"] = "1"
    ours = not _answers(env)  # a cluster already up (another session's tests) is shared, never restarted or stopped
    if ours:
        up = subprocess.run(["bash", str(SCRIPT), "up"], env=env, capture_output=True, text=True, timeout=600)
        if up.returncode != 0:
            _unavailable(f"tools/slurm_cluster.sh up failed: {(up.stderr or up.stdout).strip()[-2000:]}")
    yield env
    if ours:
        subprocess.run(["bash", str(SCRIPT), "down"], env=env, capture_output=True, text=True, timeout=120)


def _answers(env: dict[str, str]) -> bool:
    """Whether the test cluster is up and its node can take jobs."""
    if not (CLUSTER_DIR / "etc" / "slurm.conf").is_file() or shutil.which("sinfo") is None:
        return False
    try:
        out = subprocess.run(["sinfo", "-h", "-o", "%T"], env=env, capture_output=True, text=True, timeout=10)
    except subprocess.TimeoutExpired:
        return False
    states = out.stdout.split()
    return out.returncode == 0 and bool(states) and all(s in ("idle", "mixed", "allocated") for s in states)


@pytest.fixture(scope="session")
def multi_node_env(slurm_env) -> dict[str, str]:
    """The test cluster's partition `multi`: hosts shl-n1.. (network namespaces; tools/slurm_cluster.sh), all up."""
    out = subprocess.run(["sinfo", "-h", "-p", "multi", "-o", "%T"], env=slurm_env, capture_output=True, text=True)
    if out.returncode != 0 or not out.stdout.split():
        _unavailable("the test cluster has no partition multi (no network namespaces here: see slurm_cluster.sh up)")
    return slurm_env


def cluster(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    """tools/slurm_cluster.sh with ``args`` (on HOST CMD..., kill-node HOST, node-up HOST)."""
    return subprocess.run(["bash", str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=300)
