"""The summary of a sweep: one row per point (overrides, status, steps, final metrics, wall time, error).

Rows come from each point's ``status.json`` (shardlab.jobs.run_record) and, for sweeps submitted through shardlab's
submitit launchers, from the ``sweep.json`` manifest they write at submission (so points that have not started yet,
or died without a word, are listed too). Printed and written as ``summary.json`` and ``summary.csv`` at the end of a
multirun, and rebuilt at any time by ``shardlab-sweep-summary <sweep dir>``.
"""

from __future__ import annotations

import csv
import math
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from shardlab.errors import ShardlabError, one_line
from shardlab.files.durable import write_json_atomic
from shardlab.files.regular_file import SMALL_FILE_MAX_BYTES, NotAFile, read_json_file
from shardlab.jobs import run_record

MANIFEST = "sweep.json"
COLUMNS = ("job", "overrides", "status", "step", "wall_s")


def write_manifest(sweep_dir: Path, jobs: list[dict[str, Any]]) -> None:
    """``jobs``: one dict per point with at least ``num``, ``overrides``, ``run_dir``; submitit adds ``job_id`` and
    ``log``. Merged with an existing manifest (a sweep submitted in several batches)."""
    path = sweep_dir / MANIFEST
    known = {j["num"]: j for j in read_manifest(path)}
    known.update({j["num"]: j for j in jobs})
    # whole or not at all: the submitter rewrites it while a summary or a waiting test may be reading it (a reader
    # saw it empty mid-write and failed to parse it)
    write_json_atomic(path, [known[k] for k in sorted(known)], indent=1)


def read_manifest(path: Path) -> list[dict[str, Any]]:
    """The jobs of a sweep's manifest ([] while none was written), through the one reader: a FIFO, a device or a link
    under its name, or a file that is not the list of jobs shardlab writes, is a ShardlabError naming it."""
    try:
        jobs = read_json_file(path, max_bytes=SMALL_FILE_MAX_BYTES)
    except FileNotFoundError:
        return []
    except (NotAFile, OSError, ValueError) as e:
        raise ShardlabError(f"{path} is not a sweep manifest shardlab can read ({one_line(e)}); delete it") from None
    if not isinstance(jobs, list) or not all(isinstance(j, dict) and "num" in j for j in jobs):
        raise ShardlabError(f"{path} is not the list of jobs a sweep manifest holds; delete it")
    return jobs


def _slurm_states(job_ids: list[str]) -> dict[str, str]:
    """Slurm's state of each job still known to it (squeue), or {} without Slurm."""
    if not job_ids or shutil.which("squeue") is None:
        return {}
    try:
        out = subprocess.run(
            ["squeue", "-h", "-t", "all", "-o", "%i|%T", "-j", ",".join(job_ids)],
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    return dict(line.split("|", 1) for line in out.split() if "|" in line)


def collect(sweep_dir: Path) -> list[dict[str, Any]]:
    """One row per point of the sweep in ``sweep_dir``, in job order."""
    sweep_dir = Path(sweep_dir)
    manifest = read_manifest(sweep_dir / MANIFEST)
    entries = {str(Path(j["run_dir"]).resolve()): j for j in manifest}
    for overrides_file in sorted(sweep_dir.glob("*/.hydra/overrides.yaml")):  # points of a local (basic) sweep
        run_dir = str(overrides_file.parent.parent.resolve())
        entries.setdefault(run_dir, {"num": None, "run_dir": run_dir})
    slurm = _slurm_states([str(j["job_id"]) for j in manifest if j.get("job_id")])
    rows = []
    for run_dir, entry in entries.items():
        status = run_record.read(Path(run_dir)) or {}
        row: dict[str, Any] = {
            "job": entry.get("job_id") or entry.get("num"),
            "num": entry.get("num"),
            "overrides": " ".join(status.get("overrides") or entry.get("overrides") or []),
            "status": status.get("status", "pending"),
            "step": status.get("step", 0),
            "max_steps": status.get("max_steps"),
            "wall_s": round(seconds, 1) if (seconds := run_record.run_seconds(status)) is not None else None,
            "final": status.get("final") or {},
            "error": status.get("error"),
            "run_dir": run_dir,
            "log": entry.get("log"),
        }
        state = slurm.get(str(entry.get("job_id")))
        if state and row["status"] in ("pending", "running"):
            row["status"] = "pending" if state in ("PENDING", "REQUEUED", "REQUEUE_HOLD") else row["status"]
            if state in ("CANCELLED", "FAILED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED", "BOOT_FAIL"):
                row["status"] = f"died ({state.lower()})"
        rows.append(row)
    rows.sort(key=lambda r: (r["num"] is None, r["num"] if r["num"] is not None else 0, r["run_dir"]))
    for i, row in enumerate(rows):
        if row["job"] is None:
            row["job"] = i
    return rows


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}" if math.isfinite(value) else str(value)
    return str(value)


