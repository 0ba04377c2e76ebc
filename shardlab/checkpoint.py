"""Sharded checkpoints with torch.distributed.checkpoint (DCP): atomic, resumable on another world size.

Layout: <run dir>/<checkpoint.dir>/step_00000200/ holds DCP's shard files and .metadata (model + optimizer, by fully
qualified name, so any backend and world size can load them) and shardlab.json (step, global data offset, scheduler
and grad-scaler state, the model config). A checkpoint is written to step_N.tmp and renamed once every rank finished,
so a killed run never leaves a half-written checkpoint that looks complete; only then are old ones pruned.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.optim import Optimizer

from shardlab.errors import CheckpointError, ConfigError

# DCP warns that it assumes a single process when no process group exists: that is exactly the single backend's case.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")

STEP_DIR = re.compile(r"^step_(\d+)$")
META_FILE = "shardlab.json"


def complete_checkpoints(root: Path) -> list[Path]:
    """Finished checkpoints under ``root``, oldest first."""
    if not root.is_dir():
        return []
    found = [
        (int(m.group(1)), p) for p in root.iterdir() if (m := STEP_DIR.match(p.name)) and (p / META_FILE).is_file()
    ]
    return [p for _, p in sorted(found)]


def read_meta(path: Path) -> dict[str, Any]:
    meta_file = path / META_FILE
    if not meta_file.is_file():
        raise CheckpointError(
            f"{path} is not a complete shardlab checkpoint (no {META_FILE}); "
            "point checkpoint.resume at a step_N directory that has one"
        )
    try:
        return json.loads(meta_file.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{meta_file} is unreadable ({e}); delete that checkpoint or resume from another") from e


def _first_cause(error: BaseException) -> str:
    """A one-line reason; DCP wraps each rank's exception (a BaseException subclass) in CheckpointException."""
    failures = getattr(error, "failures", None)
    if failures:
        inner = next(iter(failures.values()))
        error = inner[0] if isinstance(inner, tuple) else inner  # (exception, traceback) per rank
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0][:200]}" if text else type(error).__name__


class Checkpointer:
    def __init__(self, root: Path, keep_last: int, rank: int, barrier) -> None:
        self.root = root
        self.keep_last = keep_last
        self.rank = rank
        self.barrier = barrier

    def resolve_resume(self, resume: str) -> Path | None:
        """The checkpoint to start from, per checkpoint.resume (auto, none, or a path)."""
        existing = complete_checkpoints(self.root)
        if resume == "auto":
            return existing[-1] if existing else None
        if resume == "none":
            if existing:
                raise ConfigError(
                    f"checkpoint.resume=none but {self.root} already holds {existing[-1].name}; pass "
                    "checkpoint.resume=auto to continue it, or hydra.run.dir=<new dir> to start a separate run"
                )
            return None
        path = Path(resume).expanduser()
        if not path.is_dir():
            raise CheckpointError(f"checkpoint.resume: {path} does not exist; give a step_N checkpoint directory")
        return path

    def save(self, step: int, model: nn.Module, optimizer: Optimizer, meta: dict[str, Any]) -> Path:
        final = self.root / f"step_{step:08d}"
        tmp = self.root / f"step_{step:08d}.tmp"
        if self.rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
        self.barrier()
        state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)}
        dcp.save(state, checkpoint_id=str(tmp))
        self.barrier()
        if self.rank == 0:
            (tmp / META_FILE).write_text(json.dumps({"step": step, **meta}, indent=1))
            if final.exists():  # a re-save of the same step (e.g. after resuming at the end): replace it whole
                shutil.rmtree(final)
            os.replace(tmp, final)
            for old in complete_checkpoints(self.root)[: -self.keep_last]:
                shutil.rmtree(old, ignore_errors=True)
        self.barrier()
        return final

    def load(
        self,
        path: Path,
        model: nn.Module,
        optimizer: Optimizer | None,
        model_config: dict,
        ignore_keys: tuple[str, ...] = (),
    ) -> dict[str, Any]:
        """Load model (and optimizer) state from ``path``; ``model_config`` must match the saved one except for
        ``ignore_keys`` (settings that do not change what the weights mean, such as dropout)."""
        meta = read_meta(path)
        saved = meta.get("model_config", {})
        keys = sorted((set(saved) | set(model_config)) - set(ignore_keys))
        diffs = [k for k in keys if saved.get(k) != model_config.get(k)]
        if diffs:
            k = diffs[0]
            raise CheckpointError(
                f"{path} was saved with model.{k}={saved.get(k)!r} but this run has model.{k}={model_config.get(k)!r}; "
                "resume with the checkpoint's model config, or start a new run in another hydra.run.dir"
            )
        state = {"model": get_model_state_dict(model)}
        if optimizer is not None:
            state["optim"] = get_optimizer_state_dict(model, optimizer)
        try:
            dcp.load(state, checkpoint_id=str(path))
        except (Exception, CheckpointException) as e:  # torn or foreign files: all mean the same to the user
            reason = _first_cause(e)
            raise CheckpointError(
                f"checkpoint {path} could not be loaded ({reason}); delete it to fall back to an "
                "older one, or pass checkpoint.resume=<path of another step_N>"
            ) from e
        set_model_state_dict(model, state["model"])
        if optimizer is not None:
            set_optimizer_state_dict(model, optimizer, state["optim"])
        return meta
