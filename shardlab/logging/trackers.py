"""Experiment trackers beside TensorBoard: Weights & Biases (logging.wandb) and MLflow (logging.mlflow), rank 0 only.

Each tracker is a sink fed what the console prints (``log``), then the final metrics and the newest checkpoint
(``finish``), then closed with how the run ended (``close``). Each gets the composed config as flat parameters when
it opens. Its run id is kept in ``<run dir>/trackers.json``, so a requeue or resume continues the same tracker run.

A tracker never stops training: what it cannot do is said once on the console and retried (MLflow) or done offline
(W&B). The libraries are imported only when enabled (shardlab.config.tracker_errors refuses a missing one at the
pre-flight, and ``tracker_uri_errors`` a tracking URI MLflow has no store for). docs/tracking.md describes the keys and
the behaviour.
"""

from __future__ import annotations

import os
import secrets
import string
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from shardlab.config import TrainConfig, as_container
from shardlab.errors import one_line
from shardlab.files.durable import write_json_atomic
from shardlab.files.regular_file import read_json_or_none

IDS_FILE = "trackers.json"
MAX_BUFFERED = 100_000
"""Metric points an unreachable MLflow keeps for later (about 100 bytes each); the oldest go first beyond it."""


class Tracker(Protocol):
    def log(self, split: str, step: int, metrics: dict[str, float]) -> None: ...

    def finish(self, step: int, final: dict[str, float], checkpoint: Path | None) -> None: ...

    def close(self, status: str) -> None:
        """``status``: completed, stopped (to be resumed) or failed."""


def open_trackers(cfg: TrainConfig, run_dir: Path, say: Callable[[str], None]) -> list[Tracker]:
    """The enabled trackers for ``cfg`` (the composed config), continuing the runs ``run_dir`` recorded."""
    trackers: list[Tracker] = []
    for name, tracker in (("wandb", WandbTracker), ("mlflow", MlflowTracker)):
        if getattr(cfg.logging, name).enabled:
            try:
                trackers.append(tracker(cfg, run_dir, say))
            except Exception as e:  # e.g. a tracking URI its library does not take: training goes on without it
                say(f"[track] {name}: cannot start ({one_line(e)}); this run goes on without it")
    return trackers


def flat_params(cfg: TrainConfig | Any) -> dict[str, str]:
    """The composed config as dotted keys (model.dim: 64), lists and None as text, Hydra's own node left out."""
    tree = as_container(cfg)  # the typed config, a DictConfig or a dict alike
    flat: dict[str, str] = {}

    def visit(node: Any, prefix: str) -> None:
        if isinstance(node, dict) and node:
            for key, value in node.items():
                if f"{prefix}{key}" != "hydra":
                    visit(value, f"{prefix}{key}.")
        else:
            flat[prefix[:-1]] = str(node)

    visit(tree, "")
    return flat


def sweep_name(run_dir: Path) -> str | None:
    """The sweep a run belongs to: its folder's parent, where Hydra's sweeper writes multirun.yaml (on every launcher)
    and shardlab's Slurm launchers their manifest; None for a single run."""
    from shardlab.jobs.sweep import MANIFEST

    parent = run_dir.parent
    return parent.name if (parent / "multirun.yaml").is_file() or (parent / MANIFEST).is_file() else None


def recorded_ids(run_dir: Path) -> dict[str, Any]:
    ids = read_json_or_none(run_dir / IDS_FILE)
    return ids if isinstance(ids, dict) else {}


def record_id(run_dir: Path, tracker: str, ids: dict[str, Any]) -> None:
    """Keep ``tracker``'s run id for the next start of this run (written atomically: a kill leaves the old file)."""
    recorded = recorded_ids(run_dir)
    recorded[tracker] = ids
    write_json_atomic(run_dir / IDS_FILE, recorded, indent=1)


def new_run_id() -> str:
    """A W&B run id as W&B makes them (8 of a-z0-9), chosen here so it is recorded before the run starts."""
    return "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))


