"""What the user sees while training: a rank-0 progress bar, periodic log lines, TensorBoard scalars, and the same
scalars in the experiment trackers that are enabled (shardlab.logging.trackers: W&B, MLflow).

The log lines also go to the run directory's train.log (beside Hydra's own lines there, on every launch path) and
the step reached to its status.json (for sweep summaries).

- ``trackers``: Weights & Biases and MLflow, fed the same scalars from rank 0 (``logging.wandb``, ``logging.mlflow``).
- ``throughput``: units per second and milliseconds per step of the steps since the last train line.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from shardlab.config import LoggingConfig, TrainConfig
from shardlab.jobs import run_record
from shardlab.logging.trackers import Tracker, open_trackers

__all__ = ["LOG_FILE", "RunLogger", "format_metrics", "trackers"]

LOG_FILE = "train.log"


def format_metrics(metrics: dict[str, float]) -> str:
    parts = []
    for key, value in metrics.items():
        if isinstance(value, int) or (isinstance(value, float) and value.is_integer() and abs(value) >= 1000):
            parts.append(f"{key} {int(value)}")
        elif abs(value) >= 100:
            parts.append(f"{key} {value:.1f}")
        elif abs(value) < 0.01 and value != 0:
            parts.append(f"{key} {value:.2e}")
        else:
            parts.append(f"{key} {value:.4g}")
    return " | ".join(parts)


class RunLogger:
    """Console + TensorBoard + trackers on rank 0; every method is a no-op elsewhere so call sites need no rank checks.

    ``run_config``: the composed config, which the trackers record as the run's parameters."""

    def __init__(
        self,
        cfg: LoggingConfig,
        run_dir: Path,
        is_main: bool,
        total_steps: int,
        start_step: int,
        run_config: TrainConfig | None = None,
    ) -> None:
        self.is_main = is_main
        self.run_dir = run_dir
        self.bar = None
        self.tb = None
        self.trackers: list[Tracker] = []
        self.status = "failed"  # until finish() says otherwise
        if not is_main:
            return
        run_dir.mkdir(parents=True, exist_ok=True)
        self.file = open(run_dir / LOG_FILE, "a", buffering=1)  # noqa: SIM115  (closed in close())
        if cfg.progress_bar:
            from tqdm import tqdm

            self.bar = tqdm(
                total=total_steps,
                initial=start_step,
                desc="train",
                unit="step",
                dynamic_ncols=True,
                file=sys.stderr,
                mininterval=1.0,
            )
        if cfg.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            # A resumed run first discards events past its checkpoint (logged before a crash or kill, then trained
            # again), so the directory holds one continuous history.
            self.tb = SummaryWriter(str(run_dir / "tensorboard"), purge_step=start_step + 1 if start_step else None)
        if run_config is not None:
            self.trackers = open_trackers(run_config, run_dir, self.info)

    def info(self, message: str) -> None:
        if not self.is_main:
            return
        if self.bar is not None:
            self.bar.write(message, file=sys.stdout)
        else:
            print(message, flush=True)
        self.file.write(f"[{time.strftime('%Y-%m-%d %H:%M:%S')}] {message}\n")

    def advance(self, postfix: dict[str, float] | None = None) -> None:
        if self.bar is not None:
            self.bar.update(1)
            if postfix:
                self.bar.set_postfix({k: f"{v:.4g}" for k, v in postfix.items()}, refresh=False)

    def log(self, split: str, step: int, metrics: dict[str, float]) -> None:
        if not self.is_main:
            return
        self.info(f"[{split}] step {step} | {format_metrics(metrics)}")
        if split == "train":
            run_record.update(self.run_dir, step=step)
        if self.tb is not None:
            for key, value in metrics.items():
                self.tb.add_scalar(f"{split}/{key}", value, step)
            self.tb.flush()
        for tracker in self.trackers:
            tracker.log(split, step, metrics)

    def finish(self, step: int, final: dict[str, float], checkpoint: Path | None, stopped: bool) -> None:
        """The run's end as the trackers keep it: its final metrics and newest checkpoint, and whether it stopped to
        be resumed or completed."""
        if not self.is_main:
            return
        self.status = "stopped" if stopped else "completed"
        for tracker in self.trackers:
            tracker.finish(step, final, checkpoint)

    def close(self) -> None:
        if not self.is_main:
            return
        for tracker in self.trackers:  # first: their last lines go to train.log too
            tracker.close(self.status)
        self.file.close()
        if self.bar is not None:
            self.bar.close()
        if self.tb is not None:
            self.tb.close()
