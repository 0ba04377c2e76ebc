"""Pipeline parallelism (shardlab.distributed.pipeline) trains exactly like one process on the same global batch (CPU,
gloo): the same losses, gradient norms (clipped over all stages) and weights after 10 steps, with 1F1B, interleaved
1F1B (2 stages per rank) and PP composed with FSDP, with hybrid sharding and with FSDP x TP (3D, the logits split over
the vocabulary: loss parallel); and a PP run's step folder resumes on one process."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import FSDPModule

from shardlab.cli.preflight import compose_config
from shardlab.distributed import env as dist_env
from shardlab.runner import run_rank
from tests.distributed.harness import run_spawned
from tests.distributed.test_tensor_parallel import SFT

# 4 blocks: 2 per stage at PP 2, 1 per stage with 2 stages per rank. Untied: the embedding lives on the first stage and
# the head on the last. Each step's 2 micro-batches (update_freq) are the pipeline's micro-batches.
PIPELINE_LM = ["model.num_layers=4", "model.tie_embeddings=false", "optimization.update_freq=2"]
FSDP = "distributed.backend=fully_sharded"
PP2 = [FSDP, "distributed.pipeline_parallel_degree=2"]
LLAMA = ["model=llama_tiny", "model.ffn_dim=null"]
GQA = ["model.num_heads=4", "model.num_kv_heads=2"]
VARIANTS_2 = {
    "1f1b": [*PP2, "distributed.pipeline_schedule=1f1b"],
    "interleaved_1f1b": [
        *PP2,
        "distributed.pipeline_schedule=interleaved_1f1b",
        "distributed.pipeline_stages_per_rank=2",
    ],
    "gpipe_llama": [*PP2, "distributed.pipeline_schedule=gpipe", *LLAMA],
    "1f1b_act_ckpt": [*PP2, "distributed.activation_checkpointing=full"],  # each stage's units wrapped alone
}
SFT_PP = [*SFT, *PIPELINE_LM, "data.pack=false"]
"""Fine-tuning on rows of one sample each (a Llama, 4 blocks): the loss over the answer tokens only, each micro-batch
weighted by its share of the step's answer tokens on all data-parallel ranks, as without a pipeline. Through the
pipeline the rows keep data.seq_len positions (the stages exchange activations of one shape); one process cuts them
to each micro-batch's longest sample."""


def full_params(trainer) -> dict:
    """Every stage's parameters, gathered over its data-parallel shards and then over the pipeline ranks; and the
    layers this rank (rank 0: the first stage) holds."""
    full = get_model_state_dict(trainer.model, options=StateDictOptions(full_state_dict=True))
    held = sorted({".".join(k.split(".")[:2]) for k in full})
    full = {k: v.detach().cpu().clone() for k, v in full.items()}
    logged = [(r["split"], r["step"], r["loss"], r.get("tokens_per_s", 0) > 0) for r in trainer.history]
    every_rank = [logged]
    if dist.is_initialized() and dist.get_world_size() > 1:
        gathered: list[dict] = [{} for _ in range(dist.get_world_size())]
        dist.all_gather_object(gathered, full)
        full = {k: v for part in gathered for k, v in part.items()}
        every_rank = [None] * dist.get_world_size()
        dist.all_gather_object(every_rank, logged)
    # whether this rank's stages are FSDP2 modules (fully_sharded.stages_unsharded: not when alone on the data axis)
    fsdp = any(isinstance(m, FSDPModule) for m in trainer.model.modules())
    layout = trainer.backend.dims.describe()
    return {"params": full, "held": held, "layout": layout, "logged": every_rank, "fsdp": fsdp}


def train_records(result: dict, key: str) -> torch.Tensor:
    return torch.tensor([r[key] for r in result["history"] if r["split"] == "train"], dtype=torch.float64)


def valid_losses(result: dict) -> torch.Tensor:
    return torch.tensor([r["loss"] for r in result["history"] if r["split"] == "valid"], dtype=torch.float64)


