"""Pipeline parallelism (shardlab.distributed.pipeline) trains exactly like one process on the same global batch (CPU,
gloo): the same losses, gradient norms (clipped over all stages) and weights after 10 steps, with 1F1B, interleaved
1F1B (2 stages per rank) and PP composed with FSDP; and a PP run's step folder resumes on one process."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from shardlab.distributed import env as dist_env
from shardlab.runner import run_rank
from tests.distributed.harness import run_spawned

# 4 blocks: 2 per stage at PP 2, 1 per stage with 2 stages per rank. Untied: the embedding lives on the first stage and
# the head on the last. Each step's 2 micro-batches (update_freq) are the pipeline's micro-batches.
PIPELINE_LM = ["model.num_layers=4", "model.tie_embeddings=false", "optimization.update_freq=2"]
FSDP = "distributed.backend=fully_sharded"
PP2 = [FSDP, "distributed.pipeline_parallel_degree=2"]
VARIANTS_2 = {
    "1f1b": [*PP2, "distributed.pipeline_schedule=1f1b"],
    "interleaved_1f1b": [
        *PP2,
        "distributed.pipeline_schedule=interleaved_1f1b",
        "distributed.pipeline_stages_per_rank=2",
    ],
    "gpipe_llama": [*PP2, "distributed.pipeline_schedule=gpipe", "model=llama_tiny", "model.ffn_dim=null"],
}


def full_params(trainer) -> dict:
    """Every stage's parameters, gathered over its data-parallel shards and then over the pipeline ranks; and the
    layers this rank (rank 0: the first stage) holds."""
    full = get_model_state_dict(trainer.model, options=StateDictOptions(full_state_dict=True))
    held = sorted({".".join(k.split(".")[:2]) for k in full})
    full = {k: v.detach().cpu().clone() for k, v in full.items()}
    if dist.is_initialized() and dist.get_world_size() > 1:
        gathered: list[dict] = [{} for _ in range(dist.get_world_size())]
        dist.all_gather_object(gathered, full)
        full = {k: v for part in gathered for k, v in part.items()}
    return {"params": full, "held": held}


def train_records(result: dict, key: str) -> torch.Tensor:
    return torch.tensor([r[key] for r in result["history"] if r["split"] == "train"], dtype=torch.float64)


def valid_losses(result: dict) -> torch.Tensor:
    return torch.tensor([r["loss"] for r in result["history"] if r["split"] == "valid"], dtype=torch.float64)


def assert_same_training(result: dict, reference: dict) -> None:
    assert len(train_records(result, "loss")) == 10
    torch.testing.assert_close(train_records(result, "loss"), train_records(reference, "loss"), rtol=1e-5, atol=0)
    torch.testing.assert_close(train_records(result, "gnorm"), train_records(reference, "gnorm"), rtol=1e-4, atol=0)
    torch.testing.assert_close(valid_losses(result), valid_losses(reference), rtol=1e-5, atol=0)
    assert result["params"].keys() == reference["params"].keys()
    for key, value in reference["params"].items():
        torch.testing.assert_close(result["params"][key], value, rtol=1e-5, atol=1e-5, msg=lambda m, k=key: f"{k}: {m}")


@pytest.fixture(scope="module")
def references(tiny_lm, tmp_path_factory):
    def single(*overrides):
        cfg = tiny_lm(*PIPELINE_LM, *overrides)
        return run_rank(cfg, tmp_path_factory.mktemp("single"), dist_env.detect(), after_fit=full_params)

    return {"gpt": single(), "llama": single("model=llama_tiny", "model.ffn_dim=null")}


@pytest.fixture(scope="module")
def two_rank_results(tiny_lm):
    cfgs = [tiny_lm(*PIPELINE_LM, *overrides) for overrides in VARIANTS_2.values()]
    return dict(zip(VARIANTS_2, run_spawned(cfgs, world_size=2, inspect=full_params), strict=True))


@pytest.mark.parametrize("name", list(VARIANTS_2))
def test_pipeline_matches_single_process(name, two_rank_results, references):
    reference = references["llama" if "llama" in name else "gpt"]
    assert_same_training(two_rank_results[name], reference)


def test_each_rank_holds_its_stages_layers_under_the_unsplit_names(two_rank_results, references):
    assert references["gpt"]["held"] == ["blocks.0", "blocks.1", "blocks.2", "blocks.3", "embed.pos", "embed.tok",
                                         "head.ln_f", "head.out"]  # fmt: skip
    assert two_rank_results["1f1b"]["held"] == ["blocks.0", "blocks.1", "embed.pos", "embed.tok"]
    # interleaved: stage i on rank i mod 2, so rank 0 holds stages 0 and 2 (blocks 0 and 2)
    assert two_rank_results["interleaved_1f1b"]["held"] == ["blocks.0", "blocks.2", "embed.pos", "embed.tok"]
