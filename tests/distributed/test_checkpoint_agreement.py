"""Errors one rank sees, every rank sees: a checkpoint step that fails on one rank (rank 0's publish, its set-aside,
one rank's read) stops both ranks at once with the same one-line message, never in a barrier's timeout; a save that
fails mid-run keeps the previous checkpoint and training goes on; a read error that may pass sets nothing aside."""

from __future__ import annotations

import errno
import shutil

import pytest

from shardlab.distributed import env as dist_env
from shardlab.runner import run_rank
from tests.distributed.harness import run_spawned_outcomes

TIMEOUT_S = 60
RUN = [
    "distributed.backend=fully_sharded",
    f"distributed.timeout_s={TIMEOUT_S}",
    "optimization.max_steps=8",
    "checkpoint.interval_steps=4",
    "checkpoint.keep_last=3",
    "validation.interval_steps=0",
]


def publish_fails_on_rank0_at_steps_4_and_8(rank: int) -> None:
    """Rank 0 cannot name the checkpoints of steps 4 (a periodic save) and 8 (the last), as on a full disk."""
    from shardlab.checkpoint import manager

    original = manager.publish

    def publish(tmp, final, meta):
        if final.name in ("step_00000004", "step_00000008"):
            raise OSError(errno.ENOSPC, "No space left on device", str(final))
        return original(tmp, final, meta)

    if rank == 0:
        manager.publish = publish


def load_fails_on_rank1_with_an_io_error(rank: int) -> None:
    """Rank 1's shard reads fail, as on a flaky network file system (inside DCP's collective load)."""
    from shardlab.checkpoint.readers.dcp_reader import SafeReader

    def read_data(self, plan, planner):
        raise OSError(errno.EIO, "Input/output error", str(self.path))

    if rank == 1:
        SafeReader.read_data = read_data


def set_aside_fails_on_rank0(rank: int) -> None:
    from shardlab.checkpoint.resume import candidates

    def set_aside(path, reason):
        raise PermissionError(errno.EACCES, "Permission denied", str(path))

    if rank == 0:
        candidates.set_aside = set_aside


@pytest.fixture(scope="module")
def saved(tiny_lm, tmp_path_factory):
    """Steps 4 and 8 of one process's run, to copy into the folders below."""
    run_dir = tmp_path_factory.mktemp("saved")
    run_rank(tiny_lm(*RUN[2:]), run_dir, dist_env.detect())
    return run_dir / "checkpoints"


def assert_same_error_on_every_rank_at_once(outcomes: list[dict], *phrases: str) -> str:
    errors = {o["error"] for o in outcomes}
    assert len(errors) == 1 and None not in errors, outcomes
    (error,) = errors
    assert "\n" not in error and all(p in error for p in phrases), error
    assert all(o["seconds"] < TIMEOUT_S for o in outcomes), "a rank waited for the collective timeout"
    return error


def test_saves_rank0_cannot_publish_are_reported_and_the_last_one_stops_every_rank(tiny_lm, tmp_path):
    outcomes = run_spawned_outcomes(tiny_lm(*RUN), 2, tmp_path, prepare=publish_fails_on_rank0_at_steps_4_and_8)
    # The periodic save of step 4: reported, its folder removed, training goes on to step 8.
    log = (tmp_path / "train.log").read_text()
    assert "WARNING: saving step 4: naming" in log and "No space left on device" in log
    assert "this run has no checkpoint yet; training goes on and tries again at the next save" in log
    assert "[train] step 8 |" in log
    # The last save must succeed: both ranks stop at once, with rank 0's message.
    assert_same_error_on_every_rank_at_once(
        outcomes, "CheckpointError: saving step 8: naming", "No space left on device", "this run has no checkpoint yet"
    )
    assert not (tmp_path / "checkpoints").exists() or not any((tmp_path / "checkpoints").iterdir())


def test_a_read_error_on_one_rank_sets_nothing_aside_and_stops_both(tiny_lm, tmp_path, saved):
    shutil.copytree(saved, tmp_path / "checkpoints")
    outcomes = run_spawned_outcomes(tiny_lm(*RUN), 2, tmp_path, prepare=load_fails_on_rank1_with_an_io_error)
    assert_same_error_on_every_rank_at_once(
        outcomes, "step_00000008 could not be loaded (OSError: [Errno 5] Input/output error",
        "its files are intact on re-reading", "nothing was set aside",
    )  # fmt: skip
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_00000004", "step_00000008"]


def test_a_set_aside_rank0_cannot_do_stops_both_with_its_message(tiny_lm, tmp_path, saved):
    shutil.copytree(saved, tmp_path / "checkpoints")
    shard = next((tmp_path / "checkpoints" / "step_00000008").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    outcomes = run_spawned_outcomes(tiny_lm(*RUN), 2, tmp_path, prepare=set_aside_fails_on_rank0)
    assert_same_error_on_every_rank_at_once(
        outcomes, "CheckpointError: setting checkpoints aside in", "PermissionError: [Errno 13] Permission denied"
    )
