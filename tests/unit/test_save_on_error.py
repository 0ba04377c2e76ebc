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
