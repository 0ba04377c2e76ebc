"""Sharded checkpoints with torch.distributed.checkpoint (DCP): never lost, resumable on another world size.

Layout: <run dir>/<checkpoint.dir>/step_00000200/ holds DCP's shard files and .metadata (model + optimizer, by fully
qualified name, so any backend and world size can load them) and shardlab.json (the training state of
shardlab.train_state, the save counter, task and model config). A checkpoint is written to step_N.tmp, its files and
folder are fsynced, and only then renamed; shardlab.json is written last, so a folder named step_N that holds it is
complete. Every rename that changes which checkpoints exist is atomic, and everything set aside keeps a name that says
why (step_N.superseded-1, step_N.unreadable-1): nothing but pruned and stale temporary folders is ever deleted.

Rank 0 alone looks at the folder and decides (which checkpoint to resume, what to prune); the others receive its choice,
since on a network file system ranks can list different contents, and any failure of rank 0's (a full disk, a quota,
permissions) is raised on every rank at once with the same message (agreement.py). What resuming means, and when a
checkpoint is set aside, is the resume sub-package (which calls this class's load_shards). The folder's names and
durable renames live in layout.py, the background write in async_save.py, weights outside training in weights.py.
"""

from __future__ import annotations

import functools
import shutil
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.optim import Optimizer

from shardlab.checkpoint import agreement
from shardlab.checkpoint.layout import TMP, complete_checkpoints, publish, remove, step_name, to_prune
from shardlab.checkpoint.readers import dcp_reader
from shardlab.config import CheckpointConfig
from shardlab.errors import CheckpointError, IncompatibleCheckpointError, RunFolderInUse, first_cause
from shardlab.files.durable import fsync_path
from shardlab.train_state import TrainState

# DCP warns that it assumes a single process when no process group exists: that is exactly the single backend's case.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")


@dataclass
class SaveRecord:
    step: int
    blocked_s: float
    """Time training waited for this save (staging, plus any wait for the previous one in flight)."""
    total_s: float
    """From the save call until its checkpoint had its final name."""


MISSING_STATE = {"ema": "optimization.ema's average of the weights", "task": "the task's own, e.g. SwAV's queue"}
"""What each TrainState.tensors key is, for the line that refuses a checkpoint without it."""


def unsaved_optimizer_states(optim_state: dict, path: Path) -> list[str]:
    """The parameters (names) whose optimizer state step folder ``path`` holds none of: ones the saving run had not
    updated yet (SwAV's prototypes while frozen get no gradient; torch optimizers make state at a first update)."""
    # DCP's flattened keys: optim.state.<name>.<key>
    saved = dcp_reader.read_metadata(path, values=False).state_dict_metadata

    def held(name: str, keys) -> bool:
        return any(f"optim.state.{name}.{key}" in saved for key in keys)

    return [name for name, entries in optim_state["state"].items() if not held(name, entries)]


def _under_checkpoint_timeout(method: Callable) -> Callable:
    """A Checkpointer method whose collectives wait up to checkpoint.timeout_s (Backend.long_timeout): its ranks write,
    read or delete at the file system's pace, and rank 0 alone publishes and prunes while the others wait."""

    @functools.wraps(method)
    def under(self, *args: Any, **kwargs: Any) -> Any:
        with self.comm.long_timeout(self.cfg.timeout_s):
            return method(self, *args, **kwargs)

    return under


