"""checkpoint.save_on_error saves only a consistent state: the last completed step, never one that already holds part
of the next step's update. Ctrl-C is an agreed stop at the end of the step (and a save); an error while an update
is being applied saves nothing and says why."""

from __future__ import annotations

import os
import signal

import pytest
import torch

from shardlab.distributed import env as dist_env
from shardlab.runner import run_rank
from shardlab.trainer import Trainer

CKPT = ["optimization.max_steps=8", "checkpoint.interval_steps=4", "validation.interval_steps=0"]


def train_losses(result) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in result["history"] if r["split"] == "train"}


def after_the_update_of_step(step: int, action):
    """Trainer._step wrapped so that ``action()`` runs right after step ``step``'s optimizer and schedule stepped,
    before the step counter moves: the moment an interruption used to label step N with step N+1's weights."""
    original = Trainer._step

    def step_then_act(self):
        result = original(self)
        if self.state.step + 1 == step:
            action()
        return result

    return step_then_act


@pytest.fixture(scope="module")
def uninterrupted(tiny_lm, tmp_path_factory):
    return run_rank(tiny_lm(*CKPT), tmp_path_factory.mktemp("uninterrupted"), dist_env.detect())


def test_ctrl_c_after_the_optimizer_step_saves_that_step_and_the_resume_matches(
    tiny_lm, tmp_path, monkeypatch, uninterrupted
):
    monkeypatch.setattr(Trainer, "_step", after_the_update_of_step(6, lambda: os.kill(os.getpid(), signal.SIGINT)))
    stopped = run_rank(tiny_lm(*CKPT, "checkpoint.save_on_error=true"), tmp_path, dist_env.detect())
    assert stopped["stopped_by"] == "SIGINT" and sorted(train_losses(stopped)) == list(range(1, 7))
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_00000004", "step_00000006"]
    monkeypatch.undo()
    resumed = run_rank(tiny_lm(*CKPT, "checkpoint.save_on_error=true"), tmp_path, dist_env.detect())
    got, expected = train_losses(resumed), train_losses(uninterrupted)
    assert sorted(got) == [7, 8]
    assert torch.equal(torch.tensor([got[7], got[8]]), torch.tensor([expected[7], expected[8]]))
    assert resumed["final"] == uninterrupted["final"]


def test_a_second_ctrl_c_interrupts_at_once(tiny_lm, tmp_path, monkeypatch):
    def twice():
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGINT)

    monkeypatch.setattr(Trainer, "_step", after_the_update_of_step(3, twice))
    with pytest.raises(KeyboardInterrupt):
        run_rank(tiny_lm(*CKPT, "checkpoint.save_on_error=true"), tmp_path, dist_env.detect())
    assert not (tmp_path / "checkpoints").exists(), "step 2 holds step 3's update: nothing may be saved"


def test_an_error_while_the_update_is_applied_saves_nothing_and_says_why(tiny_lm, tmp_path, monkeypatch, capsys):
    def fail():
        raise RuntimeError("scheduler broke")

    monkeypatch.setattr(Trainer, "_step", after_the_update_of_step(6, fail))
    capsys.readouterr()
    with pytest.raises(RuntimeError, match="scheduler broke"):
        run_rank(tiny_lm(*CKPT, "checkpoint.save_on_error=true"), tmp_path, dist_env.detect())
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_00000004"]
    (line,) = [x for x in capsys.readouterr().out.splitlines() if "save_on_error" in x]
    assert line == (
        "[ckpt] save_on_error: nothing saved after RuntimeError: it came while step 6's update was being applied, "
        "so the model is neither step 5 nor step 6; the newest checkpoint, step_00000004, is kept"
    )


def test_without_save_on_error_ctrl_c_interrupts_as_usual(tiny_lm, tmp_path, monkeypatch):
    # Python's own Ctrl-C handler, as in a terminal (a shell starts background jobs with SIGINT ignored).
    # (tests/conftest.py puts the session's handler back after the test)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    monkeypatch.setattr(Trainer, "_step", after_the_update_of_step(3, lambda: os.kill(os.getpid(), signal.SIGINT)))
    with pytest.raises(KeyboardInterrupt):
        run_rank(tiny_lm(*CKPT), tmp_path, dist_env.detect())


