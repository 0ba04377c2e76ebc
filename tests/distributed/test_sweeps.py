"""Hydra multirun on this machine: every point in its own directory, a failed point reported without stopping the
others, and the summary table at the end."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.conftest import TINY_LM

pytestmark = pytest.mark.e2e  # multiruns and submitit jobs as commands: CI runs it after the suite (tests/conftest.py)

ROOT = Path(__file__).resolve().parents[2]


def train(*args: str, cwd: Path = ROOT, timeout: int = 600) -> subprocess.CompletedProcess:
    """`python -m shardlab.train *args` in ``cwd``, one OpenMP thread per process."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "shardlab.train", *args]
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def sweep(sweep_dir: Path, corpus_cache: str, *overrides: str) -> subprocess.CompletedProcess:
    return train(
        "-m",
        *TINY_LM,
        "optimization.max_steps=6",
        "validation.interval_steps=0",
        f"data.cache_dir={corpus_cache}",
        f"hydra.sweep.dir={sweep_dir}",
        *overrides,
    )


@pytest.mark.slow  # in the e2e pass, the tutorial's 2-point sweep on 2 ranks checks each point's folder and summary
def test_four_point_sweep_on_two_ranks_each_gets_its_own_directory_and_summary(tmp_path, corpus_cache):
    proc = sweep(
        tmp_path, corpus_cache, "optimizer.lr=1e-3,3e-3", "model.num_layers=1,2", "distributed.backend=ddp",
        "distributed.world_size=2",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads((tmp_path / "summary.json").read_text())
    assert len(rows) == 4 and len({r["run_dir"] for r in rows}) == 4
    assert all(r["status"] == "completed" and r["step"] == 6 and r["final"]["loss"] > 0 for r in rows)
    swept = ("optimizer.lr", "model.num_layers")
    points = {tuple(sorted(o for o in r["overrides"].split() if o.startswith(swept))) for r in rows}
    assert points == {(f"model.num_layers={n}", f"optimizer.lr={lr}") for n in (1, 2) for lr in ("0.001", "0.003")}
    for r in rows:  # each point trained on 2 ranks, kept its own checkpoints, and printed its final line
        assert (Path(r["run_dir"]) / "checkpoints" / "step_00000006").is_dir()
    assert proc.stdout.count("world size 2 (local)") == 4 and proc.stdout.count("final validation:") == 4
    table = proc.stdout[proc.stdout.index("\nsweep ") :]
    assert "model.num_layers=2 optimizer.lr=0.003  completed  6/6" in table


def test_a_failed_point_is_reported_and_the_others_finish(tmp_path, corpus_cache):
    proc = sweep(tmp_path, corpus_cache, "model.num_heads=3,4")
    assert proc.returncode == 1
    assert "error: model.num_heads (3) must divide model.dim (64)" in proc.stderr
    rows = json.loads((tmp_path / "summary.json").read_text())
    heads = [next(o for o in r["overrides"].split() if o.startswith("model.num_heads=")) for r in rows]
    assert list(zip(heads, [r["status"] for r in rows], strict=True)) == [
        ("model.num_heads=3", "failed"),
        ("model.num_heads=4", "completed"),
    ]
    assert rows[0]["error"] == "model.num_heads (3) must divide model.dim (64)"
    assert "job 0 (model.num_heads=3) failed: model.num_heads (3) must divide model.dim (64)" in proc.stdout


def test_a_run_resumed_on_another_world_size_continues_in_its_directory(tmp_path, corpus_cache):
    """The run directory follows the experiment: world size, backend and max_steps do not move it."""
    common = [*TINY_LM, f"data.cache_dir={corpus_cache}", "validation.interval_steps=0", "checkpoint.interval_steps=4"]
    first = train(
        *common, "distributed.backend=fully_sharded", "distributed.world_size=2", "optimization.max_steps=4",
        cwd=tmp_path, timeout=300,
    )  # fmt: skip
    assert first.returncode == 0, first.stderr[-3000:]
    (run_dir,) = (tmp_path / "runs" / "lm").iterdir()
    second = train(*common, "optimization.max_steps=8", cwd=tmp_path, timeout=300)  # world size 1, single, longer
    assert second.returncode == 0, second.stderr[-3000:]
    assert [p.name for p in (tmp_path / "runs" / "lm").iterdir()] == [run_dir.name]
    assert f"resumed from {run_dir / 'checkpoints' / 'step_00000004'} (step 4," in second.stdout
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_00000004", "step_00000008"]


def test_submitit_local_launcher_runs_a_two_task_job_and_reports_it(tmp_path, corpus_cache):
    """hydra/launcher=local: the Slurm preset's jobs as local submitit processes, one per rank."""
    proc = sweep(
        tmp_path, corpus_cache, "hydra/launcher=local", "hydra.launcher.tasks_per_node=2", "hydra.launcher.poll_s=1",
        "distributed.backend=fully_sharded",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    (job,) = json.loads((tmp_path / "sweep.json").read_text())
    assert f"#0 job {job['job_id']} completed at step 6" in proc.stdout + proc.stderr
    assert "world size 2 (submitit_local)" in Path(job["log"]).read_text()
    assert Path(job["log"]).parent == tmp_path / ".submitit"
    assert all(p.is_file() for p in (tmp_path / ".submitit").iterdir())  # no empty '%j' folder left beside them
    (row,) = json.loads((tmp_path / "summary.json").read_text())
    assert row["status"] == "completed" and row["final"]["loss"] > 0


def test_rerunning_a_sweep_resumes_each_point_in_the_same_folder(tmp_path, corpus_cache):
    """The sweep folder is named by the command line's overrides (not the clock), so the same command finds its
    points' checkpoints: here a point whose last checkpoint was lost (killed after step 3's save) continues from
    step 3 to the same final loss, and the finished one stays finished."""
    args = [
        "-m", *TINY_LM, "optimization.max_steps=6", "validation.interval_steps=0", "checkpoint.interval_steps=3",
        f"data.cache_dir={corpus_cache}", "optimizer.lr=1e-3,3e-3",
    ]  # fmt: skip
    first = train(*args, cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    (sweep_dir,) = (tmp_path / "multirun" / "lm").iterdir()
    before = {r["run_dir"]: r["final"]["loss"] for r in json.loads((sweep_dir / "summary.json").read_text())}
    killed = Path(sorted(before)[0])
    shutil.rmtree(killed / "checkpoints" / "step_00000006")

    again = train(*args, cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert list((tmp_path / "multirun" / "lm").iterdir()) == [sweep_dir]
    assert f"resumed from {killed / 'checkpoints' / 'step_00000003'} (step 3," in again.stdout
    after = {r["run_dir"]: r["final"]["loss"] for r in json.loads((sweep_dir / "summary.json").read_text())}
    assert after == before


def test_an_optuna_sweep_minimizes_the_final_validation_loss_over_its_trials(tmp_path, corpus_cache):
    """hydra-optuna-sweeper (the optuna extra, in the test extra) searches a shardlab run: each trial is a point with
    its folder and its row in the summary, and the best value Optuna reports is the lowest final validation loss."""
    pytest.importorskip("hydra_plugins.hydra_optuna_sweeper", reason="pip install -e '.[optuna]'")
    proc = sweep(
        tmp_path, corpus_cache, "optimization.max_steps=2", "validation.num_batches=1", "hydra/sweeper=optuna",
        "hydra.sweeper.n_trials=2", "hydra.sweeper.n_jobs=2", "hydra.sweeper.sampler.seed=0",
        "optimizer.lr=interval(1e-4,1e-2)",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Warning" not in proc.stderr, proc.stderr[-3000:]  # e.g. a callback's error, which Hydra only warns of
    rows = json.loads((tmp_path / "summary.json").read_text())
    assert len(rows) == 2 and all(r["status"] == "completed" and r["step"] == 2 for r in rows)
    lrs = [
        float(next(o for o in r["overrides"].split() if o.startswith("optimizer.lr=")).partition("=")[2]) for r in rows
    ]
    assert all(1e-4 <= lr <= 1e-2 for lr in lrs) and lrs[0] != lrs[1]
    best = yaml.safe_load((tmp_path / "optimization_results.yaml").read_text())
    losses = [r["final"]["loss"] for r in rows]
    assert best["best_value"] == pytest.approx(min(losses))
    assert best["best_params"]["optimizer.lr"] == pytest.approx(lrs[losses.index(min(losses))])
