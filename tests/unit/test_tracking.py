"""Experiment trackers (shardlab/logging/trackers.py) against the real libraries, in one process: a run stopped by
SIGUSR2 and resumed is one tracker run holding the whole loss history and the config; an unreachable MLflow never stops
training; a missing library is refused at the pre-flight. The 2-rank fully_sharded version and a real `mlflow server`
are in tests/distributed/test_tracking.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from shardlab.cli.checks import validate
from shardlab.distributed import env as dist_env
from shardlab.errors import ConfigError
from shardlab.runner import run_rank
from tests.tracker_files import mlflow_history, mlflow_runs, wandb_offline_runs

pytest.importorskip("mlflow")
pytest.importorskip("wandb")
from mlflow.tracking import MlflowClient  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def usr2_at_step3(monkeypatch):
    """The LM's 3rd training forward sends this process SIGUSR2 (a Slurm pre-emption warning): the run saves at
    step 3 and stops; the returned function puts the real loss back, for the resume."""
    from shardlab_tasks.lm.task import LanguageModelingTask

    original, calls = LanguageModelingTask.loss, {"n": 0}

    def loss(self, model, batch, device):
        calls["n"] += device.type != "meta"
        if calls["n"] == 3 and device.type != "meta":
            os.kill(os.getpid(), signal.SIGUSR2)
        return original(self, model, batch, device)

    monkeypatch.setattr(LanguageModelingTask, "loss", loss)
    return lambda: monkeypatch.setattr(LanguageModelingTask, "loss", original)


def stop_and_resume(cfg, run_dir, put_back) -> tuple[dict, dict]:
    stopped = run_rank(cfg, run_dir, dist_env.detect())
    assert stopped["stopped_by"] == "SIGUSR2"
    put_back()
    resumed = run_rank(cfg, run_dir, dist_env.detect())
    assert resumed["stopped_by"] is None
    return stopped, resumed


def train_losses(*results: dict) -> dict[int, float]:
    return {r["step"]: r["loss"] for result in results for r in result["history"] if r["split"] == "train"}


def test_mlflow_keeps_one_run_across_a_stop_and_resume(tiny_lm, tmp_path, usr2_at_step3):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    cfg = tiny_lm("logging.mlflow.enabled=true", f"logging.mlflow.tracking_uri={uri}", "logging.interval_steps=1")
    run_dir = tmp_path / "run"
    stopped, resumed = stop_and_resume(cfg, run_dir, usr2_at_step3)

    (run,) = mlflow_runs(uri)
    assert run.info.status == "FINISHED"
    assert run.info.run_name == "run"
    assert MlflowClient(uri).get_experiment(run.info.experiment_id).name == "shardlab"  # a single run's
    assert run.data.params["model.dim"] == "64" and run.data.params["optimization.max_steps"] == "10"
    history = mlflow_history(uri, run.info.run_id, "train/loss")
    assert history == pytest.approx(train_losses(stopped, resumed))
    assert sorted(history) == list(range(1, 11))
    assert run.data.metrics["final/loss"] == pytest.approx(resumed["final"]["loss"])
    assert run.data.tags["checkpoint"] == str(run_dir / "checkpoints" / "step_00000010")


def test_wandb_offline_resumes_the_same_run_read_back_from_its_files(tiny_lm, tmp_path, usr2_at_step3):
    cfg = tiny_lm("logging.wandb.enabled=true", "logging.wandb.mode=offline", "logging.wandb.tags=[tiny]")
    (tmp_path / "my_sweep").mkdir()
    (tmp_path / "my_sweep" / "multirun.yaml").write_text("{}")  # as Hydra's sweeper leaves it in a sweep's folder
    run_dir = tmp_path / "my_sweep" / "0_optimizer.lr=0.01"
    stopped, resumed = stop_and_resume(cfg, run_dir, usr2_at_step3)

    first, second = wandb_offline_runs(run_dir)  # one file per start, one run id: `wandb sync` makes them one run
    assert first["id"] == second["id"] and first["name"] == run_dir.name and first["tags"] == ["tiny"]
    assert first["group"] == second["group"] == "my_sweep"  # a sweep's points are one group
    assert first["config"]["model.dim"] == "64"
    assert sorted(first["history"]) == [1, 2, 3] and sorted(second["history"]) == list(range(4, 11))
    losses = {step: row["train/loss"] for run in (first, second) for step, row in run["history"].items()}
    assert losses == pytest.approx(train_losses(stopped, resumed))
    assert second["summary"]["final/loss"] == pytest.approx(resumed["final"]["loss"])
    assert second["summary"]["checkpoint"] == str(run_dir / "checkpoints" / "step_00000010")
    assert first["exit"] and second["exit"]


def test_an_unreachable_mlflow_is_reported_once_and_training_completes(tiny_lm, tmp_path):
    port = dist_env.free_port()  # nothing listens there
    cfg = tiny_lm("logging.mlflow.enabled=true", f"logging.mlflow.tracking_uri=http://127.0.0.1:{port}")
    result = run_rank(cfg, tmp_path, dist_env.detect())

    assert result["stopped_by"] is None and result["final"]["loss"] > 0
    log = (tmp_path / "train.log").read_text()
    assert log.count(f"[track] mlflow: cannot reach http://127.0.0.1:{port}") == 1
    assert (tmp_path / "checkpoints" / "step_00000010").is_dir()


@pytest.mark.parametrize("extra", ["wandb", "mlflow"])
def test_a_missing_tracker_library_is_refused_in_one_line_naming_the_extra(tiny_lm, monkeypatch, extra):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == extra else find_spec(name, *a))
    with pytest.raises(ConfigError) as refused:
        validate(tiny_lm(f"logging.{extra}.enabled=true"))
    message = str(refused.value)
    assert f"pip install -e '.[{extra}]'" in message and f"logging.{extra}.enabled" in message
    assert "\n" not in message


def test_wandb_online_without_credentials_logs_offline_and_says_how_to_sync(tiny_lm, tmp_path, monkeypatch):
    for key in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_BASE_URL"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # no ~/.netrc: nobody is logged in
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "home" / "wandb"))
    result = run_rank(tiny_lm("logging.wandb.enabled=true"), tmp_path / "run", dist_env.detect())

    assert result["stopped_by"] is None
    log = (tmp_path / "run" / "train.log").read_text()
    assert "[track] wandb: no W&B credentials (wandb login, or WANDB_API_KEY); logging offline instead" in log
    (run,) = wandb_offline_runs(tmp_path / "run")
    assert f"wandb sync {tmp_path / 'run' / 'wandb'}/offline-run-*-{run['id']}" in log
    assert sorted(run["history"])[-1] == 10


BLOCK_MLFLOW = """
import sys
sys.modules["mlflow"] = None  # as if it were not installed: importlib finds no spec, and import raises
from shardlab.train import cli
cli()
"""


def test_the_cli_refuses_a_missing_tracker_before_anything_is_written(tmp_path):
    run_dir = tmp_path / "run"
    done = subprocess.run(
        [sys.executable, "-c", BLOCK_MLFLOW, "logging.mlflow.enabled=true", f"hydra.run.dir={run_dir}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "error: logging.mlflow.enabled needs the mlflow package, which is not installed; pip install -e '.[mlflow]' "
        "or drop logging.mlflow.enabled"
    ]
    assert not run_dir.exists()


@pytest.mark.slow  # W&B checks the key with the unreachable server for ~15 s
def test_wandb_online_with_no_server_to_reach_logs_offline(tiny_lm, tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "home" / "wandb"))
    monkeypatch.setenv("WANDB_API_KEY", "0" * 40)  # a key, and a server that is not there
    monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{dist_env.free_port()}")
    result = run_rank(tiny_lm("logging.wandb.enabled=true"), tmp_path / "run", dist_env.detect())

    assert result["stopped_by"] is None
    log = (tmp_path / "run" / "train.log").read_text()
    assert log.count("[track] wandb: cannot reach W&B (") == 1 and "logging offline instead" in log
    (run,) = wandb_offline_runs(tmp_path / "run")
    assert sorted(run["history"])[-1] == 10


def test_a_tracking_uri_that_is_a_folder_is_refused_with_the_sqlite_uri_to_use(tiny_lm):
    with pytest.raises(ConfigError) as refused:
        validate(tiny_lm("logging.mlflow.enabled=true", "logging.mlflow.tracking_uri=mlruns"))
    assert str(refused.value) == (
        "logging.mlflow.tracking_uri must be a URI (http(s)://host:port, sqlite:///path.db), got 'mlruns'; for a "
        "local store use sqlite:///mlruns.db"
    )


NO_STORE = (
    "{key} is nosuchscheme://x, whose scheme 'nosuchscheme' MLflow has no store for (it takes: file, databricks, "
    "databricks-uc, uc, http, https, postgresql, mysql, sqlite, mssql); give http(s)://host:port for a server or "
    "sqlite:///path.db for a local store"
)


def test_a_tracking_uri_mlflow_has_no_store_for_is_refused_at_the_preflight(tiny_lm, monkeypatch):
    from shardlab.cli.checks import check

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    with pytest.raises(ConfigError) as refused:
        check(tiny_lm("logging.mlflow.enabled=true", "logging.mlflow.tracking_uri=nosuchscheme://x"), 1, 0)
    assert str(refused.value) == NO_STORE.format(key="logging.mlflow.tracking_uri")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "nosuchscheme://x")  # what the client takes when the config names none
    with pytest.raises(ConfigError) as refused:
        check(tiny_lm("logging.mlflow.enabled=true"), 1, 0)
    assert str(refused.value) == NO_STORE.format(key="MLFLOW_TRACKING_URI")
    check(tiny_lm("logging.mlflow.enabled=false"), 1, 0)  # a tracker that is off is not asked
    for uri in ("http://127.0.0.1:9", f"sqlite:///{ROOT}/never-created.db"):  # taken; nothing connected or created
        check(tiny_lm("logging.mlflow.enabled=true", f"logging.mlflow.tracking_uri={uri}"), 1, 0)
    assert not (ROOT / "never-created.db").exists()


def test_the_cli_refuses_a_tracking_uri_mlflow_has_no_store_for_before_anything_is_written(tmp_path, cli_forks):
    run_dir = tmp_path / "run"
    overrides = ["logging.mlflow.enabled=true", "logging.mlflow.tracking_uri=nosuchscheme://x"]
    done = cli_forks.run(*overrides, f"hydra.run.dir={run_dir}", env={"MLFLOW_TRACKING_URI": None}, cwd=ROOT)
    assert done.returncode == 2  # it trained to the end and exited 0
    assert done.stderr.strip().splitlines() == ["error: " + NO_STORE.format(key="logging.mlflow.tracking_uri")]
    assert not run_dir.exists()
