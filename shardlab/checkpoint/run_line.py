"""Where a run begins, and whether a start continues the run in its folder or begins a new one.

A requeue reruns the same command, so ``checkpoint.resume`` and ``checkpoint.init_from`` must mean the same on the
first start and on every requeue: they say where a run *begins*, never where a requeue goes back to. Every
checkpoint records where its run began (``line`` in shardlab.json), and at each start rank 0 compares that with where
this command begins:

- the folder's newest checkpoint belongs to a run that began where this command begins (at the same
  ``resume=<path>``, from the same ``init_from`` weights, or from scratch): this is the run's own progress, left by a
  requeue, a kill, or an earlier attempt of the same command. The run continues from its newest checkpoint.
- ``resume=auto``: continue whatever run the folder holds (the default).
- otherwise a new run begins: ``resume=<path>`` starts at that checkpoint (newer ones in the folder are set aside,
  never deleted); ``resume=none`` refuses the folder, since it holds a run that began elsewhere.

Nothing here depends on how the job was launched (Slurm, torchrun, local ranks) or on environment variables a
rerun by hand would not carry: a process learns that it continues a run from the run's own records in its folder.
Checkpoints written before lines were recorded have none; ``auto`` continues them, the other settings treat them as
another run's.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shardlab.errors import ConfigError

SCRATCH, CHECKPOINT, WEIGHTS = "scratch", "checkpoint", "weights"


def canonical(path: str | Path) -> str:
    """A path as runs record and compare it: absolute, user and symlinks expanded (it may no longer exist)."""
    return str(Path(path).expanduser().resolve())


@dataclass(frozen=True)
class Start:
    """Where a run begins."""

    kind: str
    """scratch, checkpoint (checkpoint.resume=<path>) or weights (checkpoint.init_from)."""
    source: str = ""
    """The checkpoint folder or weights file (canonical path); empty from scratch."""

    def describe(self) -> str:
        return "from scratch" if self.kind == SCRATCH else f"from {self.kind} {self.source}"


def start_of(resume: str, init_from: str | None) -> Start:
    """Where this command begins a run: an explicit resume path wins over init_from, which wins over scratch."""
    if resume not in ("auto", "none"):
        return Start(CHECKPOINT, canonical(resume))
    if init_from:
        return Start(WEIGHTS, canonical(init_from))
    return Start(SCRATCH)


def line_of(meta: dict[str, Any] | None) -> Start | None:
    """Where the run that wrote a checkpoint began; None if it does not say (written before lines were recorded)."""
    line = (meta or {}).get("line")
    if not isinstance(line, dict) or "start" not in line:
        return None
    return Start(str(line["start"]), str(line.get("from", "")))


def new_line(start: Start, job: str | None) -> dict[str, Any]:
    """The ``line`` record of a run that begins now: carried by each of its checkpoints, through every requeue."""
    return {"start": start.kind, "from": start.source, "began": time.strftime("%Y-%m-%dT%H:%M:%S"), "job": job}


@dataclass
class Decision:
    """What a start does, decided by rank 0 and sent to every rank."""

    continues: bool
    """True: the folder's run goes on (its checkpoints, newest first, are the candidates)."""
    candidates: list[Path] = field(default_factory=list)
    """Checkpoints to try in order; empty: begin without one (scratch or init_from)."""
    note: str = ""
    """A line for the console when the setting alone would not tell the user what happened."""


def decide(resume: str, start: Start, existing: list[Path], newest_line: Start | None) -> Decision:
    """Rank 0: continue or begin, for ``checkpoint.resume`` (auto, none or a path) and this command's ``start``.

    ``existing``: the folder's complete checkpoints, oldest first; ``newest_line``: where the run of the newest one
    (that says) began."""
    newest_first = existing[::-1]
    if not existing:
        return Decision(False, [Path(start.source)] if start.kind == CHECKPOINT else [])
    if resume == "auto":
        return Decision(True, newest_first)
    if newest_line == start:
        setting = f"checkpoint.resume={resume}" + (f" (init_from {start.source})" if start.kind == WEIGHTS else "")
        return Decision(
            True,
            newest_first,
            f"[ckpt] {setting}: the folder holds this run's own checkpoints (it began {start.describe()}); "
            f"continuing from {existing[-1].name}, as after a requeue",
        )
    if start.kind == CHECKPOINT:
        return Decision(False, [Path(start.source)])
    began = newest_line.describe() if newest_line else "before runs recorded where they began"
    raise ConfigError(
        f"checkpoint.resume=none but {existing[-1].parent} holds {existing[-1].name} of a run that began {began}, "
        f"not {start.describe()}; pass checkpoint.resume=auto to continue it, or hydra.run.dir=<new dir> for a new run"
    )
