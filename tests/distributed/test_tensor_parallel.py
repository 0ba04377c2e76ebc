"""Tensor parallelism (with sequence parallelism) trains exactly like one process on the same global batch (CPU, gloo):
TP 2 alone, FSDP 2 x TP 2 and hybrid (2 replicas) x TP 2 on 4 ranks, for a Llama built from its config; TP 2 and
FSDP 2 x TP 2 for GPT (tied and untied; its fused qkv regrouped by heads); TP 2 for a
Llama with tied embeddings, a Qwen2 (biases), a Qwen3 (q/k norms) and a Mistral read from Hugging Face folders made by
transformers, and for fine-tuning on packed rows. Losses, the gradient norm of every step, the tokens counted and the
final weights are compared; step folders move between FSDP 2 x TP 2 and one process. Every run takes its loss on
logits split over the vocabulary (distributed.loss_parallel, the default), one Llama run on gathered ones."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.tensor import DTensor

from shardlab.cli.preflight import compose_config
from shardlab.distributed import env as dist_env
from shardlab.runner import run_rank
from tests.distributed.harness import run_spawned
from tests.hf_folders import make_folder
from tests.unit.test_sft import SFT_TINY

LLAMA = ["model=llama_tiny", "model.num_kv_heads=2", "model.ffn_dim=null"]
TP2 = ["distributed.backend=fully_sharded", "distributed.tensor_parallel_degree=2"]
HF = ["optimizer.lr=1e-3", "lr_scheduler.warmup_steps=0"]
FAMILIES = ("llama3_tied", "qwen2", "qwen3", "mistral")
"""Tied embeddings (one weight split by vocabulary rows for the embedding and the head), q/k/v biases split with their
outputs (Qwen2, tied too), q/k norms over each rank's heads (Qwen3, head_dim 32), Mistral."""
LORA = ["model.lora.rank=4", "model.lora.alpha=8", "model.lora.target_modules=[attn.*,mlp.*]"]
"""LoRA on every linear of the blocks of a Qwen3: adapters split with their layers (A whole for column-wise layers,
B whole for row-wise ones), the frozen base read from the folder into its tensor-parallel shards."""
SFT = [
    *SFT_TINY,
    "model=llama_tiny",
    "model.dim=32",
    "model.num_heads=2",
    "model.num_kv_heads=2",
    "model.ffn_dim=64",
    "model.max_seq_len=128",
    "optimization.max_steps=10",
    "optimization.batch_size=4",
    "optimization.update_freq=2",
]
"""Fine-tuning on packed rows (each sample's attention kept to itself by a mask, positions restarting), with micro-
batches weighted by their answer tokens."""
LOSS_RTOL = 1e-5
"""One process and the split ranks add the same products in another order (row-wise partial sums, the vocabulary
split in two): rounding only."""
PARAM_ATOL = 3e-5
"""The final weights after 10 Adam steps: Adam scales the rounding noise of a ~0 gradient up to a step of ~lr. The
loss-parallel log-sum-exp (each rank's half of the vocabulary summed, then the halves) adds another order: measured
1.5e-5 on one of 8192 elements (Qwen3's attn.o, lr 1e-3), every loss and gradient norm still within LOSS_RTOL."""


def inspect(trainer) -> dict:
    """The full weights after training, how the model's parameters are placed, and how it hands its logits on."""
    model = trainer.model
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    placements = {n: [str(p) for p in t.placements] for n, t in model.named_parameters() if isinstance(t, DTensor)}
    with torch.no_grad():
        logits = model(torch.zeros(1, 8, dtype=torch.long))
    logits = [str(p) for p in logits.placements] if isinstance(logits, DTensor) else "whole"
    return {"params": full, "placements": placements, "dp": trainer.backend.dp_world_size, "logits": logits}


def train_records(result: dict, key: str) -> torch.Tensor:
    return torch.tensor([r[key] for r in result["history"] if r["split"] == "train"], dtype=torch.float64)


def tokens_per_step(result: dict) -> torch.Tensor:
    return train_records(result, "tokens_per_s") * train_records(result, "ms_per_step") / 1000


