"""model.pretrained at expert-parallel 2 (2 ranks, CPU, gloo; issue 49): a Mixtral, Qwen2-MoE and Qwen3-MoE folder
(4 experts, top-2, bf16 in >= 3 shards) read by the trainer's start into the expert-parallel split (each rank's 2
experts of every layer, DTensors on the 'ep' axis), each rank reading its own experts' hub tensors only; the loaded
model computes transformers' logits, loss and auxiliary loss, the first step's loss and aux_loss equal
transformers' on the ranks' halves of the batch, and the step-1 checkpoint written at EP 2 exports back to the source
tensors bit for bit. The helpers are tests/distributed/test_moe_pretrained.py's (the same checks at FSDP 2)."""

from __future__ import annotations

import pytest
import torch

from tests.distributed.harness import run_spawned
from tests.distributed.test_hf_pretrained import COMMON
from tests.distributed.test_moe_pretrained import check_export, expert_of, record_reads
from tests.distributed.test_moe_pretrained import inspect as inspect_load
from tests.hf_folders import MOE_FAMILIES, make_folder, moe_reference

transformers = pytest.importorskip("transformers")

EP2 = ["distributed=fully_sharded", "distributed.world_size=2", "distributed.expert_parallel_degree=2"]


def inspect(trainer) -> dict:
    """test_moe_pretrained's, and the mesh axes and placements of an expert weight (the 'ep' split)."""
    experts = dict(trainer.model.named_parameters())["blocks.0.mlp.experts.gate_up_proj"]
    placement = (experts.device_mesh.mesh_dim_names, [str(p) for p in experts.placements])
    return {**inspect_load(trainer), "placement": placement}


def test_moe_folders_load_at_expert_parallel_2_each_rank_reading_its_experts(tiny_lm, tmp_path):
    folders = {family: make_folder(family, tmp_path / family, max_shard_size="20KB") for family in MOE_FAMILIES}
    common = [*EP2, *COMMON, "checkpoint.interval_steps=1"]
    cfgs = [tiny_lm(*common, f"model.pretrained={folder}", "data.seq_len=32") for folder in folders.values()]
    run_dirs = [tmp_path / f"run_{family}" for family in folders]
    results = run_spawned(cfgs, 2, run_dirs=run_dirs, inspect=inspect, prepare=record_reads)
    for (family, folder), result, run_dir in zip(folders.items(), results, run_dirs, strict=True):
        assert result["initialized_from"] == str(folder)
        assert result["placement"] == (("dp_shard_mod_ep", "ep"), ["_S(0, 2)", "S(0)"]), result["placement"]
        logits, cross_entropy, aux = moe_reference(folder, result["tokens"])
        torch.testing.assert_close(result["logits"], logits, rtol=1e-4, atol=1e-5, msg=family)
        torch.testing.assert_close(result["loss"], cross_entropy + aux, rtol=1e-5, atol=1e-6, msg=family)
        halves = [moe_reference(folder, half) for half in result["first_batch"].chunk(2)]
        train = [r for r in result["history"] if r["split"] == "train"][0]
        assert train["loss"] == pytest.approx(sum(h[1].item() for h in halves) / 2, rel=1e-5), family
        assert train["aux_loss"] == pytest.approx(sum(h[2].item() for h in halves) / 2, rel=1e-5), family
        every = [r["read"] for r in result["ranks"]]
        assert [r["local_experts"] for r in result["ranks"]] == [2, 2]  # the 'ep' split: experts 0-1 and 2-3
        for rank, keys in enumerate(every):
            assert {expert_of(k)[1] for k in keys} == {2 * rank, 2 * rank + 1}, (family, rank)
            assert len(keys) == len(set(keys)) == 2 * 2 * 3  # layers x its experts x (gate, up, down)
        check_export(folder, run_dir / "checkpoints" / "step_00000001", tmp_path / f"hf_{family}")
