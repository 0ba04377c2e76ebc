"""model.pretrained with a mixture of experts on 2 fully_sharded ranks (CPU, gloo; issue 49): a Mixtral, Qwen2-MoE
and Qwen3-MoE folder (4 experts, top-2, bf16 in >= 3 shards) read by the trainer's own start into FSDP2's shards of
the grouped experts (2 experts per rank), each rank reading the hub tensors of its own experts only; the loaded
model computes transformers' logits, loss and auxiliary loss, and the first step's loss and aux_loss equal
transformers' on the ranks' halves of the batch. The step-1 checkpoint, saved by the 2 ranks, exports back to the
source tensors bit for bit."""

from __future__ import annotations

import json

import pytest
import torch

from shardlab.data import GlobalOrder
from tests.distributed.harness import run_spawned
from tests.distributed.test_hf_pretrained import COMMON
from tests.hf_folders import MOE_FAMILIES, make_folder, moe_reference

transformers = pytest.importorskip("transformers")

READ: list[str] = []
"""The hub expert tensors this rank read from the folder's files (``record_reads``)."""


def record_reads() -> None:
    """In each rank: record every hub expert tensor the reader reads out of a file (DCP's read requests, where
    safetensors' ``get_slice`` is taken: what leaves the file, not what the loader planned), refusing a partial one."""
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    original = HuggingFaceStorageReader._process_read_request

    def recorded(self, f, req, planner):
        key = req.storage_index.fqn
        if ".experts." in key:
            assert list(req.storage_offsets) == [0] * len(req.lengths), (key, req)
            assert list(req.lengths) == list(f.get_slice(key).get_shape()), (key, req)  # the expert whole
            READ.append(key)
        original(self, f, req, planner)

    HuggingFaceStorageReader._process_read_request = recorded


def inspect(trainer) -> dict:
    """Rank 0's logits and loss (auxiliary loss included) on a fixed batch through the sharded model, the first
    global batch, and every rank's experts (how many, and which: its shard's rows of layer 0's grouped experts) and
    the hub expert tensors it read."""
    import torch.distributed as dist

    task, cfg = trainer.task, trainer.cfg
    order = GlobalOrder(len(task.train_dataset), cfg.seed, shuffle=True)
    first_batch = torch.stack([task.train_dataset[i] for i in order.indices(0, cfg.optimization.batch_size)])
    tokens = torch.randint(0, 257, (2, cfg.data.seq_len + 1), generator=torch.Generator().manual_seed(1))
    experts = dict(trainer.model.named_parameters())["blocks.0.mlp.experts.gate_up_proj"]
    with torch.no_grad():
        logits = trainer.model(tokens[:, :-1])
        trainer.model.take_routing_stats()
        loss, sums = task.loss(trainer.model, tokens, torch.device("cpu"))
    ranks = [None] * dist.get_world_size()
    (chunk,) = experts.__create_chunk_list__()  # where this rank's rows start among all the experts
    held = list(range(chunk.offsets[0], chunk.offsets[0] + chunk.sizes[0]))
    dist.all_gather_object(ranks, {"read": sorted(READ), "local_experts": len(held), "held": held})
    READ.clear()
    return {"tokens": tokens, "logits": logits, "loss": loss, "aux": sums["moe_aux_sum"], "ranks": ranks,
            "first_batch": first_batch, "initialized_from": str(trainer.initialized_from)}  # fmt: skip


def expert_of(key: str) -> tuple[int, int]:
    """(layer, expert) of a hub expert tensor's name."""
    parts = key.split(".")
    return int(parts[2]), int(parts[parts.index("experts") + 1])


def test_moe_folders_load_into_two_sharded_ranks_each_reading_its_experts(tiny_lm, tmp_path):
    folders = {family: make_folder(family, tmp_path / family, max_shard_size="20KB") for family in MOE_FAMILIES}
    common = ["distributed=fully_sharded", "distributed.world_size=2", *COMMON, "checkpoint.interval_steps=1"]
    cfgs = [tiny_lm(*common, f"model.pretrained={folder}", "data.seq_len=32") for folder in folders.values()]
    run_dirs = [tmp_path / f"run_{family}" for family in folders]
    results = run_spawned(cfgs, 2, run_dirs=run_dirs, inspect=inspect, prepare=record_reads)
    for (family, folder), result, run_dir in zip(folders.items(), results, run_dirs, strict=True):
        assert result["initialized_from"] == str(folder)
        logits, cross_entropy, aux = moe_reference(folder, result["tokens"])
        torch.testing.assert_close(result["logits"], logits, rtol=1e-4, atol=1e-5, msg=family)
        torch.testing.assert_close(result["loss"], cross_entropy + aux, rtol=1e-5, atol=1e-6, msg=family)
        torch.testing.assert_close(result["aux"], aux, rtol=1e-5, atol=1e-7, msg=family)
        # the first step: the loss over the global batch, aux_loss the mean of the two ranks' halves'
        halves = [moe_reference(folder, half) for half in result["first_batch"].chunk(2)]
        train = [r for r in result["history"] if r["split"] == "train"][0]
        assert train["loss"] == pytest.approx(sum(h[1].item() for h in halves) / 2, rel=1e-5), family
        assert train["aux_loss"] == pytest.approx(sum(h[2].item() for h in halves) / 2, rel=1e-5), family
        # each rank read the tensors of its own 2 experts of every layer, and no other
        every = [r["read"] for r in result["ranks"]]
        assert [r["local_experts"] for r in result["ranks"]] == [2, 2]
        assert [r["held"] for r in result["ranks"]] == [[0, 1], [2, 3]]
        for rank, keys in enumerate(every):
            assert {expert_of(k)[1] for k in keys} == {2 * rank, 2 * rank + 1}, (family, rank)
            assert len(keys) == len(set(keys)) == 2 * 2 * 3  # layers x its experts x (gate, up, down)
        assert not set(every[0]) & set(every[1])
        check_export(folder, run_dir / "checkpoints" / "step_00000001", tmp_path / f"hf_{family}")


def check_export(folder, checkpoint, out) -> None:
    """The 2 ranks' checkpoint, exported in bf16, holds the source folder's tensors bit for bit."""
    from shardlab_commands import export_hf
    from tests.unit.test_export_hf_shards import source_tensors

    export_hf.main([str(checkpoint), "--out", str(out), "--dtype", "bf16", "--max-shard-mb", "0.02"])
    theirs, ours = source_tensors(folder), source_tensors(out)
    assert sorted(ours) == sorted(theirs)
    assert all(torch.equal(ours[key], tensor) for key, tensor in theirs.items())
    assert (
        json.loads((out / "config.json").read_text())["model_type"]
        == json.loads((folder / "config.json").read_text())["model_type"]
    )