def assert_trains_as_one_process(result: dict, reference: dict) -> None:
    assert len(train_records(result, "loss")) == 10
    # Tokens counted once per data-parallel rank, not once per tensor-parallel rank (which read the same samples):
    # each logged step (logging.interval_steps=1) processed what one process did (pretraining: 8 x 32).
    torch.testing.assert_close(tokens_per_step(result), tokens_per_step(reference), rtol=1e-6, atol=0)
    torch.testing.assert_close(train_records(result, "loss"), train_records(reference, "loss"), rtol=LOSS_RTOL, atol=0)
    torch.testing.assert_close(train_records(result, "gnorm"), train_records(reference, "gnorm"), rtol=1e-5, atol=0)
    assert result["params"].keys() == reference["params"].keys()
    for key, value in reference["params"].items():
        torch.testing.assert_close(
            result["params"][key], value, rtol=1e-5, atol=PARAM_ATOL, msg=lambda m, k=key: f"{k}: {m}"
        )


@pytest.fixture(scope="module")
def hf_folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    return {family: make_folder(family, root / family) for family in FAMILIES}


SLOW_VARIANTS = ("llama_tp2_gathered", "llama_tp2_bf16", "qwen2_tp2", "mistral_tp2")
"""Run with -m slow (the suite's 15 minutes): the gathered-logits loss, bf16, and two of the Hugging Face families
(Qwen2's biases, Mistral); the default suite keeps Llama, GPT, Llama 3 tied, Qwen3, fine-tuning and LoRA."""


def two_rank_configs(tiny_lm, hf_folders) -> dict:
    return {
        "llama_tp2": tiny_lm(*LLAMA, *TP2),
        "llama_tp2_gathered": tiny_lm(*LLAMA, *TP2, "distributed.loss_parallel=false"),
        "gpt_tp2": tiny_lm(*TP2),
        "llama_tp2_bf16": tiny_lm(*LLAMA, *TP2, "distributed.precision=bf16"),
        **{f"{f}_tp2": tiny_lm(*TP2, *HF, f"model.pretrained={folder}") for f, folder in hf_folders.items()},
        "sft_tp2": compose_config([*SFT, *TP2]),
        "lora_tp2": tiny_lm(*TP2, *HF, *LORA, f"model.pretrained={hf_folders['qwen3']}"),
    }


@pytest.fixture(scope="module")
def two_rank_results(tiny_lm, hf_folders):
    """The default suite's TP 2 runs, in one 2-rank spawn."""
    cfgs = {k: v for k, v in two_rank_configs(tiny_lm, hf_folders).items() if k not in SLOW_VARIANTS}
    return dict(zip(cfgs, run_spawned(list(cfgs.values()), world_size=2, inspect=inspect), strict=True))


@pytest.fixture(scope="module")
def slow_two_rank_results(tiny_lm, hf_folders):
    """SLOW_VARIANTS, in a 2-rank spawn of their own."""
    cfgs = {k: v for k, v in two_rank_configs(tiny_lm, hf_folders).items() if k in SLOW_VARIANTS}
    return dict(zip(cfgs, run_spawned(list(cfgs.values()), world_size=2, inspect=inspect), strict=True))


@pytest.fixture(scope="module")
def llama_reference(tiny_lm, tmp_path_factory) -> tuple[dict, object]:
    """One process training the Llama 10 steps, saving at steps 5 and 10: (its result, its run folder)."""
    run_dir = tmp_path_factory.mktemp("single")
    return single(tiny_lm(*LLAMA, *CKPT), run_dir), run_dir


def single(cfg, tmp_path) -> dict:
    return run_rank(cfg, tmp_path, dist_env.detect(), after_fit=inspect)


