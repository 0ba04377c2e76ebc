"""A finished run says so: a start of a run already at optimization.max_steps trains nothing, validates nothing, and
says in one line where the run is and how to train another; a run stopped by a signal prints no final validation."""

from __future__ import annotations

import json
import signal
import time

import pytest

from shardlab.jobs import run_record
from shardlab.jobs.preemption import STOPPED_EXIT_CODE
from tests.conftest import TINY_LM
from tests.unit.test_cli import run_cli, train_cli


def test_a_start_of_a_complete_run_says_so_in_one_line_and_validates_nothing(tmp_path, corpus_cache, cli_forks):
    run_dir = tmp_path / "runs" / "lm" / "default"
    args = [*TINY_LM, f"data.cache_dir={corpus_cache}", f"hydra.run.dir={run_dir}", "lr_scheduler.warmup_steps=30"]
    args.append("optimization.max_steps=4")
    code, out, err = run_cli(*args)
    assert code == 0, err[-3000:]
    assert out.count("final validation:") == 1
    assert "[lr] lr_scheduler.warmup_steps=30 is longer than the run (optimization.max_steps=4)" in out  # clipped
    finished = json.loads((run_dir / "status.json").read_text())

    again = cli_forks.run(*args)  # ends before training: a fork of the warmed CLI spares an interpreter start
    code, out, err = again.returncode, again.stdout, again.stderr
    assert code == 0, err[-3000:]
    complete = [line for line in out.splitlines() if line.startswith("run complete:")]
    assert complete == [
        f"run complete: {run_dir} has reached optimization.max_steps=4 ({run_dir / 'checkpoints' / 'step_00000004'}); "
        f"nothing trained. To train another run, name it: hydra.run.dir={run_dir.parent / '<name>'}; to train this "
        "one further, raise optimization.max_steps"
    ]
    assert "final validation:" not in out and "[valid]" not in out and "[train]" not in out, out
    status = json.loads((run_dir / "status.json").read_text())
    assert status["status"] == "completed" and status["final"] == finished["final"]  # the run's own, kept

    # Raising max_steps trains the same run further, as the line says.
    code, out, err = run_cli(*args[:-1], "optimization.max_steps=6")
    assert code == 0, err[-3000:]
    assert "resumed from" in out and out.count("final validation:") == 1 and "run complete:" not in out


@pytest.mark.slow  # 2 spawned ranks twice (~40 s on 2 loaded cores); found by docs/vision.md's walk (issue #51)
def test_a_start_of_a_complete_run_on_spawned_ranks_says_so_too(tmp_path, corpus_cache):
    """distributed.* keys name no run: the same command on 2 local ranks finds the run complete, and says so (the
    spawned ranks hand the launcher their complete_at, as one process has it)."""
    run_dir = tmp_path / "runs" / "lm" / "default"
    args = [*TINY_LM, f"data.cache_dir={corpus_cache}", f"hydra.run.dir={run_dir}", "optimization.max_steps=2"]
    assert run_cli(*args)[0] == 0
    code, out, err = run_cli(*args, "distributed.backend=fully_sharded", "distributed.world_size=2")
    assert code == 0, err[-3000:]
    assert [line for line in out.splitlines() if line.startswith("run complete:")], out[-3000:]
    assert "final validation:" not in out and "[train]" not in out, out


def test_a_run_stopped_by_a_signal_prints_no_final_validation(tmp_path, corpus_cache):
    args = [*TINY_LM, f"data.cache_dir={corpus_cache}", f"hydra.run.dir={tmp_path}", "optimization.max_steps=100000"]
    proc = train_cli(*args, "lr_scheduler.warmup_steps=0", "validation.interval_steps=2")
    deadline = time.monotonic() + 180
    while (run_record.read(tmp_path) or {}).get("step", 0) < 3:  # validated at step 2 at least
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()[-3000:]
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == STOPPED_EXIT_CODE, err[-3000:]
    assert "[valid]" in out and "rerun the same command to resume" in out
    assert "final validation:" not in out, out[-2000:]


def test_help_says_which_keys_name_a_run_and_how_to_name_one():
    code, out, _ = run_cli("--help")
    assert code == 0
    assert "distributed.*,\nlogging.*, validation.*, checkpoint.* (but init_from) and optimization.max_steps" in out
    assert "name a run of its own with hydra.run.dir=runs/<task>/<name>" in out
