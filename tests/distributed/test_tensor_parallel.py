"""Tensor parallelism (with sequence parallelism) trains exactly like one process on the same global batch (CPU, gloo):
TP 2 alone, FSDP 2 x TP 2 and hybrid (2 replicas) x TP 2 on 4 ranks, for a Llama built from its config and for a
Llama with tied embeddings and a Qwen3 (q/k norms) read from Hugging Face folders made by transformers. Losses, the
gradient norm of every step and the final weights are compared."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.tensor import DTensor

from shardlab.distributed import env as dist_env
from shardlab.runner import run_rank
from tests.distributed.harness import run_spawned
from tests.hf_folders import make_folder

LLAMA = ["model=llama_tiny", "model.num_kv_heads=2", "model.ffn_dim=null"]
TP2 = ["distributed.backend=fully_sharded", "distributed.tensor_parallel_degree=2"]
HF = ["optimizer.lr=1e-3", "lr_scheduler.warmup_steps=0"]
LOSS_RTOL = 1e-5
"""One process and the split ranks add the same products in another order (row-wise partial sums, the vocabulary
split in two): rounding only."""


def inspect(trainer) -> dict:
    """The full weights after training, and how the model's parameters are placed."""
    model = trainer.model
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    placements = {n: [str(p) for p in t.placements] for n, t in model.named_parameters() if isinstance(t, DTensor)}
    return {"params": full, "placements": placements, "dp": trainer.backend.dp_world_size}


def train_records(result: dict, key: str) -> torch.Tensor:
    return torch.tensor([r[key] for r in result["history"] if r["split"] == "train"], dtype=torch.float64)


def assert_trains_as_one_process(result: dict, reference: dict) -> None:
    assert len(train_records(result, "loss")) == 10
    # Tokens counted once per data-parallel rank, not once per tensor-parallel rank (which read the same samples):
    # each logged step (logging.interval_steps=1) processed batch_size x seq_len = 8 x 32.
    tokens = train_records(result, "tokens_per_s") * train_records(result, "ms_per_step") / 1000
    torch.testing.assert_close(tokens, torch.full_like(tokens, 8 * 32), rtol=1e-6, atol=0)
    torch.testing.assert_close(train_records(result, "loss"), train_records(reference, "loss"), rtol=LOSS_RTOL, atol=0)
    torch.testing.assert_close(
        train_records(result, "gnorm"), train_records(reference, "gnorm"), rtol=1e-4, atol=0
    )
    assert result["params"].keys() == reference["params"].keys()
    for key, value in reference["params"].items():  # atol: Adam scales rounding noise of a ~0 gradient up
        torch.testing.assert_close(result["params"][key], value, rtol=1e-5, atol=1e-5, msg=lambda m, k=key: f"{k}: {m}")


@pytest.fixture(scope="module")
def hf_folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    return {family: make_folder(family, root / family) for family in ("llama3_tied", "qwen3")}


@pytest.fixture(scope="module")
def two_rank_results(tiny_lm, hf_folders):
    cfgs = {
        "llama_tp2": tiny_lm(*LLAMA, *TP2),
        **{f"{f}_tp2": tiny_lm(*TP2, *HF, f"model.pretrained={folder}") for f, folder in hf_folders.items()},
    }
    return dict(zip(cfgs, run_spawned(list(cfgs.values()), world_size=2, inspect=inspect), strict=True))


def single(cfg, tmp_path) -> dict:
    return run_rank(cfg, tmp_path, dist_env.detect(), after_fit=inspect)


@pytest.mark.parametrize("name", ["llama_tp2", "llama3_tied_tp2", "qwen3_tp2"])
def test_tensor_parallel_ranks_train_as_one_process(name, two_rank_results, tiny_lm, hf_folders, tmp_path):
    result = two_rank_results[name]
    family = name.removesuffix("_tp2")
    overrides = LLAMA if family == "llama" else [*HF, f"model.pretrained={hf_folders[family]}"]
    reference = single(tiny_lm(*overrides), tmp_path)
    assert result["dp"] == 1  # both ranks read the same samples
    assert result["placements"], "no parameter was split"
    tp = {name: placements[-1] for name, placements in result["placements"].items()}  # the mesh's last axis
    assert tp["blocks.0.attn.q.weight"] == tp["blocks.0.mlp.up.weight"] == tp["embed.weight"] == "S(0)", tp
    assert tp["blocks.0.attn.o.weight"] == tp["blocks.0.mlp.down.weight"] == "S(1)", tp
    assert tp["blocks.0.attn_norm.weight"] == "R", tp
    assert_trains_as_one_process(result, reference)


