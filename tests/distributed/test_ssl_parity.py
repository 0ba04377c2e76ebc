"""SwAV and SimCLR under fully_sharded with synced BN and LARS (CPU, gloo) train like one process on the same global
batch, at world sizes 1, 2 and 4 - because Sinkhorn's sums and SimCLR's negatives span every rank: with those made
local the losses part. The feature queue (sharded over the ranks by sample) and the frozen prototypes resume on another
world size. One spawn per world size; the local-only runs share the 2-rank spawn; world size 4 runs under -m slow."""

from __future__ import annotations

import pytest
import torch

from shardlab.distributed import env as dist_env
from shardlab.runner import run_rank
from tests.distributed.harness import run_spawned
from tests.ssl_configs import STEPS, simclr, swav

LOSS_RTOL = 1e-5
RESUME_AT = 2
SHARDED = ["distributed=fully_sharded"]
SAVE = [f"checkpoint.interval_steps={RESUME_AT}", "checkpoint.keep_last=3"]


def losses(result: dict) -> torch.Tensor:
    return torch.tensor([r["loss"] for r in result["history"] if r["split"] == "train"], dtype=torch.float64)


def checkpoint(run_dir, step: int) -> str:
    return str(run_dir / "checkpoints" / f"step_{step:08d}")


# ---- the 2-rank spawn's last two configs run with rank-local collectives --------------------------------------------
TWO_RANK_CONFIGS = ["swav", "simclr", "swav_offload", "swav_resumed_from_single", "swav_local", "simclr_local"]
FIRST_LOCAL = TWO_RANK_CONFIGS.index("swav_local")
_fits_done = [0]


def count_fit(trainer) -> dict:
    _fits_done[0] += 1
    return {}


def local_collectives_from_config_k() -> None:
    """In each rank: from config FIRST_LOCAL on, Sinkhorn's all-reduces and SimCLR's all-gather see only this rank
    (which then holds the whole batch, from position 0)."""
    from shardlab_tasks.self_supervised import comm

    all_reduce, gather, rank = comm.all_reduce, comm.all_gather_with_grad, comm.data_parallel_rank

    def local_or(fn, local):
        return lambda *args: local(*args) if _fits_done[0] >= FIRST_LOCAL else fn(*args)

    comm.all_reduce = local_or(all_reduce, lambda x, op="sum": x)
    comm.all_gather_with_grad = local_or(gather, lambda x: x)
    comm.data_parallel_rank = local_or(rank, lambda: 0)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out, dirs = {}, {}

    def here(name, cfg):
        dirs[name] = tmp_path_factory.mktemp(name)
        out[name] = run_rank(cfg, dirs[name], dist_env.detect())

    here("swav_single", swav(*SAVE))
    here("simclr_single", simclr())
    here("swav_1", swav(*SHARDED))  # one rank, with a process group: FSDP2 and DTensors all the same
    here("simclr_1", simclr(*SHARDED))
    two = {
        "swav": swav(*SHARDED, *SAVE),
        "simclr": simclr(*SHARDED),
        "swav_offload": swav(*SHARDED, "distributed.cpu_offload=true"),
        "swav_resumed_from_single": swav(*SHARDED, f"checkpoint.resume={checkpoint(dirs['swav_single'], RESUME_AT)}"),
        "swav_local": swav(*SHARDED),
        "simclr_local": simclr(*SHARDED),
    }
    assert list(two) == TWO_RANK_CONFIGS
    two_dirs = [tmp_path_factory.mktemp(name) for name in two]
    results = run_spawned(
        list(two.values()), 2, run_dirs=two_dirs, inspect=count_fit, prepare=local_collectives_from_config_k
    )
    out.update({f"{name}_2": r for name, r in zip(two, results, strict=True)})
    resume = f"checkpoint.resume={checkpoint(two_dirs[0], RESUME_AT)}"
    here("swav_resumed_from_two", swav(resume))
    return out


@pytest.fixture(scope="module")
def four_ranks() -> dict:
    swav_4, simclr_4 = run_spawned([swav(*SHARDED), simclr(*SHARDED)], 4)
    return {"swav_4": swav_4, "simclr_4": simclr_4}


@pytest.mark.parametrize("world", [1, 2, pytest.param(4, marks=pytest.mark.slow)])
@pytest.mark.parametrize("method", ["swav", "simclr"])
def test_fully_sharded_losses_match_single_process_at_every_world_size(request, runs, method, world):
    sharded = runs if world < 4 else request.getfixturevalue("four_ranks")
    single, sharded = losses(runs[f"{method}_single"]), losses(sharded[f"{method}_{world}"])
    assert len(sharded) == STEPS
    torch.testing.assert_close(sharded, single, rtol=LOSS_RTOL, atol=0)


def test_lars_under_fully_sharded_with_cpu_offload_matches_single(runs):
    """LARS's trust ratios need each parameter's global norm: taken from the shards, they match one process's."""
    torch.testing.assert_close(losses(runs["swav_offload_2"]), losses(runs["swav_single"]), rtol=LOSS_RTOL, atol=0)


@pytest.mark.parametrize("method", ["swav", "simclr"])
def test_rank_local_sinkhorn_or_negatives_give_other_losses(runs, method):
    """The same 2-rank run with Sinkhorn's sums (SwAV) or the negatives (SimCLR) taken from the local batch only:
    the first loss already differs from the global batch's."""
    local, single = losses(runs[f"{method}_local_2"]), losses(runs[f"{method}_single"])
    assert abs(local[0] - single[0]) > 1e-4, (local, single)


def test_queue_and_frozen_prototypes_resume_on_two_ranks_from_one(runs):
    """Saved at step 2 by one process, with the prototypes frozen for one more step and the queue half full; two ranks
    reload each rank's half of every queued batch, fill it, use it from step 4 on and continue the curve."""
    resumed = runs["swav_resumed_from_single_2"]
    assert [r["step"] for r in resumed["history"] if r["split"] == "train"] == list(range(RESUME_AT + 1, STEPS + 1))
    torch.testing.assert_close(losses(resumed), losses(runs["swav_single"])[RESUME_AT:], rtol=LOSS_RTOL, atol=0)


def test_queue_and_frozen_prototypes_resume_on_one_rank_from_two(runs):
    resumed = runs["swav_resumed_from_two"]
    torch.testing.assert_close(losses(resumed), losses(runs["swav_2"])[RESUME_AT:], rtol=LOSS_RTOL, atol=0)
