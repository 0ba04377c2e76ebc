"""The trackers on a 2-rank fully_sharded run stopped by SIGUSR2 and resumed (rank 0 logs; the stop is agreed by both
ranks): one MLflow run on a local sqlite store and one W&B run offline, each with the whole loss history and the
config. And MLflow through a real local `mlflow server`, which goes away mid-run and comes back."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from shardlab.distributed import env as dist_env
from shardlab.jobs.preemption import STOPPED_EXIT_CODE
from shardlab.runner import run_rank
from tests.conftest import TINY_LM
from tests.distributed.harness import run_spawned
from tests.tracker_files import mlflow_history, mlflow_runs, wandb_offline_runs

pytest.importorskip("mlflow")
pytest.importorskip("wandb")
from mlflow.tracking import MlflowClient  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def usr2_on_rank1_during_step3() -> None:
    """Runs in each spawned rank: rank 1 sends itself SIGUSR2 in its 3rd training forward."""
    import torch.distributed as dist

    from shardlab_tasks.lm.task import LanguageModelingTask

    original, calls = LanguageModelingTask.loss, {"n": 0}

    def loss(self, model, batch, device):
        calls["n"] += device.type != "meta"
        if calls["n"] == 3 and device.type != "meta" and dist.get_rank() == 1:
            os.kill(os.getpid(), signal.SIGUSR2)
        return original(self, model, batch, device)

    LanguageModelingTask.loss = loss


def train_losses(*results: dict) -> dict[int, float]:
    return {r["step"]: r["loss"] for result in results for r in result["history"] if r["split"] == "train"}


@pytest.mark.slow  # two spawns of 2 ranks, and MLflow making its sqlite tables: ~50 s here
def test_a_stopped_and_resumed_fully_sharded_run_is_one_mlflow_run_and_one_wandb_run(tiny_lm, tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    cfg = tiny_lm(
        "distributed.backend=fully_sharded",
        "validation.interval_steps=0",
        "logging.interval_steps=1",
        *("logging.mlflow.enabled=true", f"logging.mlflow.tracking_uri={uri}", "+logging.mlflow.tags.team=nlp"),
        *("logging.wandb.enabled=true", "logging.wandb.mode=offline"),
    )
    (tmp_path / "lr_sweep").mkdir()
    (tmp_path / "lr_sweep" / "multirun.yaml").write_text("{}")  # a sweep point's folder, as Hydra's sweeper makes it
    run_dir = tmp_path / "lr_sweep" / "0_optimizer.lr=0.003"
    (stopped,) = run_spawned([cfg], world_size=2, run_dirs=[run_dir], prepare=usr2_on_rank1_during_step3)
    assert stopped["stopped_by"] == "SIGUSR2 (on another rank)"
    (resumed,) = run_spawned([cfg], world_size=2, run_dirs=[run_dir])
    losses = train_losses(stopped, resumed)
    assert sorted(losses) == list(range(1, 11))

    (run,) = mlflow_runs(uri)
    assert run.info.status == "FINISHED" and run.data.tags["team"] == "nlp"
    assert MlflowClient(uri).get_experiment(run.info.experiment_id).name == "lr_sweep"  # the sweep's experiment
    assert run.data.params["distributed.backend"] == "fully_sharded" and run.data.params["model.dim"] == "64"
    assert mlflow_history(uri, run.info.run_id, "train/loss") == pytest.approx(losses)

    first, second = wandb_offline_runs(run_dir)
    assert first["id"] == second["id"] and first["group"] == "lr_sweep"
    assert first["config"]["distributed.backend"] == "fully_sharded"
    wandb_losses = {step: row["train/loss"] for r in (first, second) for step, row in r["history"].items()}
    assert wandb_losses == pytest.approx(losses)


def start_mlflow_server(db: str, port: int) -> subprocess.Popen:
    server = subprocess.Popen(
        [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", db]
        + ["--host", "127.0.0.1", "--port", str(port), "--workers", "1"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,  # its workers go with it
    )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                return server
        except OSError:
            time.sleep(1)
    stop_mlflow_server(server)
    raise AssertionError("mlflow server did not start in 120 s")


def stop_mlflow_server(server: subprocess.Popen) -> None:
    os.killpg(server.pid, signal.SIGTERM)
    server.wait(timeout=30)


@pytest.mark.slow  # an mlflow server starts twice: ~1-2 min
def test_an_mlflow_server_that_goes_away_is_reported_once_and_gets_the_whole_history(tiny_lm, tmp_path, monkeypatch):
    from shardlab_tasks.lm.task import LanguageModelingTask

    db, port = f"sqlite:///{tmp_path / 'server.db'}", dist_env.free_port()
    servers = [start_mlflow_server(db, port)]
    original, calls = LanguageModelingTask.loss, {"n": 0}

    def loss(self, model, batch, device):  # the server goes away in step 3, and is back from step 7
        calls["n"] += device.type != "meta"
        if device.type != "meta" and calls["n"] == 3:
            stop_mlflow_server(servers[-1])
        if device.type != "meta" and calls["n"] == 7:
            servers.append(start_mlflow_server(db, port))
        return original(self, model, batch, device)

    monkeypatch.setattr(LanguageModelingTask, "loss", loss)
    uri = f"http://127.0.0.1:{port}"
    cfg = tiny_lm("logging.mlflow.enabled=true", f"logging.mlflow.tracking_uri={uri}", "logging.interval_steps=1")
    try:
        result = run_rank(cfg, tmp_path / "run", dist_env.detect())
        (run,) = mlflow_runs(uri)
        history = mlflow_history(uri, run.info.run_id, "train/loss")
    finally:
        stop_mlflow_server(servers[-1])

    assert history == pytest.approx(train_losses(result))
    assert sorted(history) == list(range(1, 11))
    log = (tmp_path / "run" / "train.log").read_text()
    assert log.count(f"[track] mlflow: cannot reach {uri}") == 1
    assert log.count(f"[track] mlflow: reached {uri} again") == 1


def train_cli(*args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "shardlab.train", *args],
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def logged_losses(run_dir: Path) -> dict[int, float]:
    """The [train] lines of train.log (both starts), by step: what the console printed."""
    found = re.findall(r"\[train\] step (\d+) \| loss (\S+) ", (run_dir / "train.log").read_text())
    return {int(step): float(loss) for step, loss in found}


@pytest.mark.slow  # two CLI starts of 2 ranks and MLflow's sqlite tables: ~2 min here
def test_the_cli_run_stopped_by_usr2_and_resumed_is_one_tracker_run(tmp_path, corpus_cache):
    """What issue 32 asks to see, as a user does it: a 2-rank fully_sharded run from the command line, SIGUSR2 sent to
    the launcher (as Slurm does before a pre-emption), the same command again; then one MLflow run and one W&B id."""
    uri, run_dir = f"sqlite:///{tmp_path / 'mlflow.db'}", tmp_path / "run"
    args = [
        *TINY_LM, f"data.cache_dir={corpus_cache}", f"hydra.run.dir={run_dir}", "optimization.max_steps=100",
        "validation.interval_steps=0", "distributed=fully_sharded", "distributed.world_size=2",
        "logging.mlflow.enabled=true", f"logging.mlflow.tracking_uri={uri}",
        "logging.wandb.enabled=true", "logging.wandb.mode=offline",
    ]  # fmt: skip
    first = train_cli(*args)
    deadline = time.monotonic() + 300
    while "[train] step 3 " not in ((run_dir / "train.log").read_text() if (run_dir / "train.log").exists() else ""):
        assert first.poll() is None and time.monotonic() < deadline, first.stderr.read()[-3000:]
        time.sleep(0.05)
    first.send_signal(signal.SIGUSR2)
    out, err = first.communicate(timeout=300)
    assert first.returncode == STOPPED_EXIT_CODE, err[-3000:]
    stopped_at = max(logged_losses(run_dir))
    assert stopped_at < 100, "the signal came too late to test a resume"

    second = train_cli(*args)
    out, err = second.communicate(timeout=600)
    assert second.returncode == 0, err[-3000:]
    assert f"resumed from {run_dir / 'checkpoints' / f'step_{stopped_at:08d}'}" in out
    losses = logged_losses(run_dir)
    assert sorted(losses) == list(range(1, 101))

    (run,) = mlflow_runs(uri)
    assert run.info.status == "FINISHED" and run.data.params["distributed.world_size"] == "2"
    assert mlflow_history(uri, run.info.run_id, "train/loss") == pytest.approx(losses, rel=1e-3)  # printed: 4 digits
    first_file, second_file = wandb_offline_runs(run_dir)
    assert first_file["id"] == second_file["id"]
    assert max(first_file["history"]) == stopped_at and min(second_file["history"]) == stopped_at + 1
    wandb_losses = {s: row["train/loss"] for f in (first_file, second_file) for s, row in f["history"].items()}
    assert wandb_losses == pytest.approx(losses, rel=1e-3)


@pytest.mark.slow  # a 2-point sweep from the command line with MLflow's sqlite tables: ~1 min here
def test_a_sweeps_points_share_one_mlflow_experiment_and_one_wandb_group(tmp_path, corpus_cache):
    uri, sweep_dir = f"sqlite:///{tmp_path / 'mlflow.db'}", tmp_path / "lr_sweep"
    done = subprocess.run(
        [sys.executable, "-m", "shardlab.train", "-m", *TINY_LM, f"data.cache_dir={corpus_cache}",
         "optimization.max_steps=4", "validation.interval_steps=0", f"hydra.sweep.dir={sweep_dir}",
         "optimizer.lr=1e-3,3e-3", "logging.mlflow.enabled=true", f"logging.mlflow.tracking_uri={uri}",
         "logging.wandb.enabled=true", "logging.wandb.mode=offline"],
        cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    points = sorted(p for p in sweep_dir.iterdir() if (p / "trackers.json").exists())
    assert len(points) == 2

    runs = mlflow_runs(uri)
    assert sorted(r.info.run_name for r in runs) == [p.name for p in points]
    assert {MlflowClient(uri).get_experiment(r.info.experiment_id).name for r in runs} == {"lr_sweep"}
    groups = {run["group"] for point in points for run in wandb_offline_runs(point)}
    assert groups == {"lr_sweep"}
