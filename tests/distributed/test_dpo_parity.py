"""task=dpo trains alike on 1 process and on 2 fully_sharded (and ddp) ranks, with LoRA (reference: the adapters
off) and with full fine-tuning (reference: the starting model's log-probabilities, computed once and kept with the
checkpoints), and a resumed run continues the uninterrupted curve, also on another world size (CPU, gloo); packed
pairs (data.pack=true) on 2 fully_sharded ranks follow the packed single process too (each rank packs its own
micro-batch; tests/unit/test_dpo_packing.py compares packed with unpacked), and so do 2 tensor-parallel ranks.

A resume that recomputed the reference from the weights it resumes would restart the rewards at 0: the resumed
curves below would part from the uninterrupted one at once."""

from __future__ import annotations

import pytest
import torch

from shardlab.cli.preflight import compose_config
from shardlab.distributed import env as dist_env
from shardlab.runner import run_rank
from tests.distributed.harness import run_spawned

RTOL = 1e-5
FSDP = "distributed.backend=fully_sharded"
DPO_TINY = [
    "task=dpo", "model.num_layers=1", "model.dim=32", "model.num_heads=2", "data.seq_len=256",
    "optimization.max_steps=6", "optimization.batch_size=4", "optimizer.lr=3e-3", "lr_scheduler.warmup_steps=0",
    "validation.interval_steps=0", "validation.batch_size=4", "checkpoint.interval_steps=3",
    "logging.progress_bar=false", "logging.tensorboard=false", "logging.interval_steps=1",
]  # fmt: skip
"""task=dpo on the demo pairs, small enough for a few steps in seconds."""
TP = "distributed.tensor_parallel_degree=2"
"""Sequence-parallel tensor parallelism: each micro-batch's rows a multiple of 2 long (PreferenceTask.collate)."""
PACK = ["data.pack=true", "model.max_seq_len=512", "data.seq_len=512"]
"""Each rank's micro-batch of pairs packed into shared rows (shardlab_tasks/lm/finetuning/preference.py: pack_pairs),
two of the demo's answers (~200 tokens) to a row."""
LORA = ["model.lora.rank=4", "model.lora.alpha=8", "model.lora.target_modules=[attn.*,mlp.*]"]
REWARD_ATOL = 1e-5
"""A reward is beta times the difference of two sums of ~200 log-probabilities (~-300 each, fp32): a rank's other
micro-batch shape moves them by ~1e-5 absolute (measured 1.5e-6 on rewards of ~4e-3), a relative tolerance cannot
hold there."""
METRICS = ("loss", "gnorm", "rewards/chosen", "rewards/rejected", "rewards/accuracies")


def dpo(*overrides: str):
    return compose_config([*DPO_TINY, *overrides])


def history(result: dict) -> dict[int, dict]:
    return {r["step"]: r for r in result["history"] if r["split"] == "train"}


def step3(run_dir) -> str:
    return str(run_dir / "checkpoints" / "step_00000003")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    single, lora_single = tmp_path_factory.mktemp("single"), tmp_path_factory.mktemp("lora_single")
    fsdp_dir = tmp_path_factory.mktemp("fsdp")
    reference = run_rank(dpo(), single, dist_env.detect())
    lora_reference = run_rank(dpo(*LORA), lora_single, dist_env.detect())
    packed_reference = run_rank(dpo(*PACK), tmp_path_factory.mktemp("packed_single"), dist_env.detect())
    fsdp, lora_fsdp, fsdp_from_single, packed, tp = run_spawned(
        [dpo(FSDP), dpo(FSDP, *LORA), dpo(FSDP, f"checkpoint.resume={step3(single)}"), dpo(FSDP, *PACK),
         dpo(FSDP, TP)],
        world_size=2,
        run_dirs=[fsdp_dir, *(tmp_path_factory.mktemp(n) for n in ("lora_fsdp", "resumed", "packed", "tp"))],
    )  # fmt: skip
    single_from_fsdp = run_rank(
        dpo(f"checkpoint.resume={step3(fsdp_dir)}"), tmp_path_factory.mktemp("from_fsdp"), dist_env.detect()
    )
    return {
        "reference": reference, "lora_reference": lora_reference, "fsdp": fsdp, "lora_fsdp": lora_fsdp,
        "fsdp_from_single": fsdp_from_single, "single_from_fsdp": single_from_fsdp, "fsdp_packed": packed,
        "packed_reference": packed_reference, "tp": tp, "lora_single_dir": lora_single,
    }  # fmt: skip


@pytest.fixture(scope="module")
def slow_runs(runs, tmp_path_factory):
    """The rest of the matrix, with -m slow (the suite's 15 minutes): ddp, a LoRA resume across world sizes, packed
    LoRA and packed tensor parallelism."""
    lora_packed_single = tmp_path_factory.mktemp("lora_packed_single")
    lora_packed_reference = run_rank(dpo(*LORA, *PACK), lora_packed_single, dist_env.detect())
    ddp, lora_from_single, lora_packed, tp_packed = run_spawned(
        [dpo("distributed.backend=ddp"), dpo(FSDP, *LORA, f"checkpoint.resume={step3(runs['lora_single_dir'])}"),
         dpo(FSDP, *LORA, *PACK), dpo(FSDP, TP, *PACK)],
        world_size=2,
        run_dirs=[tmp_path_factory.mktemp(n) for n in ("ddp", "lora_resumed", "lora_packed", "tp_packed")],
    )  # fmt: skip
    return {
        **runs, "ddp": ddp, "lora_fsdp_from_single": lora_from_single, "lora_fsdp_packed": lora_packed,
        "lora_packed_reference": lora_packed_reference, "tp_packed": tp_packed,
    }  # fmt: skip


SLOW = {"ddp", "lora_fsdp_from_single", "lora_fsdp_packed", "tp_packed"}


@pytest.mark.parametrize(
    ("name", "against"),
    [pytest.param(name, against, marks=[pytest.mark.slow] if name in SLOW else [])
     for name, against in [
         ("fsdp", "reference"), ("lora_fsdp", "lora_reference"), ("fsdp_from_single", "reference"),
         ("single_from_fsdp", "reference"), ("ddp", "reference"), ("lora_fsdp_from_single", "lora_reference"),
         ("fsdp_packed", "packed_reference"), ("lora_fsdp_packed", "lora_packed_reference"), ("tp", "reference"),
         ("tp_packed", "packed_reference")]],
)  # fmt: skip
def test_two_ranks_and_resumes_follow_the_single_process_curve(request, name, against):
    runs = request.getfixturevalue("slow_runs" if name in SLOW else "runs")
    got, expected = history(runs[name]), history(runs[against])
    first = 4 if "from" in name else 1  # a resumed run starts after its checkpoint's step
    assert sorted(got) == list(range(first, 7))
    assert abs(expected[6]["rewards/chosen"]) > 1e-3  # the policy moved off its reference
    for metric in METRICS:
        torch.testing.assert_close(
            torch.tensor([got[s][metric] for s in sorted(got)], dtype=torch.float64),
            torch.tensor([expected[s][metric] for s in sorted(got)], dtype=torch.float64),
            rtol=RTOL, atol=REWARD_ATOL if metric.startswith("rewards/") else 0, msg=lambda m, k=metric: f"{k}: {m}",
        )  # fmt: skip
