"""Checkpoints of two fully_sharded ranks: async saving, fallback past a torn shard, consolidation, init_from.

One single-process reference run; one spawn of two gloo ranks runs every sharded config (a spawn costs seconds).
"""

from __future__ import annotations

import shutil

import pytest
import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from shardlab.checkpoint import weights
from shardlab.distributed import env as dist_env
from shardlab.runner import run_rank
from shardlab_commands import consolidate
from tests.distributed.harness import run_spawned

RTOL = 1e-5
CKPT = ["checkpoint.interval_steps=5", "validation.interval_steps=0"]
FSDP = "distributed.backend=fully_sharded"


def full_state(trainer) -> dict:
    """The whole model on every rank's CPU (a collective under FSDP2); rank 0's comes back to the test."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return {"state": {k: v.clone() for k, v in get_model_state_dict(trainer.model, options=options).items()}}


def train_losses(result: dict) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in result["history"] if r["split"] == "train"}


def valid_at(result: dict, step: int) -> float:
    return next(r["loss"] for r in result["history"] if r["split"] == "valid" and r["step"] == step)


@pytest.fixture(scope="module")
def runs(tiny_lm, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ckpt_ranks")
    reference = run_rank(tiny_lm(*CKPT), tmp / "single", dist_env.detect(), after_fit=full_state)
    single_file = consolidate.consolidate(tmp / "single" / "checkpoints" / "step_00000010", tmp / "single.safetensors")
    torn = tmp / "torn" / "checkpoints"
    shutil.copytree(tmp / "single" / "checkpoints", torn)
    shard = next((torn / "step_00000010").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size * 3 // 4])  # only some ranks read the lost part
    sync, asynchronous, initialized, fallback = run_spawned(
        [
            tiny_lm(*CKPT, FSDP),
            tiny_lm(*CKPT, FSDP, "checkpoint.async_save=true"),
            tiny_lm(FSDP, f"checkpoint.init_from={single_file}", "optimization.max_steps=2"),
            tiny_lm(*CKPT, FSDP),
        ],
        world_size=2,
        run_dirs=[tmp / "sync", tmp / "async", tmp / "init", tmp / "torn"],
        inspect=full_state,
    )
    sharded_file = consolidate.consolidate(tmp / "sync" / "checkpoints" / "step_00000010", tmp / "fsdp2.safetensors")
    single_from_sharded = run_rank(
        tiny_lm(f"checkpoint.init_from={sharded_file}", "optimization.max_steps=2"), tmp / "s_init", dist_env.detect()
    )
    return {
        "tmp": tmp,
        "reference": reference,
        "sync": sync,
        "async": asynchronous,
        "initialized": initialized,
        "fallback": fallback,
        "sharded_file": sharded_file,
        "single_from_sharded": single_from_sharded,
    }


def test_consolidated_two_rank_checkpoint_holds_the_trained_model(runs):
    consolidated = weights.read_full(runs["sharded_file"])
    gathered, single = runs["sync"]["state"], runs["reference"]["state"]
    assert sorted(consolidated) == sorted(gathered) == sorted(single)
    for key, tensor in consolidated.items():
        assert torch.equal(tensor, gathered[key]), key  # exactly what the two ranks held
        # and what one process trains, to float rounding (sums in another order; Adam's normalisation lifts
        # near-zero gradients' rounding to ~1e-6 in the weights, hence the absolute tolerance)
        torch.testing.assert_close(tensor, single[key], rtol=1e-4, atol=1e-5)


def test_init_from_a_two_rank_file_reproduces_its_validation_loss_on_one_process(runs):
    assert valid_at(runs["single_from_sharded"], 0) == pytest.approx(runs["sync"]["final"]["loss"], rel=RTOL)


def test_init_from_a_single_process_file_reproduces_its_validation_loss_on_two_ranks(runs):
    assert valid_at(runs["initialized"], 0) == pytest.approx(runs["reference"]["final"]["loss"], rel=RTOL)


def test_async_save_on_two_ranks_matches_sync_losses_and_weights(runs):
    assert train_losses(runs["async"]) == train_losses(runs["sync"])
    for step in ("step_00000005", "step_00000010"):
        got = weights.read_full(runs["tmp"] / "async" / "checkpoints" / step)
        expected = weights.read_full(runs["tmp"] / "sync" / "checkpoints" / step)
        assert all(torch.equal(got[k], expected[k]) for k in expected), step


def test_torn_shard_seen_by_one_rank_falls_back_on_both(runs):
    got, expected = train_losses(runs["fallback"]), train_losses(runs["reference"])
    assert sorted(got) == list(range(6, 11))
    torch.testing.assert_close(
        torch.tensor([got[s] for s in sorted(got)]), torch.tensor([expected[s] for s in sorted(got)]), rtol=RTOL, atol=0
    )
    assert sorted(p.name for p in (runs["tmp"] / "torn" / "checkpoints").iterdir()) == [
        "step_00000005",
        "step_00000010",
        "step_00000010.unreadable-1",
    ]
