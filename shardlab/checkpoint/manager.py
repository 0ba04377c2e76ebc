"""Sharded checkpoints with torch.distributed.checkpoint (DCP): never lost, resumable on another world size.

Layout: <run dir>/<checkpoint.dir>/step_00000200/ holds DCP's shard files and .metadata (model + optimizer, by fully
qualified name, so any backend and world size can load them) and shardlab.json (the training state of
shardlab.train_state, the save counter, task and model config). A checkpoint is written to step_N.tmp, its files and
folder are fsynced, and only then renamed; shardlab.json is written last, so a folder named step_N that holds it is
complete. Every rename that changes which checkpoints exist is atomic, and everything set aside keeps a name that says
why (step_N.superseded-1, step_N.unreadable-1): nothing but pruned and stale temporary folders is ever deleted.

Rank 0 alone looks at the folder and decides (which checkpoint to resume, what to prune); the others receive its choice,
since on a network file system ranks can list different contents. The folder's names and durable renames live in
layout.py, the background write in async_save.py, weights outside training in weights.py (all in this package).
"""

from __future__ import annotations

import shutil
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
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

from shardlab.checkpoint.layout import (
    STEP_DIR,
    TMP,
    clean_stale,
    complete_checkpoints,
    fsync_path,
    publish,
    remove,
    save_index,
    set_aside,
    step_name,
    to_prune,
)
from shardlab.errors import CheckpointError, ConfigError, IncompatibleCheckpointError, ShardlabError, first_cause
from shardlab.train_state import TrainState

# DCP warns that it assumes a single process when no process group exists: that is exactly the single backend's case.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")