CKPT = ["checkpoint.interval_steps=5"]
FSDP2_TP2 = [*TP2, "distributed.sharding_degree=2"]
HYBRID2_TP2 = [*TP2, "distributed.sharding_degree=1"]  # 2 replicas, each split over 2 tensor-parallel ranks


@pytest.fixture(scope="module")
def four_rank_results(tiny_lm, tmp_path_factory):
    """On 4 ranks: FSDP 2 x TP 2 (saving at step 5), hybrid 2 x TP 2, and FSDP 2 x TP 2 resuming one process's step
    5; then one process resuming the FSDP 2 x TP 2 step 5. The reference: one process, uninterrupted."""
    single_dir, fsdp_dir = tmp_path_factory.mktemp("single"), tmp_path_factory.mktemp("fsdp2_tp2")
    reference = single(tiny_lm(*LLAMA, *CKPT), single_dir)
    single_step5 = single_dir / "checkpoints" / "step_00000005"
    cfgs = {
        "fsdp2_tp2": tiny_lm(*LLAMA, *FSDP2_TP2, *CKPT),
        "hybrid2_tp2": tiny_lm(*LLAMA, *HYBRID2_TP2),
        "fsdp2_tp2_from_single": tiny_lm(*LLAMA, *FSDP2_TP2, f"checkpoint.resume={single_step5}"),
    }
    run_dirs = [fsdp_dir, tmp_path_factory.mktemp("hybrid"), tmp_path_factory.mktemp("from_single")]
    results = dict(zip(cfgs, run_spawned(list(cfgs.values()), 4, run_dirs=run_dirs, inspect=inspect), strict=True))
    fsdp_step5 = fsdp_dir / "checkpoints" / "step_00000005"
    results["single_from_fsdp2_tp2"] = single(
        tiny_lm(*LLAMA, f"checkpoint.resume={fsdp_step5}"), tmp_path_factory.mktemp("single_from")
    )
    return {**results, "reference": reference}


@pytest.mark.parametrize(("name", "dp", "mesh"), [("fsdp2_tp2", 2, 2), ("hybrid2_tp2", 2, 3)])
def test_data_and_tensor_parallel_ranks_train_as_one_process(name, dp, mesh, four_rank_results):
    """FSDP 2 x TP 2: every parameter is placed on the 2-D mesh (data shard, tensor); hybrid: 3-D (replicate, shard
    of 1, tensor). The two data-parallel groups each read half of every batch."""
    result = four_rank_results[name]
    assert result["dp"] == dp
    assert {len(p) for p in result["placements"].values()} == {mesh}, result["placements"]
    assert_trains_as_one_process(result, four_rank_results["reference"])


def continued_losses(result: dict, reference: dict) -> tuple[torch.Tensor, torch.Tensor]:
    got = {r["step"]: r["loss"] for r in result["history"] if r["split"] == "train"}
    expected = {r["step"]: r["loss"] for r in reference["history"] if r["split"] == "train"}
    assert sorted(got) == list(range(6, 11)), "a resumed run starts after its checkpoint's step"
    return (torch.tensor([got[s] for s in sorted(got)], dtype=torch.float64),
            torch.tensor([expected[s] for s in sorted(got)], dtype=torch.float64))  # fmt: skip


@pytest.mark.parametrize("name", ["fsdp2_tp2_from_single", "single_from_fsdp2_tp2"])
def test_checkpoints_move_between_one_process_and_fsdp2_x_tp2(name, four_rank_results):
    """DCP reshards the step folder's DTensors to the other layout: the resumed run continues the uninterrupted
    curve, and ends on its weights."""
    result, reference = four_rank_results[name], four_rank_results["reference"]
    torch.testing.assert_close(*continued_losses(result, reference), rtol=LOSS_RTOL, atol=0)
    for key, value in reference["params"].items():
        torch.testing.assert_close(result["params"][key], value, rtol=1e-5, atol=1e-5, msg=lambda m, k=key: f"{k}: {m}")
