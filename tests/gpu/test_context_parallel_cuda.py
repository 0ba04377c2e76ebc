"""Context parallelism on 2 GPUs (torch's ring attention over NCCL, shardlab/distributed/context_parallel.py) against
one GPU running the same config: losses, training and validation, within the fp32 bound of tests/gpu/test_cuda_paths
(the ring merges each chunk's attention in fp32, another summation order than one kernel over the whole sequence)
and the bf16 one. GPT and Llama (GQA, RoPE at the load-balanced positions).

What CPU CI checks instead (torch 2.14 has no CPU rule for ring attention): tests/distributed/test_context_parallel.py
(the sharding, the sums over cp, FSDP over dp_shard x cp), tests/distributed/test_context_parallel_trainer.py (the
whole training path with the attention kernel stood in for) and tests/unit/test_context_parallel.py (the models at the
positions a context rank holds). Skipped without 2 GPUs; run with `pytest -m gpu tests/gpu` or tools/gpu_check.sh.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed.harness import run_spawned
from tests.gpu.test_cuda_paths import FP32_RTOL, LOW_PRECISION_RTOL, train_losses, two_gpus

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

LLAMA = ["model=llama_tiny", "model.dim=64", "model.num_heads=4", "model.num_kv_heads=2", "model.ffn_dim=128"]
FS = "distributed.backend=fully_sharded"


def valid_losses(result) -> torch.Tensor:
    return torch.tensor([r["loss"] for r in result["history"] if r["split"] == "valid"], dtype=torch.float64)


def where_it_ran(trainer) -> dict:
    """The mesh the run used: its context axis and the one FSDP2 sharded over."""
    backend = trainer.backend
    return {"cp": backend.mesh["cp"].size(), "fsdp_mesh": list(backend.fsdp_mesh().mesh_dim_names or ())}


@two_gpus
@pytest.mark.parametrize(("model", "precision"), [([], "fp32"), (LLAMA, "bf16")], ids=["gpt-fp32", "llama-bf16"])
def test_two_gpus_context_parallel_tracks_one_gpu(model, precision, tiny_lm):
    dtype = f"distributed.precision={precision}"
    (one,) = run_spawned([tiny_lm(*model, FS, dtype)], world_size=1)
    (two,) = run_spawned(
        [tiny_lm(*model, FS, dtype, "distributed.context_parallel_degree=2")], world_size=2, inspect=where_it_ran
    )
    assert two["cp"] == 2 and two["fsdp_mesh"] == ["dp_shard_cp"], two
    rtol = FP32_RTOL if precision == "fp32" else LOW_PRECISION_RTOL
    torch.testing.assert_close(train_losses(two), train_losses(one), rtol=rtol, atol=0)
    torch.testing.assert_close(valid_losses(two), valid_losses(one), rtol=rtol, atol=0)
