"""status.json in a run directory: what a run is doing or how it ended, for sweep summaries and the submitter.

Written by global rank 0 only, atomically (temp file + rename), at start, at every log line, and at the end; a job
that dies without a word (SIGKILL, node failure) is left "running" with its last update time, which
``shardlab-sweep-summary`` shows.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from shardlab.errors import ShardlabError
from shardlab.files.durable import write_json_atomic
from shardlab.files.regular_file import read_json_or_none, read_regular

STATUS_FILE = "status.json"


STATUS_MAX_BYTES = 16 * 2**20
"""A status.json larger than this is no status (its largest field, the overrides, is a command line)."""


def read(run_dir: Path) -> dict[str, Any] | None:
    """The run's status, or None if it has none or it is unreadable: only a regular file of the run folder is read
    (not a link, a FIFO or a device), at most STATUS_MAX_BYTES of it."""
    try:
        status = json.loads(read_regular(Path(run_dir) / STATUS_FILE, max_bytes=STATUS_MAX_BYTES))
    except (OSError, ShardlabError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    return status if isinstance(status, dict) else None


def update(run_dir: Path, **fields: Any) -> dict[str, Any]:
    """Merge ``fields`` into the run's status and write it atomically; returns the new status."""
    run_dir = Path(run_dir)
    status = read(run_dir) or {}
    status.update(fields, updated=time.time())
    run_dir.mkdir(parents=True, exist_ok=True)
    write_json_atomic(run_dir / STATUS_FILE, status, indent=1)
    return status


def run_seconds(status: dict[str, Any]) -> float | None:
    """How long the run has run, over all its starts (a rerun, a requeue), without the time between them (a run
    rerun the next day ran minutes, not a day); None before its first start."""
    if "started" not in status or "updated" not in status:
        return None
    this_start = status.get("attempt_started", status["started"])  # status files before attempt_started: one start
    return status.get("run_s_before", 0.0) + max(0.0, status["updated"] - this_start)


def start(run_dir: Path, overrides: list[str], max_steps: int) -> None:
    restarts = int(os.environ.get("SLURM_RESTART_COUNT", 0))
    previous = read(run_dir) or {}
    now = time.time()
    update(
        run_dir,
        status="running",
        overrides=overrides,
        max_steps=max_steps,
        job_id=os.environ.get("SLURM_JOB_ID") or os.environ.get("SUBMITIT_LOCAL_JOB_ID"),
        restarts=restarts,
        started=previous.get("started", now),  # its first start
        attempt_started=now,
        run_s_before=run_seconds(previous) or 0.0,  # what the earlier starts ran (run_seconds)
        error=None,
    )


def finish(run_dir: Path, result: dict[str, Any]) -> None:
    stopped_by = result.get("stopped_by")
    update(
        run_dir,
        status="stopped" if stopped_by else "completed",
        stopped_by=stopped_by,
        final=result.get("final") or {},
        memory=result.get("memory") or {},  # measured and planned GiB per rank (shardlab.trainer)
    )


def fail(run_dir: Path, error: str) -> None:
    update(run_dir, status="failed", error=error)


# ---- which rank failed first -----------------------------------------------------------------------------------------
# When one rank of a multi-process job fails (its own error), the others fail after it in a collective (a timeout, a
# closed connection). Rank 0 writes status.json, so each other rank leaves a note of its error and rank 0 reports the
# first one, not its own consequence of it (launchers that surface a child's error, like shardlab's local ranks,
# report it already).
RANK_ERRORS = ".rank_errors"
PROCESS_STARTED = time.time()
"""About when this process started (this module is imported at start-up): notes of ranks that started before this
attempt are ignored."""
SKEW_S = 10.0
"""How much earlier than rank 0 another rank of the same attempt may have started."""


_NOTED: set[tuple[str, int]] = set()
"""(run dir, rank) this process has left a note for: its first note (the trainer's, at the error) keeps its time when
the same error passes run_job on its way out, so a consequence on another rank cannot look earlier."""


def note_rank_error(run_dir: Path, rank: int, error: str) -> None:
    """Leave this rank's failure for rank 0 to report, once per process (best effort: a rank that cannot write says
    nothing)."""
    if (str(run_dir), rank) in _NOTED:
        return
    _NOTED.add((str(run_dir), rank))
    try:
        folder = Path(run_dir) / RANK_ERRORS
        folder.mkdir(parents=True, exist_ok=True)
        note = {"rank": rank, "error": error, "time": time.time(), "started": PROCESS_STARTED}
        write_json_atomic(folder / f"rank{rank}.json", note)
    except OSError:
        pass


def first_rank_error(run_dir: Path, wait_s: float = 3.0) -> dict[str, Any] | None:
    """The earliest note of this attempt's other ranks, waiting up to ``wait_s`` for one to arrive (a rank whose
    error made this one fail may still be writing it)."""
    deadline = time.monotonic() + wait_s
    while True:
        notes = []
        for path in (Path(run_dir) / RANK_ERRORS).glob("rank*.json"):
            note = read_json_or_none(path)
            if not isinstance(note, dict):
                continue
            # A rank of this attempt started about when this one did. Its time of failure would not tell: torchrun
            # restarts the workers within seconds of the last attempt's notes. (Notes without "started": older code.)
            if note.get("started", note.get("time", 0)) >= PROCESS_STARTED - SKEW_S:
                notes.append(note)
        if notes or time.monotonic() >= deadline:
            return min(notes, key=lambda n: n["time"]) if notes else None
        time.sleep(0.2)


def fail_with_first_cause(run_dir: Path, error: str, world_size: int, wait_s: float = 3.0) -> str:
    """``fail`` with another rank's earlier error first where one left a note; returns what was recorded."""
    first = first_rank_error(run_dir, wait_s) if world_size > 1 else None
    if first is not None and first["error"] != error:  # the same error everywhere (a bad input) is said once
        error = f"rank {first['rank']} failed first: {first['error']} (rank 0: {error})"
    fail(run_dir, error)
    return error
