"""Checkpoints move between world sizes and backends; hybrid sharding (2x2) trains like one process.

One uninterrupted single-process run is the reference. Checkpoints from its step 5 and from a 2-rank fully_sharded
run's step 5 are resumed on other world sizes and backends; every resumed run must continue the reference's losses.
"""

from __future__ import annotations

import pytest
import torch

from shardlab.distributed import env as dist_env
from shardlab.runner import run_rank
from tests.distributed.harness import run_spawned

RTOL = 1e-5
CKPT = ["checkpoint.interval_steps=5"]


def train_losses(result: dict) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in result["history"] if r["split"] == "train"}


def assert_continues(resumed: dict, reference: dict) -> None:
    got = train_losses(resumed)
    assert sorted(got) == list(range(6, 11)), "a resumed run starts after its checkpoint's step"
    expected = train_losses(reference)
    torch.testing.assert_close(
        torch.tensor([got[s] for s in sorted(got)], dtype=torch.float64),
        torch.tensor([expected[s] for s in sorted(got)], dtype=torch.float64),
        rtol=RTOL,
        atol=0,
    )


@pytest.fixture(scope="module")
def runs(tiny_lm, tmp_path_factory):
    single_dir = tmp_path_factory.mktemp("single")
    fsdp_dir = tmp_path_factory.mktemp("fsdp2")
    reference = run_rank(tiny_lm(*CKPT), single_dir, dist_env.detect())
    single_step5 = single_dir / "checkpoints" / "step_00000005"
    fsdp2, fsdp2_from_single = run_spawned(
        [
            tiny_lm(*CKPT, "distributed.backend=fully_sharded"),
            tiny_lm("distributed.backend=fully_sharded", f"checkpoint.resume={single_step5}"),
        ],
        world_size=2,
        run_dirs=[fsdp_dir, tmp_path_factory.mktemp("fsdp2_from_single")],
    )
    fsdp_step5 = fsdp_dir / "checkpoints" / "step_00000005"
    single_from_fsdp2 = run_rank(
        tiny_lm(f"checkpoint.resume={fsdp_step5}"), tmp_path_factory.mktemp("s_from_f"), dist_env.detect()
    )
    hybrid, replicated, hybrid_from_fsdp2, hybrid_selective = run_spawned(
        [
            tiny_lm("distributed.backend=fully_sharded", "distributed.sharding_degree=2"),
            tiny_lm("distributed.backend=fully_sharded", "distributed.sharding_degree=1"),
            tiny_lm(
                "distributed.backend=fully_sharded", "distributed.sharding_degree=2", f"checkpoint.resume={fsdp_step5}"
            ),
            tiny_lm(  # selective checkpointing on the hybrid mesh: the same math as without
                "distributed.backend=fully_sharded",
                "distributed.sharding_degree=2",
                "distributed.activation_checkpointing=selective_op",
            ),
        ],
        world_size=4,
    )
    return {
        "reference": reference,
        "fsdp2": fsdp2,
        "fsdp2_from_single": fsdp2_from_single,
        "single_from_fsdp2": single_from_fsdp2,
        "hybrid": hybrid,
        "replicated": replicated,
        "hybrid_from_fsdp2": hybrid_from_fsdp2,
        "hybrid_selective": hybrid_selective,
    }


@pytest.mark.parametrize("name", ["fsdp2", "hybrid", "replicated", "hybrid_selective"])
def test_sharded_runs_match_single_process(name, runs):
    got, expected = train_losses(runs[name]), train_losses(runs["reference"])
    assert sorted(got) == list(range(1, 11))
    torch.testing.assert_close(
        torch.tensor(list(got.values())), torch.tensor(list(expected.values())), rtol=RTOL, atol=0
    )


def test_fully_sharded_checkpoint_resumes_on_a_single_process(runs):
    assert_continues(runs["single_from_fsdp2"], runs["reference"])


def test_single_process_checkpoint_resumes_fully_sharded_on_two_ranks(runs):
    assert_continues(runs["fsdp2_from_single"], runs["reference"])


def test_two_rank_checkpoint_resumes_hybrid_on_four_ranks(runs):
    assert_continues(runs["hybrid_from_fsdp2"], runs["reference"])
