"""model.pretrained with expert parallelism (CPU, gloo; issue 49, "must show" 1 at its last two layouts): a Mixtral,
Qwen2-MoE and Qwen3-MoE folder (4 experts, top-2, bf16 in >= 3 shards) read by the trainer's start into the
expert-parallel split, at EP 2 (2 ranks: each rank 2 experts of every layer, DTensors on the 'ep' axis) and at
FSDP 2 x EP 2 (4 ranks: each group's 2 experts sharded again over the other group, 1 expert a rank), each rank reading
the hub tensors of its own experts only, each whole, and every expert read once; the loaded model computes
transformers' logits, loss and auxiliary loss, the first step's loss and aux_loss equal transformers' on the ranks'
parts of the batch, and the step-1 checkpoint written at either layout exports back to the source tensors bit for
bit. The helpers are tests/distributed/test_moe_pretrained.py's (the same checks at FSDP 2)."""

from __future__ import annotations

import pytest
import torch

from tests.distributed.harness import run_spawned
from tests.distributed.test_hf_pretrained import COMMON
from tests.distributed.test_moe_pretrained import check_export, expert_of, record_reads
from tests.distributed.test_moe_pretrained import inspect as inspect_load
from tests.hf_folders import MOE_FAMILIES, make_folder, moe_reference

transformers = pytest.importorskip("transformers")

EXPERTS, LAYERS = 4, 2
"""tests/hf_folders.py's MoE shape."""


def inspect(trainer) -> dict:
    """test_moe_pretrained's, and the mesh axes and placements of an expert weight (the 'ep' split)."""
    experts = dict(trainer.model.named_parameters())["blocks.0.mlp.experts.gate_up_proj"]
    placement = (experts.device_mesh.mesh_dim_names, [str(p) for p in experts.placements])
    return {**inspect_load(trainer), "placement": placement}


def run_layout(tiny_lm, tmp_path, world: int) -> None:
    """The three families at expert-parallel 2 on ``world`` fully_sharded ranks (one spawn), checked against
    transformers and against the experts each rank holds."""
    folders = {family: make_folder(family, tmp_path / family, max_shard_size="20KB") for family in MOE_FAMILIES}
    layout = ["distributed=fully_sharded", f"distributed.world_size={world}", "distributed.expert_parallel_degree=2"]
    common = [*layout, *COMMON, "checkpoint.interval_steps=1"]
    cfgs = [tiny_lm(*common, f"model.pretrained={folder}", "data.seq_len=32") for folder in folders.values()]
    run_dirs = [tmp_path / f"run_{family}" for family in folders]
    results = run_spawned(cfgs, world, run_dirs=run_dirs, inspect=inspect, prepare=record_reads)
    for (family, folder), result, run_dir in zip(folders.items(), results, run_dirs, strict=True):
        assert result["initialized_from"] == str(folder)
        assert result["placement"] == (("dp_shard_mod_ep", "ep"), ["_S(0, 2)", "S(0)"]), result["placement"]
        logits, cross_entropy, aux = moe_reference(folder, result["tokens"])
        torch.testing.assert_close(result["logits"], logits, rtol=1e-4, atol=1e-5, msg=family)
        torch.testing.assert_close(result["loss"], cross_entropy + aux, rtol=1e-5, atol=1e-6, msg=family)
        torch.testing.assert_close(result["aux"], aux, rtol=1e-5, atol=1e-7, msg=family)
        # the first step: the loss over the global batch, aux_loss the mean of the ranks' parts' (each rank routes
        # its own samples, as each of transformers' runs on a part does)
        parts = [moe_reference(folder, part) for part in result["first_batch"].chunk(world)]
        train = [r for r in result["history"] if r["split"] == "train"][0]
        assert train["loss"] == pytest.approx(sum(p[1].item() for p in parts) / world, rel=1e-5), family
        assert train["aux_loss"] == pytest.approx(sum(p[2].item() for p in parts) / world, rel=1e-5), family
        # EP 2 splits the 4 experts 2 and 2 on 'ep'; at FSDP 2 x EP 2 the other axis halves each group's 2 again
        ranks = result["ranks"]
        assert [r["local_experts"] for r in ranks] == [EXPERTS // world] * world, ranks
        assert sorted(e for r in ranks for e in r["held"]) == list(range(EXPERTS)), ranks
        for rank, r in enumerate(ranks):
            assert {expert_of(k)[1] for k in r["read"]} == set(r["held"]), (family, rank, r)
            assert {expert_of(k)[0] for k in r["read"]} == set(range(LAYERS)), (family, rank)
            assert len(r["read"]) == len(set(r["read"])) == LAYERS * len(r["held"]) * 3  # gate, up, down
        assert len({k for r in ranks for k in r["read"]}) == sum(len(r["read"]) for r in ranks)  # each read once
        check_export(folder, run_dir / "checkpoints" / "step_00000001", tmp_path / f"hf_{family}")


def test_moe_folders_load_at_expert_parallel_2_each_rank_reading_its_experts(tiny_lm, tmp_path):
    run_layout(tiny_lm, tmp_path, 2)


def test_moe_folders_load_at_fsdp_2_x_expert_parallel_2_each_rank_reading_its_expert(tiny_lm, tmp_path):
    run_layout(tiny_lm, tmp_path, 4)
