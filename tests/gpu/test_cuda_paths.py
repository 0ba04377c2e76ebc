"""The CUDA paths CPU CI cannot reach: nccl, pinned CPU offload, the fp16 scaler, torch's SyncBatchNorm.

Skipped without CUDA; run with `pytest -m gpu` or tools/gpu_check.sh on a GPU machine.
"""

from __future__ import annotations

import pytest
import torch

from shardlab.distributed import env as dist_env
from shardlab.runner import run_rank

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def train_losses(result) -> torch.Tensor:
    return torch.tensor([r["loss"] for r in result["history"] if r["split"] == "train"], dtype=torch.float64)


@pytest.fixture(scope="module")
def single(tiny_lm, tmp_path_factory):
    return run_rank(tiny_lm(), tmp_path_factory.mktemp("single"), dist_env.detect())


@pytest.mark.parametrize(
    "overrides",
    [
        ["distributed.backend=fully_sharded"],
        ["distributed.backend=fully_sharded", "distributed.cpu_offload=true"],  # pinned-memory offload on CUDA
        ["distributed.backend=ddp"],
    ],
    ids=["fully_sharded", "pinned_offload", "ddp"],
)
def test_nccl_world_size_one_matches_single_device(overrides, single, tiny_lm, tmp_path):
    def reduce_path(trainer):
        return {"via_all_reduce": getattr(trainer.backend, "reduce_scatter_via_all_reduce", False)}

    result = run_rank(tiny_lm(*overrides), tmp_path, dist_env.detect(), after_fit=reduce_path)
    # GPU kernels may pick different reduction orders run to run: a looser bound than CPU's 1e-5.
    torch.testing.assert_close(train_losses(result), train_losses(single), rtol=1e-4, atol=0)
    assert not result["via_all_reduce"]  # distributed.reduce_scatter=auto keeps NCCL's native reduce-scatter


def test_fp16_with_grad_scaler_trains_finite_on_cuda(single, tiny_lm, tmp_path):
    result = run_rank(
        tiny_lm("distributed.backend=fully_sharded", "distributed.precision=fp16"), tmp_path, dist_env.detect()
    )
    losses = train_losses(result)
    assert torch.isfinite(losses).all()
    torch.testing.assert_close(losses, train_losses(single), rtol=0.02, atol=0)
    assert all("loss_scale" in r for r in result["history"] if r["split"] == "train")


def test_sync_bn_uses_torch_syncbatchnorm_on_cuda(tmp_path):
    from tests.conftest import compose_config

    cfg = compose_config(
        [
            "task=image_classification",
            "distributed.backend=fully_sharded",
            "model.sync_bn=true",
            "optimization.max_steps=3",
            "lr_scheduler.warmup_steps=1",
            "validation.interval_steps=0",
            "data.num_train=256",
            "data.num_valid=200",
            "logging.progress_bar=false",
            "logging.tensorboard=false",
        ]
    )

    def bn_types(trainer):
        return {
            "bn": {type(m) for m in trainer.model.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)}
        }

    result = run_rank(cfg, tmp_path, dist_env.detect(), after_fit=bn_types)
    # FSDP2 subclasses each module it shards, so compare by inheritance: torch's own SyncBatchNorm, not shardlab's.
    assert result["bn"] and all(issubclass(t, torch.nn.SyncBatchNorm) for t in result["bn"])
    assert torch.isfinite(train_losses(result)).all()
