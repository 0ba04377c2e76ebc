"""Context parallelism on 2 gloo ranks, everything but the attention (torch 2.14 has no CPU rule for it: the last
check below says what fails, and fails itself the day torch runs it, so that a CPU parity test is added then):

- the LM's micro-batch sharded by torch's context_parallel as the trainer asks it (shardlab.distributed.
  context_parallel.sequence_sharded): each rank holds the head-tail positions, of inputs, targets and positions alike,
  and keeps them after the context (no restore); scaled_dot_product_attention is torch's own again after it;
- the loss's sums and the token count, summed over the context ranks (Backend.all_reduce_sum over the loss axes),
  equal one process's over the whole sequence;
- FSDP2 over dp_shard x cp flattened: each rank's gradient of its slice's mean loss, averaged by the reduce-scatter,
  is one process's gradient of the whole sequence's mean loss (a position-wise model, so no attention is needed).
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

WORLD, SEQ, BATCH, VOCAB, DIM = 2, 16, 2, 11, 8


def _sharding(rank: int, mesh, dims) -> dict:
    from shardlab.distributed.context_parallel import head_tail_positions, sequence_sharded
    from shardlab_tasks.lm.models.context_parallel import sequence_shards

    block = torch.arange(BATCH * (SEQ + 1)).reshape(BATCH, SEQ + 1)  # token = 17 x row + position
    shards = sequence_shards(block, torch.device("cpu"))
    original_sdpa = F.scaled_dot_product_attention
    with sequence_sharded(mesh["cp"], shards.buffers, shards.seq_dims, "alltoall"):
        held = shards.batch
        expected = head_tail_positions(SEQ, WORLD, rank)
        inside = {
            "positions": held.positions.tolist() == expected,
            "inputs": torch.equal(held.inputs, block[:, expected]),
            "targets": torch.equal(held.targets, block[:, [p + 1 for p in expected]]),
            "patched": F.scaled_dot_product_attention is not original_sdpa,
        }
        q = torch.randn(BATCH, 2, SEQ // WORLD, 4, generator=torch.Generator().manual_seed(rank))
        try:
            F.scaled_dot_product_attention(q, q, q, is_causal=True)
            inside["cpu_attention"] = "ran"
        except (NotImplementedError, RuntimeError) as error:
            inside["cpu_attention"] = f"{type(error).__name__}: {str(error).splitlines()[0]}"
    inside["kept_sharded"] = list(held.inputs.shape) == [BATCH, SEQ // WORLD]
    inside["restored_sdpa"] = F.scaled_dot_product_attention is original_sdpa
    return inside


def _sums(rank: int, mesh, dims) -> dict:
    from shardlab.distributed.base import Backend
    from shardlab.distributed.context_parallel import head_tail_positions
    from shardlab_tasks.lm.models.context_parallel import SequenceBatch
    from shardlab_tasks.lm.task import LanguageModelingTask

    data = torch.Generator().manual_seed(7)
    logits, targets = torch.randn(BATCH, SEQ, VOCAB, generator=data), torch.randint(VOCAB, (BATCH, SEQ), generator=data)
    task = SimpleNamespace(cfg=SimpleNamespace(distributed={}), sft=False)  # what pipeline_loss/num_units read
    mine = head_tail_positions(SEQ, WORLD, rank)
    _, stats = LanguageModelingTask.pipeline_loss(task, logits[:, mine], targets[:, mine])
    units = LanguageModelingTask.num_units(task, SequenceBatch(targets[:, mine], targets[:, mine], torch.tensor(mine)))
    packed = torch.tensor([float(stats["loss_sum"]), float(stats["count"]), float(units)], dtype=torch.float64)
    backend = SimpleNamespace(env=SimpleNamespace(world_size=WORLD), mesh=mesh, dims=dims)
    total = Backend.all_reduce_sum(backend, packed)
    whole = F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1), reduction="sum")
    return {"loss_sum_diff": abs(float(total[0]) - float(whole)), "count": float(total[1]), "units": float(total[2])}


def _fsdp_gradients(rank: int, mesh, dims) -> dict:
    from torch.distributed.fsdp import fully_shard

    from shardlab.distributed.context_parallel import data_mesh_with_context, head_tail_positions

    torch.manual_seed(0)
    model, reference = torch.nn.Linear(DIM, VOCAB), None
    reference = torch.nn.Linear(DIM, VOCAB)
    reference.load_state_dict(model.state_dict())
    fsdp_mesh = data_mesh_with_context(mesh, "cpu")
    fully_shard(model, mesh=fsdp_mesh)
    data = torch.Generator().manual_seed(3)
    x, y = torch.randn(BATCH, SEQ, DIM, generator=data), torch.randint(VOCAB, (BATCH, SEQ), generator=data)
    mine = head_tail_positions(SEQ, WORLD, rank)
    F.cross_entropy(model(x[:, mine]).reshape(-1, VOCAB), y[:, mine].reshape(-1)).backward()
    F.cross_entropy(reference(x).reshape(-1, VOCAB), y.reshape(-1)).backward()
    diff = max(
        float((p.grad.full_tensor() - r.grad).abs().max())
        for p, r in zip(model.parameters(), reference.parameters(), strict=True)
    )
    return {"mesh": list(fsdp_mesh.mesh_dim_names), "mesh_ranks": fsdp_mesh.mesh.tolist(), "grad_diff": diff}


def _rank(rank: int, store_path: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    from shardlab.distributed.mesh import ParallelDims

    dist.init_process_group("gloo", store=dist.FileStore(store_path, WORLD), rank=rank, world_size=WORLD)
    dims = ParallelDims(cp=WORLD)
    mesh = dims.build("cpu", keep=("dp_shard",))  # as the fully_sharded backend builds it
    try:
        found = {"sharding": _sharding(rank, mesh, dims), "sums": _sums(rank, mesh, dims)}
        found["fsdp"] = _fsdp_gradients(rank, mesh, dims)
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(found))
    finally:
        dist.destroy_process_group()


def test_context_parallel_shards_sums_and_fsdp_gradients_on_two_ranks(tmp_path):
    mp.spawn(_rank, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=WORLD, join=True)
    for rank in range(WORLD):
        found = json.loads((tmp_path / f"rank{rank}.json").read_text())
        sharding = found.pop("sharding")
        cpu_attention = sharding.pop("cpu_attention")
        assert all(sharding.values()), (rank, sharding)
        # The day torch runs ring attention on CPU this fails: add a CPU parity test against one process then.
        assert "does not have a sharding strategy registered" in cpu_attention, cpu_attention
        sums = found["sums"]
        assert sums["loss_sum_diff"] < 1e-4 and sums["count"] == BATCH * SEQ and sums["units"] == BATCH * SEQ, sums
        fsdp = found["fsdp"]
        assert fsdp["mesh"] == ["dp_shard_cp"] and fsdp["mesh_ranks"] == [0, 1], fsdp
        assert fsdp["grad_diff"] < 1e-6, fsdp