# ---- cross-rank agreement --------------------------------------------------------------------------------------------
def broadcast_text(text: str, rank: int, device: torch.device) -> str:
    """Rank 0's ``text`` on every rank, as bytes in two broadcasts (no pickling, unlike broadcast_object_list)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return text
    data = torch.tensor(list(text.encode()), dtype=torch.uint8) if rank == 0 else torch.empty(0, dtype=torch.uint8)
    size = torch.tensor([data.numel()], dtype=torch.int64, device=device)
    dist.broadcast(size, 0)
    buf = data.to(device) if rank == 0 else torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    dist.broadcast(buf, 0)
    return bytes(buf.cpu().tolist()).decode()


@dataclass
class SaveRecord:
    step: int
    blocked_s: float
    """Time training waited for this save (staging, plus any wait for the previous one in flight)."""
    total_s: float
    """From the save call until its checkpoint had its final name."""


class Checkpointer:
    """Saves, prunes and restores checkpoints of one run directory. ``comm`` is the Backend (rank, barrier, any_rank,
    device); every public method is called by all ranks at the same point."""

    def __init__(self, root: Path, cfg: Any, comm, log: Callable[[str], None] = print) -> None:
        self.root = root
        self.cfg = cfg
        self.comm = comm
        self.rank = comm.env.rank
        self.log = log if self.rank == 0 else (lambda message: None)
        self.records: list[SaveRecord] = []
        """Timing of every save of this run (benchmarks and tests read it)."""
        self.resumed_from: Path | None = None
        self._next_index = 1
        self._async = None
        if cfg.async_save:
            from shardlab.checkpoint.async_save import AsyncSaver

            self._async = AsyncSaver()

    # ---- start -----------------------------------------------------------------------------------------------------
    def restore(
        self,
        resume: str,
        check: Callable[[Path], dict],
        model: nn.Module,
        optimizer: Optimizer,
        train_state: TrainState,
    ) -> Path | None:
        """Resume per checkpoint.resume (auto, none, or a path) into ``model``, ``optimizer`` and ``train_state``;
        returns the checkpoint it resumed, or None.

        ``check(path) -> meta`` reads and validates shardlab.json (local); the shards are then read into the model
        and optimizer (a collective). Each phase is agreed over ranks, so a failure on any rank is everyone's failure.
        With auto, a checkpoint that fails is skipped for the previous one and set aside once that one loaded; if none
        loads, nothing is renamed and the run stops. An explicit path that fails stops the run; so does another
        task's or model shape's checkpoint.
        """
        if self.rank == 0:
            for line in clean_stale(self.root):
                self.log(f"[ckpt] {line} (left by a run that stopped mid-save)")
        chosen = ""
        if self.rank == 0:
            try:
                chosen = "\n".join(str(p) for p in self._candidates(resume))
            except ShardlabError as e:  # sent to every rank, so none waits for a choice that never comes
                chosen = f"!{type(e).__name__}:{e}"
        chosen = broadcast_text(chosen, self.rank, self.device)
        if chosen.startswith("!"):
            kind, message = chosen[1:].split(":", 1)
            raise (ConfigError if kind == "ConfigError" else CheckpointError)(message)
        candidates = [Path(p) for p in chosen.splitlines()]
        failures: list[tuple[Path, str]] = []
        for path in candidates:
            meta, error = None, None
            try:
                meta = check(path)
            except IncompatibleCheckpointError as e:
                error = e
            except CheckpointError as e:  # an unreadable shardlab.json: torn, like an unreadable shard
                meta, error = None, e
            incompatible = isinstance(error, IncompatibleCheckpointError)
            unreadable, refused = self.comm.any_rank(error is not None, incompatible)
            if refused:
                raise error if incompatible else CheckpointError(f"checkpoint {path} was refused on another rank")
            if not unreadable:  # the load is a collective: all ranks enter it, or none
                try:
                    self._load_shards(path, model, optimizer, train_state.tensors)
                except (Exception, CheckpointException) as e:  # torn or foreign files: all mean the same to the user
                    error = e
            (failed,) = self.comm.any_rank(error is not None)
            if not failed:
                self._set_aside_unreadable(failures)
                self._start_line(path, meta)
                train_state.load_state_dict(meta)
                return path
            failures.append((path, first_cause(error) if error is not None else "failed on another rank"))
        if failures:  # nothing renamed: a transient read error must not cost the run its checkpoints
            path, reason = failures[0]
            fallback = "" if len(candidates) == 1 else f" nor could the {len(candidates) - 1} older one(s);"
            raise CheckpointError(
                f"checkpoint {path} could not be loaded ({reason});{fallback} pass checkpoint.resume=<path of "
                "another step_N>, or move the broken one away to fall back to an older one"
            )
        self._start_line(None)
        return None

    def _candidates(self, resume: str) -> list[Path]:
        """Rank 0: the checkpoints to try, in order (auto: newest first, falling back to older ones)."""
        if resume == "auto":
            return complete_checkpoints(self.root)[::-1]
        chosen = self._choose(resume)
        return [chosen] if chosen is not None else []

    def _set_aside_unreadable(self, failures: list[tuple[Path, str]]) -> None:
        """Rank 0, once an older checkpoint loaded: the newer ones that failed are renamed, one line each."""
        if self.rank == 0:
            for path, reason in failures:
                aside = set_aside(path, "unreadable")
                self.log(f"[ckpt] {path} is unreadable ({reason}); set aside as {aside.name}, resuming an older one")
            if failures:
                fsync_path(self.root)

    def _choose(self, resume: str) -> Path | None:
        """Rank 0: checkpoint.resume=none (nothing, if the folder is empty) or a path."""
        existing = complete_checkpoints(self.root)
        if resume == "none":
            if existing:
                raise ConfigError(
                    f"checkpoint.resume=none but {self.root} already holds {existing[-1].name}; pass "
                    "checkpoint.resume=auto to continue it, or hydra.run.dir=<new dir> to start a separate run"
                )
            return None
        path = Path(resume).expanduser().absolute()
        if not path.is_dir():
            raise CheckpointError(f"checkpoint.resume: {path} does not exist; give a step_N checkpoint directory")
        return path

    def _start_line(self, resumed: Path | None, meta: dict | None = None) -> None:
        """Rank 0: move checkpoints newer than the resumed step aside, so they neither shadow this run line on the
        next resume=auto nor get pruned for it; continue the save counter."""
        self.resumed_from = resumed
        if self.rank == 0:
            step = meta["step"] if meta else -1
            newer = [
                p
                for p in complete_checkpoints(self.root)
                if int(STEP_DIR.match(p.name).group(1)) >= step
                and (resumed is None or p.resolve() != resumed.resolve())
            ]
            if resumed is not None and newer:
                moved = [set_aside(p, "superseded") for p in newer]
                fsync_path(self.root)
                self.log(
                    f"[ckpt] resumed from step {step}, older than {len(moved)} checkpoint(s) of the previous run line; "
                    f"kept aside as {', '.join(p.name for p in moved)}"
                )
            indices = [save_index(p) for p in complete_checkpoints(self.root)]
            self._next_index = max([0, *indices, (meta or {}).get("save_index", 0)]) + 1
        self.comm.barrier()

    @property
    def device(self) -> torch.device:
        return self.comm.device

    # ---- save ------------------------------------------------------------------------------------------------------
    def save(self, model: nn.Module, optimizer: Optimizer, train_state: TrainState, described: dict[str, Any]) -> Path:
        """Write a checkpoint of ``train_state.step`` (all ranks): the model and optimizer shards through DCP, the
        training state and ``described`` (what the checkpoint is of: task, model config, ...) into shardlab.json.
        Async: returns once the state is staged in CPU memory; the checkpoint gets its final name when the write
        completes (checked at the next save and at ``finish``)."""
        start, step = time.perf_counter(), train_state.step
        self.finish()  # at most one save in flight
        final, tmp = self.root / step_name(step), self.root / (step_name(step) + TMP)
        if self.rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
        self.comm.barrier()
        state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)}
        state.update({key: obj.state_dict() for key, obj in train_state.tensors.items()})  # e.g. "task": a queue
        meta = {
            **train_state.state_dict(),
            "save_index": self._next_index,
            "resumed_from": str(self.resumed_from or ""),
            **described,
        }
        self._next_index += 1
        if self._async is not None:
            self._async.start(state, tmp, final, meta, start)
            return final
        dcp.save(state, checkpoint_id=str(tmp))  # FileSystemWriter fsyncs every shard file and .metadata
        self.comm.barrier()
        self._complete(tmp, final, meta, start, blocked_s=time.perf_counter() - start)
        return final

    def finish(self) -> None:
        """Wait for the save in flight, if any, and give it its final name (all ranks; a failure is everyone's)."""
        if self._async is None or not self._async.pending:
            return
        waited_from = time.perf_counter()
        pending, error = self._async.wait()
        (failed,) = self.comm.any_rank(error is not None)
        if failed:
            reason = first_cause(error) if error is not None else "failed on another rank"
            raise CheckpointError(f"asynchronous save of {pending.final} failed ({reason}); the previous one is kept")
        self.comm.barrier()
        blocked = pending.blocked_s + time.perf_counter() - waited_from
        self._complete(pending.tmp, pending.final, pending.meta, pending.start, blocked_s=blocked)

    def abandon(self, timeout_s: float) -> None:
        """After an error: complete a save in flight if rank 0 can tell it finished everywhere (DCP's coordinator
        writes .metadata only after every rank's shards), without any collective, since other ranks may be gone."""
        if self._async is None or not self._async.pending:
            return
        pending, error = self._async.wait(timeout_s)
        if self.rank == 0 and error is None and (pending.tmp / ".metadata").is_file():
            publish(pending.tmp, pending.final, pending.meta)
            self.log(f"[ckpt] step {pending.meta['step']} saved (completed after the error)")

    def _complete(self, tmp: Path, final: Path, meta: dict, start: float, blocked_s: float) -> None:
        if self.rank == 0:
            publish(tmp, final, meta)
            self._prune(final)
        self.comm.barrier()
        record = SaveRecord(meta["step"], blocked_s, time.perf_counter() - start)
        self.records.append(record)
        self.log(f"[ckpt] step {record.step} saved in {record.total_s:.2f} s (blocked {record.blocked_s:.2f} s)")

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

    # ---- load ------------------------------------------------------------------------------------------------------
    @staticmethod
    def _load_shards(path: Path, model: nn.Module, optimizer: Optimizer | None, tensors: dict | None = None) -> None:
        """Model (and optimizer, and TrainState.tensors) state from ``path``'s shards into the (sharded) model, on any
        world size."""
        state = {"model": get_model_state_dict(model)}
        if optimizer is not None:
            state["optim"] = get_optimizer_state_dict(model, optimizer)
        tensors = tensors or {}
        state.update({key: obj.state_dict() for key, obj in tensors.items()})
        dcp.load(state, checkpoint_id=str(path))
        set_model_state_dict(model, state["model"])
        if optimizer is not None:
            set_optimizer_state_dict(model, optimizer, state["optim"])
        for key, obj in tensors.items():
            obj.load_state_dict(state[key])
