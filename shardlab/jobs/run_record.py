"""status.json in a run directory: what a run is doing or how it ended, for sweep summaries and the submitter.

Written by global rank 0 only, atomically (temp file + rename), at start, at every log line, and at the end; a job
that dies without a word (SIGKILL, node failure) is left "running" with its last update time, which
``tools/sweep_summary.py`` shows.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

STATUS_FILE = "status.json"


def read(run_dir: Path) -> dict[str, Any] | None:
    try:
        return json.loads((Path(run_dir) / STATUS_FILE).read_text())
    except (OSError, json.JSONDecodeError):
        return None


def update(run_dir: Path, **fields: Any) -> dict[str, Any]:
    """Merge ``fields`` into the run's status and write it atomically; returns the new status."""
    run_dir = Path(run_dir)
    status = read(run_dir) or {}
    status.update(fields, updated=time.time())
    run_dir.mkdir(parents=True, exist_ok=True)
    tmp = run_dir / f".{STATUS_FILE}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(status, indent=1))
    os.replace(tmp, run_dir / STATUS_FILE)
    return status


def start(run_dir: Path, overrides: list[str], max_steps: int) -> None:
    restarts = int(os.environ.get("SLURM_RESTART_COUNT", 0))
    previous = read(run_dir) or {}
    update(
        run_dir,
        status="running",
        overrides=overrides,
        max_steps=max_steps,
        job_id=os.environ.get("SLURM_JOB_ID") or os.environ.get("SUBMITIT_LOCAL_JOB_ID"),
        restarts=restarts,
        started=previous.get("started", time.time()),  # the wall time of a requeued run counts from its first start
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