def assert_same_training(result: dict, reference: dict) -> None:
    # every rank (first stage, last stage, each data-parallel and tensor-parallel one) logged the same losses
    assert all(logged == result["logged"][0] for logged in result["logged"]), result["logged"]
    assert len(train_records(result, "loss")) == 10
    torch.testing.assert_close(train_records(result, "loss"), train_records(reference, "loss"), rtol=1e-5, atol=0)
    torch.testing.assert_close(train_records(result, "gnorm"), train_records(reference, "gnorm"), rtol=1e-4, atol=0)
    torch.testing.assert_close(valid_losses(result), valid_losses(reference), rtol=1e-5, atol=0)
    assert result["params"].keys() == reference["params"].keys()
    for key, value in reference["params"].items():
        torch.testing.assert_close(result["params"][key], value, rtol=1e-5, atol=1e-5, msg=lambda m, k=key: f"{k}: {m}")


CKPT = "checkpoint.interval_steps=5"


@pytest.fixture(scope="module")
def references(tiny_lm, tmp_path_factory):
    def single(name, *overrides):
        run_dir = tmp_path_factory.mktemp(name)
        result = run_rank(tiny_lm(*PIPELINE_LM, CKPT, *overrides), run_dir, dist_env.detect(), after_fit=full_params)
        return {**result, "run_dir": run_dir}

    sft = run_rank(compose_config(SFT_PP), tmp_path_factory.mktemp("sft"), dist_env.detect(), after_fit=full_params)
    return {
        "gpt": single("single"),
        "llama": single("single_llama", *LLAMA),
        "llama_gqa": single("single_llama_gqa", *LLAMA, *GQA),
        "sft": sft,
    }


def step5(result: dict):
    return result["run_dir"] / "checkpoints" / "step_00000005"


@pytest.fixture(scope="module")
def two_rank_results(tiny_lm, references, tmp_path_factory):
    variants = {
        **VARIANTS_2,
        "1f1b_from_single": [*VARIANTS_2["1f1b"], f"checkpoint.resume={step5(references['gpt'])}"],
    }
    cfgs = [tiny_lm(*PIPELINE_LM, CKPT, *overrides) for overrides in variants.values()]
    cfgs.append(compose_config([*SFT_PP, *PP2]))
    run_dirs = [tmp_path_factory.mktemp(name) for name in (*variants, "sft")]
    results = run_spawned(cfgs, world_size=2, run_dirs=run_dirs, inspect=full_params)
    for result, run_dir in zip(results, run_dirs, strict=True):
        result["run_dir"] = run_dir
    return dict(zip((*variants, "sft"), results, strict=True))


@pytest.fixture(scope="module")
def four_rank_results(tiny_lm, three_d_results):
    """PP 2 x FSDP 2: each stage sharded over its 2 data-parallel ranks, which read different halves of each batch;
    PP 2 x TP 2 on the GPT (its fused qkv split by heads, token and position tables by rows); and the 3D run's step 5
    resumed on 4 plain FSDP ranks (in the same spawn)."""
    cfgs = [
        tiny_lm(*PIPELINE_LM, *VARIANTS_2["1f1b"]),
        tiny_lm(*PIPELINE_LM, *VARIANTS_2["1f1b"], "distributed.tensor_parallel_degree=2"),
        tiny_lm(*PIPELINE_LM, *LLAMA, *GQA, FSDP, f"checkpoint.resume={step5(three_d_results)}"),
        compose_config([*SFT_PP, *PP2]),
    ]
    results = run_spawned(cfgs, world_size=4, inspect=full_params)
    return dict(zip(("fsdp", "tp", "fsdp4_from_3d", "sft"), results, strict=True))


@pytest.mark.parametrize("name", list(VARIANTS_2))
def test_pipeline_matches_single_process(name, two_rank_results, references):
    reference = references["llama" if "llama" in name else "gpt"]
    assert_same_training(two_rank_results[name], reference)


