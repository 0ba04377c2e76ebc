"""The CUDA paths CPU CI cannot reach: NCCL (at world size 1, and 2 ranks where 2 GPUs exist), bf16, fp16 with the
scaler, pinned CPU offload with cpu_adam, activation checkpointing, torch's SyncBatchNorm; losses held to a CPU fp32
reference run in the same process.

Skipped without CUDA; run with `pytest -m gpu tests/gpu` or tools/gpu_check.sh on a GPU machine.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from shardlab.distributed import env as dist_env
from shardlab.runner import run_rank
from tests.conftest import compose_config
from tests.distributed.harness import run_spawned

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
two_gpus = pytest.mark.skipif(
    torch.cuda.is_available() and torch.cuda.device_count() < 2,
    reason=f"needs 2 GPUs, this machine has {torch.cuda.device_count() if torch.cuda.is_available() else 0}",
)

FP32_RTOL = 1e-4
"""GPU vs CPU fp32: different kernels sum in different orders (matmuls run without TF32, torch's default); over 10
steps the losses stay within 1e-4 relative."""
LOW_PRECISION_RTOL = 0.02
"""bf16/fp16 against the fp32 CPU curve: ~3 significant digits per op; within 2% over 10 steps (as on CPU)."""


def train_losses(result) -> torch.Tensor:
    return torch.tensor([r["loss"] for r in result["history"] if r["split"] == "train"], dtype=torch.float64)


def run_on_cpu(cfg, run_dir, monkeypatch):
    """The same config in this process with CUDA hidden: the fp32 reference every GPU run is held to."""
    with monkeypatch.context() as m:
        m.setattr(torch.cuda, "is_available", lambda: False)
        return run_rank(cfg, run_dir, dist_env.detect())


@pytest.fixture(scope="module")
def cpu_reference(tiny_lm, tmp_path_factory):
    monkeypatch = pytest.MonkeyPatch()
    try:
        return run_on_cpu(tiny_lm(), tmp_path_factory.mktemp("cpu"), monkeypatch)
    finally:
        monkeypatch.undo()


def inspect(trainer) -> dict:
    """Where the run put things: the process group's backends, parameter shards' device and pinning, the scaler."""
    shards = [p.to_local() if isinstance(p, DTensor) else p for p in trainer.model.parameters()]
    return {
        "group": dist.get_backend_config() if dist.is_initialized() else None,
        "param_devices": sorted({t.device.type for t in shards}),
        "pinned": all(t.is_pinned() for t in shards if t.device.type == "cpu"),
        "scaler": type(trainer.scaler).__name__ if trainer.scaler is not None else None,
        "via_all_reduce": getattr(trainer.backend, "reduce_comm", None) is not None,
        "unshard_async": getattr(trainer.backend, "unshard_async", False),
    }


FS = "distributed.backend=fully_sharded"
WORLD_ONE = {
    "fully_sharded": ([FS, "distributed.prefetch_units=1"], FP32_RTOL),
    "ddp": (["distributed.backend=ddp"], FP32_RTOL),
    "pinned_offload_cpu_adam": ([FS, "distributed.cpu_offload=true", "optimizer=cpu_adam"], FP32_RTOL),
    "activation_checkpointing": ([FS, "distributed.activation_checkpointing=full"], FP32_RTOL),
    "bf16": ([FS, "distributed.precision=bf16"], LOW_PRECISION_RTOL),
    "fp16_scaler": ([FS, "distributed.precision=fp16"], LOW_PRECISION_RTOL),
    "fp16_offload_scaler": ([FS, "distributed.precision=fp16", "distributed.cpu_offload=true"], LOW_PRECISION_RTOL),
}


@pytest.mark.parametrize("name", WORLD_ONE)
def test_nccl_world_size_one_tracks_the_cpu_fp32_losses(name, cpu_reference, tiny_lm, tmp_path):
    overrides, rtol = WORLD_ONE[name]
    result = run_rank(tiny_lm(*overrides), tmp_path, dist_env.detect(), after_fit=inspect)
    losses = train_losses(result)
    assert torch.isfinite(losses).all()
    torch.testing.assert_close(losses, train_losses(cpu_reference), rtol=rtol, atol=0)
    assert result["group"] == "cpu:gloo,cuda:nccl"  # CPU tensors (offload) meet gloo, CUDA ones NCCL
    assert not result["via_all_reduce"] and not result["unshard_async"]  # the CPU workarounds stay off
    offload = "cpu_offload=true" in " ".join(overrides)
    assert result["param_devices"] == (["cpu"] if offload else ["cuda"])
    assert result["pinned"]  # offloaded shards sit in pinned memory, so copies to the GPU are asynchronous
    fp16 = "fp16" in name
    assert result["scaler"] == ("ShardedGradScaler" if fp16 else None)
    if fp16:
        train = [r for r in result["history"] if r["split"] == "train"]
        assert all(r["loss_scale"] == 2.0**16 * 0.5 ** r["skipped_steps"] for r in train)


COMPILED = {
    "compiled": ([FS, "distributed.compile=true"], FP32_RTOL),
    "compiled_ddp": (["distributed.backend=ddp", "distributed.compile=true"], FP32_RTOL),
    "compiled_bf16_checkpointing": (
        [FS, "distributed.precision=bf16", "distributed.activation_checkpointing=full", "distributed.compile=true"],
        LOW_PRECISION_RTOL,
    ),
}


def graphs_built(trainer) -> dict:
    """Graphs dynamo built (private counters, read by tests only): a compiled run did run compiled code."""
    from torch._dynamo.utils import counters

    return {"graphs": counters["stats"]["unique_graphs"]}


@pytest.mark.parametrize("name", COMPILED)
def test_compiled_on_cuda_tracks_the_cpu_fp32_losses(name, cpu_reference, tiny_lm, tmp_path):
    """distributed.compile on CUDA (Triton kernels): run by ``bash tools/gpu_check.sh compile``."""
    overrides, rtol = COMPILED[name]
    cache = f"distributed.compile_cache_dir={tmp_path / 'inductor'}"
    result = run_rank(tiny_lm(*overrides, cache), tmp_path, dist_env.detect(), after_fit=graphs_built)
    assert result["graphs"] >= 2  # the blocks' graph and the loss's
    torch.testing.assert_close(train_losses(result), train_losses(cpu_reference), rtol=rtol, atol=0)


def vision_cfg(*overrides: str):
    return compose_config(
        [
            "task=image_classification",
            "model.depth=2",
            "model.w_0=8",
            "model.w_a=8",
            "model.stem_width=8",
            "data.image_size=16",
            "data.num_train=256",
            "data.num_valid=64",
            "optimization.batch_size=16",
            "optimization.max_steps=4",
            "lr_scheduler.warmup_steps=1",
            "validation.interval_steps=0",
            "validation.batch_size=32",
            "checkpoint.interval_steps=0",
            "logging.interval_steps=1",
            "logging.progress_bar=false",
            "logging.tensorboard=false",
            *overrides,
        ]
    )


def bn_types(trainer) -> dict:
    """Which BatchNorm the model ended with (by inheritance: FSDP2 and KeepInputDtype subclass each BN)."""
    from torch.nn.modules.batchnorm import _BatchNorm

    from shardlab.distributed.sync_bn import SyncBatchNorm

    bns = [m for m in trainer.model.modules() if isinstance(m, _BatchNorm)]
    return {
        "torch_sync": bool(bns) and all(isinstance(m, torch.nn.SyncBatchNorm) for m in bns),
        "any_sync": any(isinstance(m, (torch.nn.SyncBatchNorm, SyncBatchNorm)) for m in bns),
    }


def test_one_rank_keeps_plain_batchnorm_and_tracks_the_cpu_losses(tmp_path, monkeypatch):
    """Nothing to sync on one rank: BN stays BatchNorm2d (converted only on more than one rank)."""
    cfg = vision_cfg(FS)
    gpu = run_rank(cfg, tmp_path / "gpu", dist_env.detect(), after_fit=bn_types)
    cpu = run_on_cpu(cfg, tmp_path / "cpu", monkeypatch)
    assert not gpu["any_sync"]
    # cuDNN convolutions may use TF32 (torch's default for them): a looser bound than the LM's matmuls.
    torch.testing.assert_close(train_losses(gpu), train_losses(cpu), rtol=1e-3, atol=0)


@two_gpus
def test_two_gpus_sync_batchnorm_with_torch_module_and_match_one_process(tmp_path, monkeypatch):
    cfg = vision_cfg(FS)
    (two,) = run_spawned([cfg], world_size=2, inspect=bn_types)
    cpu = run_on_cpu(cfg, tmp_path / "cpu", monkeypatch)
    assert two["torch_sync"]  # torch's CUDA module on the NCCL group, not shardlab's gloo one
    torch.testing.assert_close(train_losses(two), train_losses(cpu), rtol=1e-3, atol=0)


@two_gpus
def test_two_gpus_fully_sharded_and_offload_track_the_cpu_losses(tiny_lm, cpu_reference):
    offload = tiny_lm(FS, "distributed.cpu_offload=true", "optimizer=cpu_adam")
    cfgs = [tiny_lm(FS), offload, tiny_lm(FS, "distributed.precision=bf16")]
    results = run_spawned(cfgs, world_size=2, inspect=inspect)
    for result, rtol in zip(results, (FP32_RTOL, FP32_RTOL, LOW_PRECISION_RTOL), strict=True):
        assert result["group"] == "cpu:gloo,cuda:nccl"
        torch.testing.assert_close(train_losses(result), train_losses(cpu_reference), rtol=rtol, atol=0)


MEMORY_MODEL = [
    "model.num_layers=4",
    "model.dim=1024",
    "model.num_heads=16",
    "model.max_seq_len=256",
    "data.seq_len=256",
    "optimization.batch_size=16",
    "optimization.max_steps=3",
    "lr_scheduler.warmup_steps=0",
    "validation.num_batches=1",
    "validation.batch_size=16",
    "checkpoint.save=false",
]


@pytest.mark.parametrize(
    "name, overrides",
    [
        ("ddp", ["distributed.backend=ddp"]),
        ("fully_sharded", [FS]),
        ("activation_checkpointing", [FS, "distributed.activation_checkpointing=full"]),
        ("pinned_offload_cpu_adam", [FS, "distributed.cpu_offload=true", "optimizer=cpu_adam"]),
        ("bf16", [FS, "distributed.precision=bf16"]),
    ],
)
def test_memory_plan_predicts_the_cuda_allocator_peak(name, overrides, tiny_lm, tmp_path):
    """The plan against the caching allocator's peak of a training step (max_memory_allocated), within 25%."""
    result = run_rank(tiny_lm(*MEMORY_MODEL, *overrides), tmp_path, dist_env.detect())
    m = result["memory"]
    print(f"{name}: {m}")
    assert abs(m["predicted_peak_gib"] / m["peak_gib"] - 1) <= 0.25, m
    if name.startswith("pinned"):  # the state lives in host memory: next to nothing stays on the device
        assert m["between_steps_gib"] < 0.05 and m["predicted_between_steps_gib"] == 0, m
    else:
        assert abs(m["predicted_between_steps_gib"] / m["between_steps_gib"] - 1) <= 0.10, m
