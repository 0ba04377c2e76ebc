"""optimization.ema on fully_sharded: each rank averages its own shards, and the average equals one process's; saved
on 2 ranks, resumed on 1, it continues the same average and losses."""

from __future__ import annotations

import pytest
import torch

from shardlab.distributed import env as dist_env
from shardlab.runner import run_rank
from tests.distributed.harness import run_spawned

EMA = ["optimization.ema.enabled=true", "optimization.ema.decay=0.7", "optimization.ema.schedule=cosine"]
CKPT = ["checkpoint.interval_steps=5"]
pytestmark = pytest.mark.slow  # a 2-rank spawn and three runs: ~40 s on 2 shared cores


def full_average(trainer) -> dict:
    """The whole average on every rank (a gather per tensor, here only), and the local shapes rank 0 held."""
    state = trainer.ema.state_dict()
    full = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone() for k, v in state.items()}
    local = {k: tuple((v.to_local() if hasattr(v, "to_local") else v).shape) for k, v in state.items()}
    return {"ema": full, "local_shapes": local}


def train_losses(result: dict) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in result["history"] if r["split"] == "train"}


@pytest.fixture(scope="module")
def runs(tiny_lm, tmp_path_factory):
    single = run_rank(tiny_lm(*EMA), tmp_path_factory.mktemp("single"), dist_env.detect(), full_average)
    fsdp_dir = tmp_path_factory.mktemp("fsdp2")
    (fsdp2,) = run_spawned(
        [tiny_lm(*EMA, *CKPT, "distributed.backend=fully_sharded")], world_size=2, run_dirs=[fsdp_dir],
        inspect=full_average,
    )  # fmt: skip
    step5 = fsdp_dir / "checkpoints" / "step_00000005"
    resumed = run_rank(
        tiny_lm(*EMA, f"checkpoint.resume={step5}"), tmp_path_factory.mktemp("resumed"), dist_env.detect(), full_average
    )
    return {"single": single, "fsdp2": fsdp2, "resumed": resumed}


def test_each_rank_averages_its_own_shards_and_the_average_matches_one_process(runs):
    single, fsdp2 = runs["single"], runs["fsdp2"]
    qkv = fsdp2["local_shapes"]["blocks.0.attn.qkv.weight"]
    assert qkv[0] * 2 == single["ema"]["blocks.0.attn.qkv.weight"].shape[0], "rank 0 holds half the rows"
    assert sorted(fsdp2["ema"]) == sorted(single["ema"])
    # Sharded and whole gradient reductions already move the weights ~1e-6 apart (near-zero biases: large relative).
    for name, tensor in single["ema"].items():
        torch.testing.assert_close(
            fsdp2["ema"][name], tensor, rtol=1e-4, atol=1e-5, msg=lambda m, name=name: f"{name}: {m}"
        )


def test_an_average_saved_on_two_ranks_resumes_on_one(runs):
    single, resumed = runs["single"], runs["resumed"]
    got, expected = train_losses(resumed), train_losses(single)
    assert sorted(got) == list(range(6, 11))
    torch.testing.assert_close(
        torch.tensor([got[s] for s in sorted(got)]), torch.tensor([expected[s] for s in sorted(got)]), rtol=1e-5, atol=0
    )
    for name, tensor in single["ema"].items():
        torch.testing.assert_close(
            resumed["ema"][name], tensor, rtol=1e-4, atol=1e-5, msg=lambda m, name=name: f"{name}: {m}"
        )