class Checkpointer:
    """Saves and prunes the checkpoints of one run directory, and holds what resume.restore found there. ``comm`` is the
    Backend (rank, any_rank, device); every public method is called by all ranks at the same point, and a failure in
    any of them is raised on every rank with the same one-line message (agreement.py)."""

    def __init__(
        self,
        root: Path,
        cfg: CheckpointConfig,
        comm,
        log: Callable[[str], None] = print,
        folder_lost: Callable[[], str | None] = lambda: None,
        model_keys: Callable[[str], bool] | None = None,
    ) -> None:
        self.root = root
        self.folder_lost = folder_lost
        """Why this job may no longer change the folder (another job took its lock over), or None: asked by rank 0
        immediately before each change (a save's start, publish, prune, clean-up), so a job that lost the folder
        between two heartbeats changes nothing the new holder owns. Passed in: the lock is the jobs layer's."""
        self.model_keys = model_keys
        """Which model state-dict keys a step folder holds (Task.checkpointed); None: all. The rest is never changed
        by the run and comes back from its source at every start (a LoRA run's frozen base)."""
        self.cfg = cfg
        self.comm = comm
        self.rank = comm.env.rank
        self.log = log if self.rank == 0 else (lambda message: None)
        self.records: list[SaveRecord] = []
        """Timing of every save of this run (benchmarks and tests read it)."""
        self.resumed_from: Path | None = None
        self.newest: Path | None = None
        """The newest checkpoint this run can go back to (resumed or saved), for the message of a failed save."""
        self.line: dict[str, Any] = {}
        """Where this run began (resume/line.py), written into every checkpoint it saves; set by the resume."""
        self.rollback: dict[str, Any] | None = None
        """Set when the resume resumed an older step than the folder's newest (the trainer puts it in
        status.json)."""
        self.next_index = 1
        self._async = None
        # A run that never saves (checkpoint.save=false, a backend=auto trial) makes no saver, so no process group.
        if cfg.async_save and cfg.save:
            from shardlab.checkpoint.async_save import AsyncSaver

            self._async = AsyncSaver(max(cfg.timeout_s, comm.cfg.timeout_s))  # never shorter than a step's

    @property
    def device(self) -> torch.device:
        return self.comm.device

    # ---- save ------------------------------------------------------------------------------------------------------
    @_under_checkpoint_timeout
    def save(self, model: nn.Module, optimizer: Optimizer, train_state: TrainState, described: dict[str, Any]) -> Path:
        """Write a checkpoint of ``train_state.step`` (all ranks): the model and optimizer shards through DCP, the
        training state and ``described`` (what the checkpoint is of: task, model config, ...) into shardlab.json.
        Async: returns once the state is staged in CPU memory; the checkpoint gets its final name when the write
        completes (checked at the next save and at ``finish``). A failure raises CheckpointError on every rank, in
        one line that says which checkpoint is kept; the unfinished folder is removed."""
        start, step = time.perf_counter(), train_state.step
        self.finish()  # at most one save in flight
        final, tmp = self.root / step_name(step), self.root / (step_name(step) + TMP)

        def prepare() -> None:
            self.root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)

        self._as_holder(prepare, f"saving step {step}: creating {self.root}", f"step {step} was not saved")
        state = {"model": self._model_state(model), "optim": get_optimizer_state_dict(model, optimizer)}
        state.update({key: obj.state_dict() for key, obj in train_state.tensors.items()})  # e.g. "task": a queue
        meta = {
            **train_state.state_dict(),
            "save_index": self.next_index,
            "resumed_from": str(self.resumed_from or ""),
            "line": self.line,
            **described,
        }
        self.next_index += 1
        if self._async is not None:
            self._async.start(state, tmp, final, meta, start)
            return final
        try:
            dcp.save(state, checkpoint_id=str(tmp))  # FileSystemWriter fsyncs every shard file and .metadata
        except (Exception, CheckpointException) as e:  # DCP raises on every rank when any rank failed
            self._discard_everywhere(tmp)
            raise CheckpointError(f"saving step {step} into {tmp} failed ({first_cause(e)}); {self.kept()}") from e
        self._complete(tmp, final, meta, start, blocked_s=time.perf_counter() - start)
        return final

    def kept(self) -> str:
        """What a failed save leaves the run to go back to (the same text on every rank)."""
        if self.newest is None:
            return "this run has no checkpoint yet"
        return f"the newest checkpoint, {self.newest.name}, is kept"

    @_under_checkpoint_timeout
    def finish(self) -> None:
        """Wait for the save in flight, if any, and give it its final name (all ranks; a failure is everyone's)."""
        if self._async is None or not self._async.pending:
            return
        waited_from = time.perf_counter()
        pending, error = self._async.wait()
        failed = agreement.first_error(first_cause(error) if error is not None else None, self.device)
        if failed is not None:
            self._discard_everywhere(pending.tmp)
            raise CheckpointError(
                f"asynchronous save of step {pending.meta['step']} into {pending.tmp} failed ({failed}); {self.kept()}"
            )
        blocked = pending.blocked_s + time.perf_counter() - waited_from
        self._complete(pending.tmp, pending.final, pending.meta, pending.start, blocked_s=blocked)

    def abandon(self, timeout_s: float) -> None:
        """After an error: complete a save in flight if rank 0 can tell it finished everywhere (DCP's coordinator
        writes .metadata only after every rank's shards), without any collective, since other ranks may be gone."""
        if self._async is None or not self._async.pending:
            return
        pending, error = self._async.wait(timeout_s)
        if self.rank == 0 and error is None and (pending.tmp / ".metadata").is_file():
            if lost := self.folder_lost():
                self.log(f"[ckpt] step {pending.meta['step']} not completed after the error: {lost}")
                return
            try:
                publish(pending.tmp, pending.final, pending.meta)
                self.log(f"[ckpt] step {pending.meta['step']} saved (completed after the error)")
            except OSError as e:
                self.log(f"[ckpt] step {pending.meta['step']} could not be completed after the error ({e})")

    def _complete(self, tmp: Path, final: Path, meta: dict, start: float, blocked_s: float) -> None:
        """Every rank's shards are durable in ``tmp`` (DCP's last step agreed on it): rank 0 names the checkpoint
        and prunes. A failed publish is everyone's error; a failed prune only leaves older checkpoints behind."""

        def name_and_prune() -> str:
            if lost := self.folder_lost():
                return f"{lost}; step {meta['step']} was not published (its {tmp.name} is left to that job)"
            try:
                publish(tmp, final, meta)
            except OSError:
                self._discard(tmp)
                raise
            if lost := self.folder_lost():  # published while the folder was this job's; pruning is not now
                return f"{lost}; step {meta['step']} was published, nothing pruned"
            try:
                self._prune(final)
            except OSError as e:
                self.log(f"[ckpt] WARNING: pruning old checkpoints in {self.root} failed ({e}); they stay")
            return ""

        if lost := self._on_rank0(name_and_prune, f"saving step {meta['step']}: naming {final}"):
            raise RunFolderInUse(lost)
        self.newest = final
        record = SaveRecord(meta["step"], blocked_s, time.perf_counter() - start)
        self.records.append(record)
        self.log(f"[ckpt] step {record.step} saved in {record.total_s:.2f} s (blocked {record.blocked_s:.2f} s)")

    def _on_rank0(self, action: Callable[[], str], what: str) -> str:
        try:
            return agreement.on_rank0(action, what, self.device)
        except CheckpointError as e:
            if str(e).startswith(what):  # an unexpected OSError: say what the run still has
                raise CheckpointError(f"{e}; {self.kept()}") from None
            raise

    def _as_holder(self, action: Callable[[], None], what: str, undone: str) -> None:
        """``action`` on rank 0 (``_on_rank0``) only if this job still holds the folder; else RunFolderInUse on every
        rank, saying what was ``undone``."""

        def guarded() -> str:
            if lost := self.folder_lost():
                return f"{lost}; {undone}"
            action()
            return ""

        if lost := self._on_rank0(guarded, what):
            raise RunFolderInUse(lost)

    def _discard(self, tmp: Path) -> None:
        """Rank 0, after a failed save: remove its unfinished folder (freeing the space a full disk needs), unless
        the folder is another job's now (which may be writing a folder of that name itself)."""
        if self.rank == 0 and not self.folder_lost():
            shutil.rmtree(tmp, ignore_errors=True)

    def _discard_everywhere(self, tmp: Path) -> None:
        """``_discard``, with every rank waiting for rank 0 to finish it (under checkpoint.timeout_s): a rank that went
        on to the next step's collectives would wait there, under distributed.timeout_s, for as long as it takes."""

        def discard() -> str:
            self._discard(tmp)
            return ""

        self._on_rank0(discard, f"removing {tmp}")

    def _prune(self, newest: Path) -> None:
        doomed = [
            p
            for p in to_prune(complete_checkpoints(self.root), self.cfg.keep_last, self.cfg.keep_every_steps)
            if p != newest
        ]
        for p in doomed:
            remove(p)
        if doomed:
            fsync_path(self.root)

    def _model_state(self, model: nn.Module) -> dict[str, Any]:
        """The model state a step folder holds: all of it, or the keys ``model_keys`` keeps."""
        state = get_model_state_dict(model)
        return state if self.model_keys is None else {k: v for k, v in state.items() if self.model_keys(k)}

    # ---- load ------------------------------------------------------------------------------------------------------
    def load_shards(
        self, path: Path, model: nn.Module, optimizer: Optimizer | None, tensors: dict | None = None
    ) -> None:
        """Model (and optimizer, and TrainState.tensors) state from ``path``'s shards into the (sharded) model, on any
        world size."""
        state = {"model": self._model_state(model)}
        never_stepped: list[str] = []
        if optimizer is not None:
            optim = get_optimizer_state_dict(model, optimizer)  # every parameter's state, made by a zero-lr step
            never_stepped = unsaved_optimizer_states(optim, path)
            state["optim"] = {**optim, "state": {k: v for k, v in optim["state"].items() if k not in never_stepped}}
        tensors = tensors or {}
        saved = dcp_reader.read_metadata(path, values=False).state_dict_metadata
        for key in tensors:  # state this run keeps that the saving run did not: a refusal, not a torn checkpoint
            if not any(name.startswith(f"{key}.") for name in saved):
                raise IncompatibleCheckpointError(
                    f"{path} holds no {key}.* state, which this run keeps ({MISSING_STATE.get(key, key)}): its run "
                    "had it off; begin from its weights with checkpoint.init_from, or turn it off"
                )
        state.update({key: obj.state_dict() for key, obj in tensors.items()})
        live_names = [list(group["params"]) for group in state["optim"]["param_groups"]] if optimizer else []
        dcp_reader.load(state, path, checked=True)  # its metadata was checked (resume.py)
        # The param groups' hyperparameters come from the file, written once (by rank 0); the names of their
        # parameters are this rank's: a pipeline stage holds only some (shardlab.distributed.pipeline), and a
        # checkpoint of stages lists only the first stage's.
        for group, names in zip(state["optim"]["param_groups"] if optimizer else [], live_names, strict=True):
            group["params"] = names
        set_model_state_dict(model, state["model"], options=StateDictOptions(strict=self.model_keys is None))
        if optimizer is not None:
            set_optimizer_state_dict(model, optimizer, optim)  # loaded in place into optim's tensors
            # DCP lists each group's parameter names in the optimizer's order (whatever wraps the model: DDP,
            # activation checkpointing, compile), so the names map to the optimizer's parameters directly.
            parameters = {
                name: p
                for saved, group in zip(optim["param_groups"], optimizer.param_groups, strict=True)
                for name, p in zip(saved["params"], group["params"], strict=True)
            }
            for name in never_stepped:  # as in the run that saved: no state until its first update
                optimizer.state.pop(parameters[name], None)
        for key, obj in tensors.items():
            obj.load_state_dict(state[key])