def _metric_names(rows: list[dict[str, Any]]) -> list[str]:
    """Every final metric any point reported, the loss first."""
    return sorted({k for r in rows for k in r["final"]}, key=lambda k: (k != "loss", k))


def _step_cell(row: dict[str, Any]) -> str:
    return f"{row['step']}/{row['max_steps']}" if row["max_steps"] else str(row["step"])


def format_table(rows: list[dict[str, Any]]) -> str:
    """The rows as an aligned table; overrides shared by every point are listed once above it."""
    metrics = _metric_names(rows)
    split = [r["overrides"].split() for r in rows]
    common = [o for o in split[0] if all(o in s for s in split[1:])] if len(rows) > 1 else []
    rows = [
        {**r, "overrides": " ".join(o for o in s if o not in common) or "-"} for r, s in zip(rows, split, strict=True)
    ]
    header = [*COLUMNS, *metrics]
    body = [
        [_step_cell(r) if c == "step" else _cell(r[c]) for c in COLUMNS] + [_cell(r["final"].get(m)) for m in metrics]
        for r in rows
    ]
    widths = [max(len(h), *(len(line[i]) for line in body)) if body else len(h) for i, h in enumerate(header)]
    lines = [f"common overrides: {' '.join(common)}"] if common else []
    lines.append("  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)))
    lines += ["  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)) for line in body]
    for r in rows:
        if r["error"]:
            lines.append(f"job {r['job']} ({r['overrides']}) failed: {r['error']}")
    return "\n".join(lines)


def write_summary(sweep_dir: Path, rows: list[dict[str, Any]]) -> None:
    sweep_dir = Path(sweep_dir)
    write_json_atomic(sweep_dir / "summary.json", rows, indent=1)
    metrics = _metric_names(rows)
    with open(sweep_dir / "summary.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow([*COLUMNS, "max_steps", *metrics, "error", "run_dir"])
        for r in rows:
            writer.writerow(
                [
                    *(r[c] for c in COLUMNS),
                    r["max_steps"],
                    *(r["final"].get(m) for m in metrics),
                    r["error"],
                    r["run_dir"],
                ]
            )


def summarize(sweep_dir: Path) -> list[dict[str, Any]]:
    """Collect, print and write the summary of ``sweep_dir``; returns its rows."""
    rows = collect(sweep_dir)
    write_summary(sweep_dir, rows)
    print(f"\nsweep {sweep_dir} ({time.strftime('%Y-%m-%d %H:%M:%S')}):\n{format_table(rows)}", flush=True)
    print(f"written to {Path(sweep_dir) / 'summary.json'} and summary.csv", flush=True)
    return rows


class SweepSummary(Callback):
    """Hydra callback (conf/config.yaml): the summary table after every multirun, and exit code 1 when a point failed,
    died or was stopped before its end, so shells and CI see it although Hydra was told each point returned (a
    failed point must not stop the others). Points still pending or running (``wait: false``) are not failures."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        rows = summarize(Path(config.hydra.sweep.dir))
        if any(r["status"] not in ("completed", "pending", "running") for r in rows):  # failed, died, stopped
            raise SystemExit(1)
