"""Resume, in one place: where a trainer's state comes from at its start. The trainer calls ``restore_training``,
the one entry, once, from Trainer.setup, after the model, optimizer and training state exist; what the restore needs
from above this package (the rule that says which config keys name a run, the task's hooks) is passed in.

1. Continue the folder's run or begin one (``line``: what checkpoint.resume and checkpoint.init_from mean on a first
   start and on every requeue, from the run line each checkpoint records).
2. Load the chosen checkpoint, falling back past unreadable ones of the same run (``candidates``: rank 0 decides,
   every rank agrees; a refused checkpoint stops the run, a torn one is set aside and the rollback announced).
3. Else checkpoint.init_from's weights (``init_from`` here), else the task's pretrained weights, else the seeded init
   the model already has.

The step folders are read through the hardened readers (shardlab.checkpoint.readers) and loaded by the Checkpointer
(shardlab.checkpoint.manager), which this package drives and which knows nothing of resume decisions.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from torch import nn
from torch.optim import Optimizer

from shardlab.checkpoint import agreement, weights
from shardlab.checkpoint.manager import Checkpointer
from shardlab.checkpoint.readers import dcp_reader
from shardlab.checkpoint.resume.candidates import restore
from shardlab.checkpoint.resume.line import start_of
from shardlab.config import TrainConfig, as_container
from shardlab.errors import CheckpointError, IncompatibleCheckpointError, UnsafeCheckpointError, first_cause
from shardlab.train_state import TrainState

__all__ = ["init_from", "restore_training"]

Refusal = Callable[[Path, dict, str], str | None]
"""(checkpoint, its saved model section, "resume" or "init_from") -> why the task cannot use it so, or None
(Task.checkpoint_refusal)."""

KeyDifferences = Callable[[Mapping[str, Any], Mapping[str, Any]], list[tuple[str, Any, Any]]]
"""(saved config, this run's config) -> (key, saved, current) for each key that names the run and differs
(shardlab.cli.run_names.run_key_differences)."""


def restore_training(
    cfg: TrainConfig,
    ckpt: Checkpointer,
    model: nn.Module,
    optimizer: Optimizer,
    state: TrainState,
    backend: Any,
    *,
    model_config: dict,
    resumable_changes: tuple[str, ...] | list[str],
    run_key_differences: KeyDifferences,
    load_pretrained: Callable[[], Path | None] = lambda: None,
    refusal: Refusal = lambda *_: None,
) -> tuple[Path | None, Path | None]:
    """Continue the folder's run, or begin one per checkpoint.resume (a checkpoint path), checkpoint.init_from
    (weights) or the seeded init (``line``: what each setting means on a requeue); (the
    checkpoint resumed, the init_from weights loaded), at most one of them set. ``resumable_changes``: the model
    keys a resume may change (the task's); ``load_pretrained`` loads the task's own starting weights
    (model.pretrained) into the sharded model when neither a checkpoint nor init_from gives them, and names them;
    ``refusal`` the task's own reason not to use a checkpoint, asked before any tensor is read."""
    check = _checker(cfg, model_config, resumable_changes, run_key_differences, refusal)
    start = start_of(cfg.checkpoint.resume, cfg.checkpoint.init_from)
    initialized_from = None
    # Rank 0 cleans and lists the folder, every rank reads its shards (or the whole init_from file): collectives
    # wait up to checkpoint.timeout_s, the last of them an agreement, so all ranks leave this together.
    with backend.long_timeout(cfg.checkpoint.timeout_s):
        resumed_from = restore(ckpt, cfg.checkpoint.resume, start, check, model, optimizer, state)
        # A step folder that holds part of the model (Checkpointer.model_keys: a LoRA run's adapters) is completed by
        # the weights the run began from, read again: the frozen rest was never saved.
        base = resumed_from is None or ckpt.model_keys is not None
        source = None
        if base and cfg.checkpoint.init_from:
            others = None if ckpt.model_keys is None else (lambda key: not ckpt.model_keys(key))
            path = Path(cfg.checkpoint.init_from).expanduser()
            source = init_from(
                path, model, cfg.task.name, model_config, resumable_changes, backend.device, others, refusal
            )
        elif base:
            source = load_pretrained()
        if resumed_from is None:
            initialized_from = source
        elif source is not None:
            ckpt.log(f"[ckpt] the frozen weights that {resumed_from.name} does not hold: read from {source}")
    if resumed_from is not None and cfg.checkpoint.init_from and start.kind == "weights" and ckpt.model_keys is None:
        ckpt.log(f"[ckpt] checkpoint.init_from is not used: resuming {resumed_from}")
    return resumed_from, initialized_from


def _checker(
    cfg: TrainConfig, model_config: dict, resumable_changes, run_key_differences: KeyDifferences, refusal: Refusal
) -> Callable[[Path, bool], dict]:
    """``check(path, continuing) -> meta`` for resume.restore: a checkpoint of this task and model shape, and when
    continuing, of this very run."""
    full_config = as_container(cfg)

    def check(path: Path, continuing: bool) -> dict:
        meta = weights.describe(path)  # reads shardlab.json: an unreadable one is a torn checkpoint
        weights.check_compatible(path, meta, cfg.task.name, model_config, resumable_changes)
        if reason := refusal(path, meta.get("model_config") or {}, "resume"):
            raise IncompatibleCheckpointError(reason)
        if continuing:  # the same run: every key that names it must match, not only the model's shape
            differences = run_key_differences(meta.get("config") or {}, full_config)
            if differences:
                key, saved, current = differences[0]
                raise IncompatibleCheckpointError(
                    f"{path} belongs to a run with {key}={saved!r}, but this run has {key}={current!r}: the folder "
                    "holds another experiment; use another hydra.run.dir, or pass checkpoint.resume=<that step_N> "
                    "to begin a new run from it"
                )
        return meta

    return check


def init_from(
    path: Path,
    model: nn.Module,
    task_name: str,
    model_config: dict,
    resumable_changes,
    device,
    keys: Callable[[str], bool] | None = None,
    refusal: Refusal = lambda *_: None,
) -> Path:
    """checkpoint.init_from: weights only, refused in one line if another task or model shape; agreed over ranks.
    ``keys``: the model state keys to read (None: all; a LoRA run reads its base, not its adapters); ``refusal``: the
    task's reason not to begin from these weights, asked before any is read."""
    error: BaseException | None = None
    try:
        info = weights.describe(path)
        weights.check_compatible(path, info, task_name, model_config, resumable_changes)
        if reason := refusal(path, info.get("model_config") or {}, "init_from"):
            raise IncompatibleCheckpointError(reason)
        if path.is_dir():
            dcp_reader.read_metadata(path)  # refused or unreadable here, not inside the collective load
    except Exception as e:
        error = e
    agreement.agree(error, f"checkpoint.init_from: reading {path}", device)
    try:
        weights.load_into(model, path, checked=True, keys=keys)  # read_metadata above, agreed by every rank
    except UnsafeCheckpointError as e:
        error = e
    except Exception as e:
        error = CheckpointError(
            f"checkpoint.init_from: {path} could not be loaded ({first_cause(e)}); give a .safetensors file "
            "from shardlab-consolidate or an intact step_N directory"
        )
    agreement.agree(error, f"checkpoint.init_from: loading {path}", device)
    return path
