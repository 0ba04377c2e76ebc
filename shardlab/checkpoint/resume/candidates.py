"""Resuming a run: which checkpoint (rank 0 decides, every rank agrees), loading it, and what a failure means.

1. Rank 0 cleans what a killed save left, lists the folder and decides, by the resume setting and the run line of the
   newest checkpoint (line.py), whether this start continues the folder's run or begins a new one; every rank
   receives the decision (as JSON text, never a pickle).
2. Each candidate, newest first, is checked (shardlab.json read and compared with this run: the keys that name the
   run when continuing it, the task and model shape when beginning from it) and loaded; every phase is agreed, so a
   failure on any rank is everyone's.
3. A load that fails is looked at again by rank 0 (dcp_reader.integrity_defect). Only a clear defect (a torn or
   truncated file) makes it unreadable: when continuing, the previous checkpoint is tried, and once one loads the
   unreadable ones are set aside and the rollback is announced loudly (console, status.json). A failure whose
   files look intact (an I/O error that may pass) sets nothing aside and stops the run: a requeue retries it.
4. A refused checkpoint (another run's, another model's, or a .metadata that would run code) stops the run at once.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.optim import Optimizer

from shardlab.checkpoint import agreement
from shardlab.checkpoint.layout import STEP_DIR, clean_stale, complete_checkpoints, read_meta, save_index, set_aside
from shardlab.checkpoint.manager import Checkpointer
from shardlab.checkpoint.readers.dcp_reader import integrity_defect, read_metadata
from shardlab.checkpoint.resume import line as run_line
from shardlab.distributed.env import current_job
from shardlab.errors import (
    CheckpointError,
    IncompatibleCheckpointError,
    UnsafeCheckpointError,
    first_cause,
)
from shardlab.files.durable import fsync_path
from shardlab.train_state import TrainState

REFUSED = (IncompatibleCheckpointError, UnsafeCheckpointError)
"""Errors that stop a resume at once: never a reason to fall back to an older checkpoint, never set aside."""


def step_of(path: Path) -> int:
    return int(STEP_DIR.match(path.name).group(1))


def restore(
    ckpt: Checkpointer,
    resume: str,
    start: run_line.Start,
    check: Callable[[Path, bool], dict],
    model: nn.Module,
    optimizer: Optimizer,
    train_state: TrainState,
) -> Path | None:
    """See the module docstring; returns the checkpoint resumed, or None (the run begins from scratch or from
    ``init_from``, which the trainer loads). ``check(path, continuing) -> meta`` reads and validates shardlab.json."""
    decision = _decide(ckpt, resume, start)
    if decision.note:
        ckpt.log(decision.note)
    candidates = decision.candidates
    failures: list[tuple[Path, str]] = []
    for path in candidates:
        meta, reason = _load(ckpt, path, decision.continues, check, model, optimizer, train_state.tensors)
        if meta is not None:
            _after_load(ckpt, path, meta, decision, failures, start)
            train_state.load_state_dict(meta)
            ckpt.resumed_from = ckpt.newest = path
            return path
        failures.append((path, reason))
        if not decision.continues:
            break  # an explicit beginning has no fallback
    if failures:  # nothing renamed: no checkpoint loaded, so none is known to be the broken one
        path, reason = failures[0]
        older = "" if len(candidates) == 1 else f" nor could the {len(candidates) - 1} older one(s);"
        raise CheckpointError(
            f"checkpoint {path} could not be loaded ({reason});{older} pass checkpoint.resume=<path of another "
            "step_N>, or move the broken one away to fall back to an older one"
        )
    ckpt.line = run_line.new_line(start, current_job())
    _set_next_index(ckpt, None)
    return None


def _decide(ckpt: Checkpointer, resume: str, start: run_line.Start) -> run_line.Decision:
    def plan() -> str:
        for line in clean_stale(ckpt.root):
            ckpt.log(f"[ckpt] {line} (left by a run that stopped mid-save)")
        existing = complete_checkpoints(ckpt.root)
        decision = run_line.decide(resume, start, existing, [_line(p) for p in existing])
        if not decision.continues and decision.candidates and not decision.candidates[0].is_dir():
            raise CheckpointError(
                f"checkpoint.resume: {decision.candidates[0]} does not exist; give a step_N checkpoint directory"
            )
        return json.dumps(
            {
                "continues": decision.continues,
                "candidates": [str(p) for p in decision.candidates],
                "note": decision.note,
            }
        )

    agreed = json.loads(agreement.on_rank0(plan, f"reading {ckpt.root}", ckpt.device))
    return run_line.Decision(agreed["continues"], [Path(p) for p in agreed["candidates"]], agreed["note"])


def _line(path: Path) -> run_line.Start | None | str:
    """Where the run of checkpoint ``path`` began (None: it does not say), or UNREADABLE (a torn shardlab.json)."""
    try:
        return run_line.line_of(read_meta(path))
    except CheckpointError:
        return run_line.UNREADABLE


def _load(
    ckpt: Checkpointer, path: Path, continuing: bool, check, model: nn.Module, optimizer: Optimizer, tensors: dict
) -> tuple[dict | None, str]:
    """(meta, "") once ``path`` loaded on every rank; (None, why) if it is unreadable. Raises, on every rank, if it
    is refused or if its failure is not a clear defect."""
    meta, error, refusal = None, None, None
    try:
        meta = check(path, continuing)
        read_metadata(path)  # refused or unreadable here, not inside the collective load
    except REFUSED as e:
        refusal = e
    except CheckpointError as e:  # an unreadable shardlab.json: torn, like an unreadable shard
        error = e
    agreement.agree(refusal, f"checking {path}", ckpt.device)
    if not ckpt.comm.any_rank(error is not None)[0]:  # the load is a collective: all ranks enter it, or none
        try:
            ckpt.load_shards(path, model, optimizer, tensors)
        except REFUSED as e:
            refusal = e
        except (Exception, CheckpointException) as e:  # torn or foreign files: all mean the same to the user
            error = e
        agreement.agree(refusal, f"loading {path}", ckpt.device)
    failed = agreement.first_error(first_cause(error) if error is not None else None, ckpt.device)
    if failed is None:
        return meta, ""
    defect = agreement.on_rank0(lambda: integrity_defect(path) or "", f"re-reading {path}", ckpt.device)
    if not defect:
        raise CheckpointError(
            f"checkpoint {path} could not be loaded ({failed}), but its files are intact on re-reading, so the "
            "error may pass: nothing was set aside; rerun to retry, or pass checkpoint.resume=<an older step_N> "
            "to go back past it"
        )
    return None, failed if defect in failed else f"{failed}; {defect}"  # the index check may have said it already


def _after_load(
    ckpt: Checkpointer,
    path: Path,
    meta: dict,
    decision: run_line.Decision,
    failures: list[tuple[Path, str]],
    start: run_line.Start,
) -> None:
    """Set aside what failed and what a new beginning supersedes (rank 0, agreed), announce a rollback, and carry
    the run line on."""
    step = int(meta["step"])

    def rename() -> str:
        moved = []
        for failed, reason in failures:
            aside = set_aside(failed, "unreadable")
            ckpt.log(f"[ckpt] {failed} is unreadable ({reason}); set aside as {aside.name}")
            moved.append(failed.name)
        if not decision.continues:  # a new beginning: newer checkpoints of the folder's previous run go aside
            newer = [p for p in complete_checkpoints(ckpt.root) if step_of(p) >= step and p.resolve() != path.resolve()]
            superseded = [set_aside(p, "superseded") for p in newer]
            if superseded:
                ckpt.log(
                    f"[ckpt] resumed from step {step}, older than {len(superseded)} checkpoint(s) of the folder's "
                    f"previous run; kept aside as {', '.join(p.name for p in superseded)}"
                )
                moved += [p.name for p in newer]
        if moved:
            fsync_path(ckpt.root)
        return json.dumps(moved)

    moved = json.loads(agreement.on_rank0(rename, f"setting checkpoints aside in {ckpt.root}", ckpt.device))
    ckpt.line = (
        meta.get("line") or {"start": "unknown", "from": "", "began": None, "job": None}
        if decision.continues
        else run_line.new_line(start, current_job())
    )
    if moved:
        newest = max(int(STEP_DIR.match(name).group(1)) for name in moved)
        why = "unreadable" if failures else "superseded by checkpoint.resume"
        ckpt.rollback = {"from_step": newest, "to_step": step, "reason": why, "checkpoint": str(path)}
        ckpt.log(f"[ckpt] ROLLBACK: resuming step {step}, not the newest step {newest} ({why}; set aside, not deleted)")
    _set_next_index(ckpt, meta)


def _set_next_index(ckpt: Checkpointer, meta: dict | None) -> None:
    """Continue the save counter (rank 0 writes shardlab.json; the others never read it)."""
    if ckpt.rank == 0:
        indices = [save_index(p) for p in complete_checkpoints(ckpt.root)]
        ckpt.next_index = max([0, *indices, (meta or {}).get("save_index", 0)]) + 1