# ---- a run that goes non-finite (optimization.max_nonfinite_steps) --------------------------------------------------
NONFINITE = ["optimization.max_steps=10", "validation.interval_steps=0", "checkpoint.save_on_error=true"]


def saved_weights_are_finite(run_dir) -> list[str]:
    """The step folders of ``run_dir``, each checked to hold only finite weights."""
    from shardlab.checkpoint import weights

    steps = sorted(p.name for p in (run_dir / "checkpoints").glob("step_*"))
    for name in steps:
        state = weights.read_full(run_dir / "checkpoints" / name)
        assert all(torch.isfinite(t).all() for t in state.values()), f"{name} holds NaN or inf"
    return steps


def failed_with(run_dir, error) -> str:
    from shardlab.jobs import run_record

    status = run_record.read(run_dir)
    assert status["status"] == "failed" and status["error"] == str(error) and "\n" not in str(error)
    return str(error)


def test_a_loss_that_stays_nan_stops_the_run_as_failed_after_max_nonfinite_steps(tiny_lm, tmp_path, monkeypatch):
    from shardlab.errors import TrainingDiverged
    from shardlab.runner import run_job
    from shardlab_tasks.lm.task import LanguageModelingTask

    original, calls = LanguageModelingTask.loss, {"n": 0}

    def nan_from_step_3(self, model, batch, device):
        loss, stats = original(self, model, batch, device)
        calls["n"] += device.type != "meta"  # the memory plan's shape-only forward is no training step
        return (loss * float("nan") if calls["n"] >= 3 else loss), stats

    monkeypatch.setattr(LanguageModelingTask, "loss", nan_from_step_3)
    with pytest.raises(TrainingDiverged) as e:
        run_job(tiny_lm(*NONFINITE, "checkpoint.interval_steps=1"), tmp_path, [])
    assert failed_with(tmp_path, e.value).startswith(
        "the loss was not finite (NaN or inf) on 3 steps in a row, the last step 5 "
        "(optimization.max_nonfinite_steps=3); nothing non-finite was saved, the newest checkpoint, step_00000004,"
    )
    assert calls["n"] == 5  # stopped there, not at optimization.max_steps
    # NaN gradients skip the update (the weights stay step 2's), so steps 3 and 4 saved finite weights
    assert saved_weights_are_finite(tmp_path) == ["step_00000003", "step_00000004"]


@pytest.mark.parametrize(
    "interval, refusal",
    [
        (1, "the weights are not finite (NaN or inf) at step 3: not saved, the newest checkpoint, step_00000002, is"),
        (0, "the loss was not finite (NaN or inf) on 3 steps in a row, the last step 6"),
    ],
    ids=["at-the-next-save", "after-the-streak-with-save_on_error"],
)
def test_weights_gone_nan_are_never_saved_and_the_run_fails(tiny_lm, tmp_path, monkeypatch, interval, refusal):
    """As optimizer.lr=inf did (the config now refuses it): the update writes NaN into the weights. The next save
    refuses them; without one, the loss's streak ends the run, and save_on_error saves nothing either."""
    from shardlab.errors import TrainingDiverged
    from shardlab.runner import run_job

    original = Trainer._step

    def poisoning_step_3(self):
        result = original(self)
        if self.state.step + 1 == 3:
            with torch.no_grad():
                next(self.model.parameters()).fill_(float("nan"))
        return result

    monkeypatch.setattr(Trainer, "_step", poisoning_step_3)
    with pytest.raises(TrainingDiverged) as e:
        run_job(tiny_lm(*NONFINITE, f"checkpoint.interval_steps={interval}"), tmp_path, [])
    assert failed_with(tmp_path, e.value).startswith(refusal)
    assert saved_weights_are_finite(tmp_path) == (["step_00000001", "step_00000002"] if interval else [])
