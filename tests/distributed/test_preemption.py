"""A stop signal on one rank stops every rank at the same step, with a checkpoint there; the run then resumes to the
same losses as an uninterrupted one. With checkpoint.save_on_error, Ctrl-C is such a stop, at any world size, even
when it arrives between a step's optimizer update and the end of that step."""

from __future__ import annotations

import os
import signal

import pytest
import torch

from shardlab.distributed import env as dist_env
from shardlab.runner import run_rank
from tests.distributed.harness import run_spawned

STOP_AT_LOSS_CALL = 3  # rank 1 signals itself during its 3rd forward: training step 3


def signal_rank1_during_step3() -> None:
    """Runs in each spawned rank before the configs: rank 1 sends itself SIGUSR1 in the middle of step 3."""
    import torch.distributed as dist

    from shardlab_tasks.lm.task import LanguageModelingTask

    original, calls = LanguageModelingTask.loss, {"n": 0}

    def loss(self, model, batch, device):
        calls["n"] += device.type != "meta"  # the memory plan's shape-only forward is not a training call
        if calls["n"] == STOP_AT_LOSS_CALL and device.type != "meta" and dist.get_rank() == 1:
            os.kill(os.getpid(), signal.SIGUSR1)
        return original(self, model, batch, device)

    LanguageModelingTask.loss = loss


def ctrl_c_on_rank0_after_the_update_of_step3() -> None:
    """Rank 0 gets SIGINT right after step 3's optimizer and schedule stepped, before the step counter moves."""
    import torch.distributed as dist

    from shardlab.trainer import Trainer

    original = Trainer._step

    def step(self):
        result = original(self)
        if self.state.step + 1 == 3 and dist.get_rank() == 0:
            os.kill(os.getpid(), signal.SIGINT)
        return result

    Trainer._step = step


def usr1_on_rank0_while_it_restores() -> None:
    """Rank 0 gets SIGUSR1 during start-up (Trainer.setup: materialize, restore), before any step."""
    import torch.distributed as dist

    from shardlab.trainer import Trainer

    original = Trainer.setup

    def setup(self, *args, **kwargs):
        if dist.get_rank() == 0:
            os.kill(os.getpid(), signal.SIGUSR1)
        return original(self, *args, **kwargs)

    Trainer.setup = setup


def train_losses(result: dict) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in result["history"] if r["split"] == "train"}


@pytest.fixture(scope="module")
def uninterrupted(tiny_lm, tmp_path_factory):
    cfg = tiny_lm("distributed.backend=fully_sharded", "validation.interval_steps=0")
    return run_rank(cfg, tmp_path_factory.mktemp("uninterrupted"), dist_env.detect())


@pytest.mark.parametrize(
    "prepare, extra, stopped_by",
    [
        (signal_rank1_during_step3, [], "SIGUSR1 (on another rank)"),  # rank 0 itself got no signal
        (ctrl_c_on_rank0_after_the_update_of_step3, ["checkpoint.save_on_error=true"], "SIGINT"),
    ],
    ids=["usr1-on-rank1", "ctrl-c-after-the-update"],
)
def test_signal_on_one_rank_stops_all_at_one_step_and_resume_matches(
    tiny_lm, tmp_path, uninterrupted, prepare, extra, stopped_by
):
    cfg = tiny_lm("distributed.backend=fully_sharded", "validation.interval_steps=0", *extra)
    run_dir = tmp_path / "interrupted"
    (stopped,) = run_spawned([cfg], world_size=2, run_dirs=[run_dir], prepare=prepare)

    assert stopped["stopped_by"] == stopped_by
    assert sorted(train_losses(stopped)) == [1, 2, 3]
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_00000003"]

    (resumed,) = run_spawned([cfg], world_size=2, run_dirs=[run_dir])
    got, expected = train_losses(resumed), train_losses(uninterrupted)
    assert sorted(got) == list(range(4, 11))
    torch.testing.assert_close(
        torch.tensor([got[s] for s in sorted(got)], dtype=torch.float64),
        torch.tensor([expected[s] for s in sorted(got)], dtype=torch.float64),
        rtol=1e-5,
        atol=0,
    )
    assert resumed["final"]["loss"] == pytest.approx(uninterrupted["final"]["loss"], rel=1e-5)


def test_a_stop_signal_during_start_up_stops_after_the_first_step_with_a_checkpoint(tiny_lm, tmp_path):
    """Its default action would end the process unsaved (and, in a Slurm job, unrequeued)."""
    cfg = tiny_lm("distributed.backend=fully_sharded", "validation.interval_steps=0")
    (stopped,) = run_spawned([cfg], world_size=2, run_dirs=[tmp_path], prepare=usr1_on_rank0_while_it_restores)
    assert stopped["stopped_by"] == "SIGUSR1"
    assert sorted(train_losses(stopped)) == [1]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_00000001"]