THREE_D = [*VARIANTS_2["1f1b"], *LLAMA, *GQA, "distributed.tensor_parallel_degree=2"]


@pytest.fixture(scope="module")
def three_d_results(tiny_lm, references, tmp_path_factory):
    """FSDP 2 x TP 2 x PP 2 on a Llama (GQA: 4 query and 2 key/value heads, so each TP rank holds one KV head); and,
    in the same spawn, one process's step 5 resumed in that layout, and PP 2 x hybrid sharding (2 replicas x FSDP 2)
    on the GPT."""
    cfgs = [
        tiny_lm(*PIPELINE_LM, CKPT, *THREE_D),
        tiny_lm(*PIPELINE_LM, *THREE_D, f"checkpoint.resume={step5(references['llama_gqa'])}"),
        tiny_lm(*PIPELINE_LM, *VARIANTS_2["1f1b"], "distributed.sharding_degree=2"),
    ]
    run_dirs = [tmp_path_factory.mktemp(name) for name in ("three_d", "three_d_from_single", "pp_hybrid")]
    trained, from_single, hybrid = run_spawned(cfgs, world_size=8, run_dirs=run_dirs, inspect=full_params)
    return {**trained, "run_dir": run_dirs[0], "from_single": from_single, "hybrid": hybrid}


def test_fsdp_tp_pp_matches_single_process(three_d_results, references):
    assert three_d_results["layout"] == "pp 2 x dp_shard 2 x tp 2"
    assert_same_training(three_d_results, references["llama_gqa"])


@pytest.mark.parametrize("ranks", [2, 4])
def test_fine_tuning_through_the_pipeline_matches_single_process(
    ranks, two_rank_results, four_rank_results, references
):  # noqa: E501
    """PP 2 alone, and PP 2 x FSDP 2, whose 2 data-parallel ranks hold different answer-token counts: the step's
    gradient is the mean over all its answer tokens, each counted once though every stage reads the rows."""
    result = (two_rank_results if ranks == 2 else four_rank_results)["sft"]
    assert result["layout"] == ("pp 2" if ranks == 2 else "pp 2 x dp_shard 2")
    assert_same_training(result, references["sft"])


def test_pipeline_composed_with_hybrid_sharding_matches_single_process(three_d_results, references):
    """Each stage sharded over 2 ranks and replicated over 2 more (HSDP: reduce-scatter, then all-reduce across the
    replicas), the 4 data-parallel ranks each reading a quarter of every batch."""
    assert three_d_results["hybrid"]["layout"] == "pp 2 x dp_replicate 2 x dp_shard 2"
    assert_same_training(three_d_results["hybrid"], references["gpt"])


def test_pipeline_composed_with_fsdp_matches_single_process(four_rank_results, references):
    assert four_rank_results["fsdp"]["layout"] == "pp 2 x dp_shard 2"
    assert_same_training(four_rank_results["fsdp"], references["gpt"])
    assert four_rank_results["fsdp"]["held"] == ["blocks.0", "blocks.1", "embed.pos", "embed.tok"]


def test_pipeline_composed_with_tensor_parallel_gpt_matches_single_process(four_rank_results, references):
    assert four_rank_results["tp"]["layout"] == "pp 2 x tp 2"
    assert_same_training(four_rank_results["tp"], references["gpt"])


def train_losses(result: dict) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in result["history"] if r["split"] == "train"}


def assert_continues(resumed: dict, reference: dict) -> None:
    got, expected = train_losses(resumed), train_losses(reference)
    assert sorted(got) == list(range(6, 11)), "a resumed run starts after its checkpoint's step"
    torch.testing.assert_close(
        torch.tensor([got[s] for s in sorted(got)]), torch.tensor([expected[s] for s in sorted(got)]), rtol=1e-5, atol=0
    )