# ---- Weights & Biases ------------------------------------------------------------------------------------------------
class WandbTracker:
    """A W&B run under ``<run dir>/wandb``. Online without credentials or network, it goes offline rather than wait
    or fail, and says how to upload it later."""

    def __init__(self, cfg: TrainConfig, run_dir: Path, say: Callable[[str], None]) -> None:
        import wandb

        w = cfg.logging.wandb
        self.say, self.run_dir = say, run_dir
        run_id = recorded_ids(run_dir).get("wandb", {}).get("id") or new_run_id()
        record_id(run_dir, "wandb", {"id": run_id})  # before init: a kill during it must not start a second run
        options = dict(
            project=w.project,
            entity=w.entity,
            name=w.name or run_dir.name,
            group=w.group or sweep_name(run_dir),
            tags=list(w.tags) or None,
            config=flat_params(cfg),
            dir=str(run_dir),
            id=run_id,
            resume="allow",
            # The console is shardlab's (train.log keeps it); W&B's capture would wrap the progress bar's stream.
            settings=wandb.Settings(console="off", silent=True, init_timeout=60),
        )
        self.run, self.failed = None, False
        self.offline = w.mode == "offline"
        if not self.offline:
            try:
                if wandb.login(prompt=False):  # never a prompt (ranks have no terminal); checks a key with the server
                    self.run = wandb.init(mode="online", **options)
                else:
                    say("[track] wandb: no W&B credentials (wandb login, or WANDB_API_KEY); logging offline instead")
                    self.offline = True
            except Exception as e:  # no network, a server error: the run goes on offline
                say(f"[track] wandb: cannot reach W&B ({one_line(e)}); logging offline instead")
                self.offline = True
        if self.offline:
            self._try(lambda: setattr(self, "run", wandb.init(mode="offline", **options)))

    def _try(self, action: Callable[[], None]) -> None:
        """W&B writes its files in a service process of its own; if that fails, training goes on without it."""
        if self.failed:
            return
        try:
            action()
        except Exception as e:
            self.failed = True
            self.say(f"[track] wandb: {one_line(e)}; this run goes on without W&B")

    def log(self, split: str, step: int, metrics: dict[str, float]) -> None:
        self._try(lambda: self.run.log({f"{split}/{k}": v for k, v in metrics.items()}, step=step))

    def finish(self, step: int, final: dict[str, float], checkpoint: Path | None) -> None:
        summary = {f"final/{k}": v for k, v in final.items()}
        if checkpoint is not None:
            summary["checkpoint"] = str(checkpoint)
        self._try(lambda: self.run.summary.update(summary))

    def close(self, status: str) -> None:
        import wandb

        self._try(lambda: self.run.finish(exit_code=1 if status == "failed" else 0))
        # finish() returns before W&B's service has written the run's last records (the run file was read without
        # its last steps), and the atexit hook that would wait for it does not run in spawned ranks, which end with
        # os._exit: wait for the service here.
        self._try(wandb.teardown)
        if self.offline and not self.failed:
            self.say(
                f"[track] wandb: run {self.run.id} was logged offline; upload it with: "
                f"wandb sync {self.run_dir / 'wandb'}/offline-run-*-{self.run.id}"
            )