@pytest.mark.parametrize(
    "name",
    [
        pytest.param(name, marks=[pytest.mark.slow] if name in SLOW_VARIANTS else [])
        for name in [
            "llama_tp2",
            "llama_tp2_gathered",
            "gpt_tp2",
            *(f"{f}_tp2" for f in FAMILIES),
            "sft_tp2",
            "lora_tp2",
        ]
    ],
)
def test_tensor_parallel_ranks_train_as_one_process(name, request, llama_reference, tiny_lm, hf_folders, tmp_path):
    """The loss on logits split over the vocabulary (distributed.loss_parallel, the default) and on gathered ones."""
    result = request.getfixturevalue("slow_two_rank_results" if name in SLOW_VARIANTS else "two_rank_results")[name]
    # loss parallel: the head hands on (batch, sequence, vocabulary / 2) per rank, never the whole logits
    assert result["logits"] == ("whole" if name.endswith("_gathered") else ["S(2)"]), result["logits"]
    family = name.removesuffix("_gathered").removesuffix("_tp2")
    if family == "sft":
        reference = single(compose_config(SFT), tmp_path)
    elif family == "lora":
        reference = single(tiny_lm(*HF, *LORA, f"model.pretrained={hf_folders['qwen3']}"), tmp_path)
    elif family == "llama":
        reference = llama_reference[0]
    elif family == "gpt":
        reference = single(tiny_lm(), tmp_path)
    else:
        reference = single(tiny_lm(*HF, f"model.pretrained={hf_folders[family]}"), tmp_path)
    assert result["dp"] == 1  # both ranks read the same samples
    assert result["placements"], "no parameter was split"
    tp = {name: placements[-1] for name, placements in result["placements"].items()}  # the mesh's last axis
    if family == "gpt":  # the fused qkv by rows (regrouped by heads in its output), the embedding tied to the head
        assert tp["blocks.0.attn.qkv.weight"] == tp["embed.tok.weight"] == tp["embed.pos.weight"] == "S(0)", tp
        assert tp["blocks.0.attn.proj.weight"] == tp["blocks.0.mlp.proj.weight"] == "S(1)", tp
        assert_trains_as_one_process(result, reference)
        return
    assert tp["blocks.0.attn.q.weight"] == tp["blocks.0.mlp.up.weight"] == tp["embed.weight"] == "S(0)", tp
    assert tp["blocks.0.attn.o.weight"] == tp["blocks.0.mlp.down.weight"] == "S(1)", tp
    assert tp["blocks.0.attn_norm.weight"] == "R", tp
    if family == "lora":  # column-wise: A whole, B by rows; row-wise: A by columns, B whole
        assert (tp["blocks.0.attn.q.lora_A.weight"], tp["blocks.0.attn.q.lora_B.weight"]) == ("R", "S(0)"), tp
        assert (tp["blocks.0.mlp.down.lora_A.weight"], tp["blocks.0.mlp.down.lora_B.weight"]) == ("S(1)", "R"), tp
    assert_trains_as_one_process(result, reference)


@pytest.mark.slow
def test_bf16_under_tensor_parallelism_stays_finite_and_tracks_fp32(slow_two_rank_results, llama_reference):
    """FSDP2's bf16 parameters on the tensor-parallel shards, fp32 reduction: within 2% of one fp32 process (bf16
    keeps ~3 significant digits)."""
    low, fp32 = (
        train_records(slow_two_rank_results["llama_tp2_bf16"], "loss"),
        train_records(llama_reference[0], "loss"),
    )
    assert torch.isfinite(low).all()
    torch.testing.assert_close(low, fp32, rtol=0.02, atol=0)


CKPT = ["checkpoint.interval_steps=5"]
TORCHTITAN_AC = [  # selective op checkpointing (every other matmul kept), the embedding and head units unwrapped
    "distributed.activation_checkpointing=selective_op",
    "distributed.ac_matmul_save_every=2",
    "distributed.ac_skip_units=[0,-1]",
]
FSDP2_TP2 = [*TP2, "distributed.sharding_degree=2"]
HYBRID2_TP2 = [*TP2, "distributed.sharding_degree=1"]  # 2 replicas, each split over 2 tensor-parallel ranks