def test_a_pipeline_checkpoint_resumes_on_one_process(tiny_lm, two_rank_results, references, tmp_path):
    """Each stage saved its own layers under the unsplit model's names: one process reads them all back."""
    cfg = tiny_lm(*PIPELINE_LM, f"checkpoint.resume={step5(two_rank_results['1f1b'])}")
    resumed = run_rank(cfg, tmp_path, dist_env.detect(), after_fit=full_params)
    assert_continues(resumed, references["gpt"])
    for key, value in references["gpt"]["params"].items():
        torch.testing.assert_close(
            resumed["params"][key], value, rtol=1e-5, atol=1e-5, msg=lambda m, k=key: f"{k}: {m}"
        )


def test_a_one_process_checkpoint_resumes_in_a_pipeline(two_rank_results, references):
    assert_continues(two_rank_results["1f1b_from_single"], references["gpt"])


def test_each_rank_holds_its_stages_layers_under_the_unsplit_names(two_rank_results, references):
    assert references["gpt"]["held"] == ["blocks.0", "blocks.1", "blocks.2", "blocks.3", "embed.pos", "embed.tok",
                                         "head.ln_f", "head.out"]  # fmt: skip
    assert two_rank_results["1f1b"]["held"] == ["blocks.0", "blocks.1", "embed.pos", "embed.tok"]
    # interleaved: stage i on rank i mod 2, so rank 0 holds stages 0 and 2 (blocks 0 and 2)
    assert two_rank_results["interleaved_1f1b"]["held"] == ["blocks.0", "blocks.2", "embed.pos", "embed.tok"]


def test_stages_are_fsdp2_modules_only_where_a_stage_has_data_parallel_ranks(two_rank_results, four_rank_results):
    """PP 2 alone in fp32: each stage is the only rank of its data axis, where FSDP2 would only copy, so it stays a
    plain module (the parity tests above hold it to one process all the same); PP 2 x FSDP 2 shards each stage."""
    assert [two_rank_results[name]["fsdp"] for name in VARIANTS_2] == [False] * len(VARIANTS_2)
    assert four_rank_results["fsdp"]["fsdp"] and four_rank_results["tp"]["fsdp"]


def test_a_3d_checkpoint_resumes_on_one_process(tiny_lm, three_d_results, references, tmp_path):
    cfg = tiny_lm(*PIPELINE_LM, *LLAMA, *GQA, f"checkpoint.resume={step5(three_d_results)}")
    assert_continues(run_rank(cfg, tmp_path, dist_env.detect()), references["llama_gqa"])


def test_a_3d_checkpoint_resumes_on_four_fsdp_ranks(four_rank_results, references):
    assert four_rank_results["fsdp4_from_3d"]["layout"] == "dp_shard 4"
    assert_continues(four_rank_results["fsdp4_from_3d"], references["llama_gqa"])


def test_a_one_process_checkpoint_resumes_in_3d(three_d_results, references):
    assert three_d_results["from_single"]["layout"] == "pp 2 x dp_shard 2 x tp 2"
    assert_continues(three_d_results["from_single"], references["llama_gqa"])


def test_a_3d_step_folder_exports_the_weights_one_process_exports(three_d_results, references, tmp_path):
    """shardlab-export reads the FSDP 2 x TP 2 x PP 2 step folder (each stage's shards under the unsplit names)
    into the Hugging Face folder one process's step folder of the same training gives."""
    from safetensors.torch import load_file

    from shardlab_commands import export_hf

    exported = {}
    for name, result in (("three_d", three_d_results), ("reference", references["llama_gqa"])):
        out = export_hf.main([str(result["run_dir"] / "checkpoints" / "step_00000010"), "--out", str(tmp_path / name)])
        exported[name] = {k: v for f in sorted(out.glob("*.safetensors")) for k, v in load_file(f).items()}
    assert exported["three_d"].keys() == exported["reference"].keys() and exported["reference"]
    for key, value in exported["reference"].items():
        torch.testing.assert_close(exported["three_d"][key], value, rtol=1e-5, atol=1e-5, msg=key)