# ---- MLflow ----------------------------------------------------------------------------------------------------------
class MlflowTracker:
    """An MLflow run through ``MlflowClient`` (no global active run). A store that cannot be reached is reported once;
    its points are kept and sent with the next log line that reaches it."""

    def __init__(self, cfg: TrainConfig, run_dir: Path, say: Callable[[str], None]) -> None:
        # MLflow retries an HTTP call up to 7 times with backoff (minutes) and waits 120 s for an answer: a step must
        # not wait that long. One quick try per log line; the next line retries. (The user's own settings win.)
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
        from mlflow.tracking import MlflowClient

        m = cfg.logging.mlflow
        self.say, self.run_dir = say, run_dir
        self.client = MlflowClient(tracking_uri=m.tracking_uri)
        self.uri = self.client.tracking_uri
        self.experiment = m.experiment or sweep_name(run_dir) or "shardlab"
        self.run_name = m.run_name or run_dir.name
        self.tags = {str(k): str(v) for k, v in m.tags.items()}
        self.params = flat_params(cfg)
        recorded = recorded_ids(run_dir).get("mlflow", {})
        self.run_id: str | None = recorded.get("run_id") if recorded.get("tracking_uri") == self.uri else None
        self.pending: list[Any] = []  # metrics not yet sent
        self.unreachable_since: float | None = None
        self._try(self._open)

    def _open(self) -> None:
        from mlflow.entities import Param, RunStatus

        client = self.client
        if self.run_id is None:
            experiment = client.get_experiment_by_name(self.experiment)
            experiment_id = experiment.experiment_id if experiment else client.create_experiment(self.experiment)
            self.run_id = client.create_run(experiment_id, run_name=self.run_name, tags=self.tags).info.run_id
            record_id(self.run_dir, "mlflow", {"run_id": self.run_id, "tracking_uri": self.uri})
            logged: dict[str, str] = {}
        else:  # a resume: the same run, running again
            client.update_run(self.run_id, status=RunStatus.to_string(RunStatus.RUNNING))
            logged = client.get_run(self.run_id).data.params
        # A parameter cannot change in MLflow: a resume with another value of a key that does not name the run
        # (logging.*, checkpoint.*) keeps the first one, and says so.
        changed = sorted(k for k, v in self.params.items() if k in logged and logged[k] != v[:6000])
        params = [Param(k, v[:6000]) for k, v in self.params.items() if k not in logged]  # MLflow's longest value
        for i in range(0, len(params), 100):  # MLflow's most parameters per call
            client.log_batch(self.run_id, params=params[i : i + 100])
        if changed:
            self.say(f"[track] mlflow: the run keeps the parameters it started with for {', '.join(changed)}")

    def _try(self, action: Callable[[], None]) -> bool:
        """Run ``action`` (after opening the run, if that failed before); report the first failure and the recovery."""
        try:
            if self.unreachable_since is not None and action != self._open:
                self._open()
            action()
        except Exception as e:
            if self.unreachable_since is None:
                self.unreachable_since = time.monotonic()
                self.say(
                    f"[track] mlflow: cannot reach {self.uri} ({one_line(e)}); training goes on, and each log line "
                    "tries again"
                )
            return False
        if self.unreachable_since is not None:
            self.say(f"[track] mlflow: reached {self.uri} again; sent what was kept meanwhile")
            self.unreachable_since = None
        return True

    def _send(self) -> None:
        while self.pending:  # what was sent leaves the buffer at once: a failure midway resends nothing twice
            self.client.log_batch(self.run_id, metrics=self.pending[:1000])  # MLflow's most metrics per call
            del self.pending[:1000]

    def log(self, split: str, step: int, metrics: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.pending += [Metric(f"{split}/{k}", float(v), now, step) for k, v in metrics.items()]
        del self.pending[:-MAX_BUFFERED]
        self._try(self._send)

    def finish(self, step: int, final: dict[str, float], checkpoint: Path | None) -> None:
        if final:
            self.log("final", step, final)
        if checkpoint is not None:
            self._try(lambda: self.client.set_tag(self.run_id, "checkpoint", str(checkpoint)))

    def close(self, status: str) -> None:
        # A stopped run is to be resumed: KILLED says it did not finish, and the resume sets it RUNNING again.
        state = {"completed": "FINISHED", "stopped": "KILLED"}.get(status, "FAILED")
        if not self._try(lambda: self.client.set_terminated(self.run_id, status=state)) and self.pending:
            self.say(f"[track] mlflow: {len(self.pending)} points could not be sent to {self.uri}")