@pytest.fixture(scope="module")
def four_rank_results(tiny_lm, tmp_path_factory, llama_reference):
    """On 4 ranks: FSDP 2 x TP 2 (saving at step 5), hybrid 2 x TP 2, and FSDP 2 x TP 2 resuming one process's step
    5; then one process resuming the FSDP 2 x TP 2 step 5. The reference: one process, uninterrupted."""
    reference, single_dir = llama_reference
    fsdp_dir = tmp_path_factory.mktemp("fsdp2_tp2")
    single_step5 = single_dir / "checkpoints" / "step_00000005"
    cfgs = {
        "fsdp2_tp2": tiny_lm(*LLAMA, *FSDP2_TP2, *CKPT),
        "hybrid2_tp2": tiny_lm(*LLAMA, *HYBRID2_TP2),
        "fsdp2_tp2_ac": tiny_lm(*LLAMA, *FSDP2_TP2, *TORCHTITAN_AC),
        "gpt_fsdp2_tp2": tiny_lm(*FSDP2_TP2, "model.tie_embeddings=false"),
        "fsdp2_tp2_from_single": tiny_lm(*LLAMA, *FSDP2_TP2, f"checkpoint.resume={single_step5}"),
    }
    run_dirs = [fsdp_dir, *(tmp_path_factory.mktemp(name) for name in ("hybrid", "ac", "gpt", "from_single"))]
    results = dict(zip(cfgs, run_spawned(list(cfgs.values()), 4, run_dirs=run_dirs, inspect=inspect), strict=True))
    fsdp_step5 = fsdp_dir / "checkpoints" / "step_00000005"
    results["single_from_fsdp2_tp2"] = single(
        tiny_lm(*LLAMA, f"checkpoint.resume={fsdp_step5}"), tmp_path_factory.mktemp("single_from")
    )
    results["gpt_reference"] = single(tiny_lm("model.tie_embeddings=false"), tmp_path_factory.mktemp("gpt_single"))
    return {**results, "reference": reference, "reference_dir": single_dir, "fsdp2_tp2_dir": fsdp_dir}


@pytest.mark.parametrize(
    ("name", "dp", "mesh"),
    [("fsdp2_tp2", 2, 2), ("hybrid2_tp2", 2, 3), ("fsdp2_tp2_ac", 2, 2), ("gpt_fsdp2_tp2", 2, 2)],
)
def test_data_and_tensor_parallel_ranks_train_as_one_process(name, dp, mesh, four_rank_results):
    """FSDP 2 x TP 2: every parameter is placed on the 2-D mesh (data shard, tensor); hybrid: 3-D (replicate, shard
    of 1, tensor); torchtitan's selective checkpointing, applied after TP, recomputes the same math. The two
    data-parallel groups each read half of every batch."""
    result = four_rank_results[name]
    assert result["dp"] == dp
    assert result["logits"] == ["S(2)"], result["logits"]  # split over the vocabulary on the tensor axis alone
    assert {len(p) for p in result["placements"].values()} == {mesh}, result["placements"]
    reference = four_rank_results["gpt_reference" if name.startswith("gpt") else "reference"]
    assert_trains_as_one_process(result, reference)


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


def test_a_tensor_parallel_step_folder_exports_the_weights_one_process_exports(four_rank_results, tmp_path):
    """shardlab-export reads a step folder of FSDP 2 x TP 2 (DTensors split two ways) into the same Hugging Face
    folder as one process's step folder of the same training."""
    from safetensors.torch import load_file

    from shardlab_commands import export_hf

    exported = {}
    for name in ("fsdp2_tp2", "reference"):
        out = export_hf.main([str(four_rank_results[f"{name}_dir"] / "checkpoints" / "step_00000010"), "--out",
                              str(tmp_path / name)])  # fmt: skip
        exported[name] = {k: v for f in sorted(out.glob("*.safetensors")) for k, v in load_file(f).items()}
    assert exported["fsdp2_tp2"].keys() == exported["reference"].keys() and exported["reference"]
    for key, value in exported["reference"].items():
        torch.testing.assert_close(exported["fsdp2_tp2"][key], value, rtol=1e-5, atol=1e-5, msg=key)
