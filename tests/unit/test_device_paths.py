"""GPU code paths checked on the CPU: which device a rank takes, which process group its CPU tensors meet, and that the
CPU-only workarounds stay off on CUDA. CUDA itself is simulated (monkeypatched); on a GPU: tools/gpu_check.sh."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from shardlab.cli.checks import validate
from shardlab.config import DistributedConfig
from shardlab.distributed import base, cpu_allocator
from shardlab.distributed import env as dist_env
from shardlab.distributed.base import Backend, process_group_backend
from shardlab.runner import run_rank
from tests.conftest import compose_config


@pytest.fixture
def fake_cuda(monkeypatch):
    """A machine that shows ``count[0]`` GPUs; records the process group torch.distributed is asked for."""
    count, joined = [1], {}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count[0])
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: joined.setdefault("set_device", device))
    monkeypatch.setattr(dist, "init_process_group", lambda **kwargs: joined.update(kwargs))
    # The ranks meet in a rendezvous store before the group exists; an in-process one stands in for rank 0's server.
    monkeypatch.setattr(base, "_rendezvous_store", lambda env, timeout_s, init_timeout_s: dist.HashStore())
    return count, joined


def rank_env(local_rank: int, world: int) -> dist_env.DistEnv:
    return dist_env.DistEnv(local_rank, world, local_rank, "127.0.0.1", 29500, "slurm")


@pytest.mark.parametrize(("visible", "local_rank", "expected"), [(1, 3, 0), (4, 3, 3), (4, 5, 1)])
def test_rank_takes_its_gpu_among_the_visible_ones(fake_cuda, visible, local_rank, expected):
    """A cluster binding one GPU per task shows each rank one device (index 0) whatever its local rank."""
    count, joined = fake_cuda
    count[0] = visible
    backend = Backend(DistributedConfig(backend="ddp"), rank_env(local_rank, 8))
    assert backend.device == torch.device("cuda", expected)
    assert joined["set_device"] == torch.device("cuda", expected)


def test_cuda_ranks_join_a_group_mapping_cpu_tensors_to_gloo(fake_cuda):
    _, joined = fake_cuda
    backend = Backend(DistributedConfig(backend="ddp"), rank_env(1, 2))
    backend.name = "ddp"
    backend.setup()
    assert joined["backend"] == "cpu:gloo,cuda:nccl"
    assert process_group_backend(torch.device("cpu")) == "gloo"


def test_offload_clipping_and_scaler_collectives_run_on_a_group_that_accepts_cpu_tensors(
    tiny_lm, tmp_path, monkeypatch
):
    """cpu_offload keeps sharded gradients on the CPU: the gradient norm's all-reduce (DTensor.full_tensor) and the
    fp16 scaler's found-inf vote (dist.all_reduce) get CPU tensors. Both must run on the default group or one made
    from it (the device mesh's), whose backend maps CPU tensors: gloo here, and on CUDA the group joined above maps
    cpu to gloo (an NCCL-only group would refuse them)."""
    seen: list[tuple[str, str, str]] = []
    full_tensor, all_reduce = DTensor.full_tensor, dist.all_reduce

    def recording_full_tensor(self, *args, **kwargs):
        seen.append(("full_tensor", self.device.type, dist.get_backend_config(self.device_mesh.get_group())))
        return full_tensor(self, *args, **kwargs)

    def recording_all_reduce(tensor, *args, group=None, **kwargs):
        seen.append(("all_reduce", tensor.device.type, dist.get_backend_config(group or dist.group.WORLD)))
        return all_reduce(tensor, *args, group=group, **kwargs)

    monkeypatch.setattr(DTensor, "full_tensor", recording_full_tensor)
    monkeypatch.setattr(dist, "all_reduce", recording_all_reduce)

    def default_group(trainer) -> dict:
        return {"default": dist.get_backend_config(dist.group.WORLD), "scaler": type(trainer.scaler).__name__}

    cfg = tiny_lm(
        "distributed.backend=fully_sharded",
        "distributed.cpu_offload=true",
        "optimizer=cpu_adam",
        "distributed.precision=fp16",
        "optimization.clip_norm=0.5",
        "optimization.max_steps=2",
    )
    result = run_rank(cfg, tmp_path, dist_env.detect(), after_fit=default_group)
    assert result["scaler"] == "ShardedGradScaler"
    kinds = {kind for kind, device, _ in seen if device == "cpu"}
    assert kinds == {"full_tensor", "all_reduce"}  # the norm, and found-inf (plus the logged sums)
    assert {backend for _, _, backend in seen} == {result["default"]}  # every one on the default group's mapping
    assert "cpu:gloo" in result["default"]


def unset(monkeypatch, *names: str) -> None:
    for name in names:  # set first, so monkeypatch restores the variable's absence afterwards
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)


def test_cpu_only_workarounds_stay_off_on_cuda(fake_cuda, monkeypatch):
    unset(monkeypatch, "MALLOC_MMAP_THRESHOLD_", "OMP_NUM_THREADS")
    configured = []
    monkeypatch.setattr(cpu_allocator, "configure_cpu_allocator", configured.append)
    dist_env.set_local_rank_defaults(2)
    backend = Backend(DistributedConfig(backend="ddp"), rank_env(1, 2))
    backend.name = "ddp"
    backend.setup()
    assert "MALLOC_MMAP_THRESHOLD_" not in os.environ and configured == []  # never measured on GPU ranks
    cfg = compose_config(["distributed=fully_sharded", "distributed.reduce_scatter=all_reduce"])
    with pytest.raises(Exception, match="reduce_scatter=all_reduce is a gloo \\(CPU\\) workaround"):
        validate(cfg, world_size=2, num_cuda_devices=2)


@pytest.mark.parametrize(
    ("setting", "budget_gb", "applied"), [("auto", 0.0, "fast"), ("auto", 2.0, "lean"), ("lean", 0.0, "lean")]
)
def test_cpu_ranks_set_their_allocator_from_the_config(monkeypatch, setting, budget_gb, applied):
    configured = []
    monkeypatch.setattr(cpu_allocator, "configure_cpu_allocator", lambda mode: configured.append(mode) or True)
    backend = Backend(DistributedConfig(cpu_allocator=setting, memory_budget_gb=budget_gb), rank_env(0, 1))
    backend.setup()
    assert configured == [applied] and backend.cpu_allocator == applied  # what the end-of-run memory line reports


# A block above lean's mmap threshold, allocated and freed again and again (as every step does with its activations).
ALLOCATE_AND_FREE = """
import resource, sys
import torch
from shardlab.distributed.cpu_allocator import configure_cpu_allocator
assert configure_cpu_allocator(sys.argv[1])
torch.ones(1 << 20).sum()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(400):
    torch.ones(1 << 20).sum()  # 4 MiB
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def test_fast_allocator_reuses_freed_pages_that_lean_returns_to_the_os(monkeypatch):
    import subprocess
    import sys

    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)  # the user's setting would win over both
    faults = {
        mode: int(
            subprocess.run(
                [sys.executable, "-c", ALLOCATE_AND_FREE, mode], capture_output=True, text=True, check=True
            ).stdout
        )
        for mode in ("lean", "fast")
    }
    # lean: every 4 MiB block is a fresh mmap, 1,024 page faults each; fast: the heap keeps the pages.
    assert faults["lean"] >= 400 * 512, faults
    assert faults["fast"] * 20 < faults["lean"], faults
