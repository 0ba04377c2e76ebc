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


def as_written(path: str | Path) -> str:
    """A path as the command gives it, made absolute (user expanded) but its symlinks kept: ``resume=latest``, a link
    someone moves on after the run began, still names the same setting on a requeue."""
    return str(Path(path).expanduser().absolute())


@dataclass(frozen=True)
class Start:
    """Where a run begins."""

    kind: str
    """scratch, checkpoint (checkpoint.resume=<path>) or weights (checkpoint.init_from)."""
    source: str = ""
    """The checkpoint folder or weights file (canonical path); empty from scratch."""
    written: str = field(default="", compare=False)
    """The same path as the command wrote it (``as_written``); empty from scratch or in lines recorded before."""

    def describe(self) -> str:
        return "from scratch" if self.kind == SCRATCH else f"from {self.kind} {self.source}"


def same_line(a: Start | None, b: Start | None) -> bool:
    """Whether two lines (a checkpoint's, or this command's start) are one run's: the same resolved source, or the
    same setting as written (a symlink resolved elsewhere since is still the setting the run began with). None: a
    checkpoint written before lines were recorded."""
    if a is None or b is None:
        return a is b
    return a.kind == b.kind and (a.source == b.source or bool(a.written and a.written == b.written))


UNREADABLE = "unreadable"
"""A checkpoint whose shardlab.json does not read says nothing of its line: it may be the run's own, torn."""


def start_of(resume: str, init_from: str | None) -> Start:
    """Where this command begins a run: an explicit resume path wins over init_from, which wins over scratch."""
    if resume not in ("auto", "none"):
        return Start(CHECKPOINT, canonical(resume), as_written(resume))
    if init_from:
        return Start(WEIGHTS, canonical(init_from), as_written(init_from))
    return Start(SCRATCH)


def line_of(meta: dict[str, Any] | None) -> Start | None:
    """Where the run that wrote a checkpoint began; None if it does not say (written before lines were recorded)."""
    line = (meta or {}).get("line")
    if not isinstance(line, dict) or "start" not in line:
        return None
    return Start(str(line["start"]), str(line.get("from", "")), str(line.get("as_written", "")))


def new_line(start: Start, job: str | None) -> dict[str, Any]:
    """The ``line`` record of a run that begins now: carried by each of its checkpoints, through every requeue."""
    return {
        "start": start.kind,
        "from": start.source,
        "as_written": start.written,
        "began": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "job": job,
    }


@dataclass
class Decision:
    """What a start does, decided by rank 0 and sent to every rank."""

    continues: bool
    """True: the folder's run goes on (its checkpoints, newest first, are the candidates)."""
    candidates: list[Path] = field(default_factory=list)
    """Checkpoints to try in order; empty: begin without one (scratch or init_from)."""
    note: str = ""
    """A line for the console when the setting alone would not tell the user what happened."""


def decide(resume: str, start: Start, existing: list[Path], lines: list[Start | None | str]) -> Decision:
    """Rank 0: continue or begin, for ``checkpoint.resume`` (auto, none or a path) and this command's ``start``.

    ``existing``: the folder's complete checkpoints, oldest first; ``lines``: where each one's run began (None: it
    does not say; UNREADABLE). A run that continues falls back only to its own checkpoints (and unreadable ones),
    never to an older run's left in the folder (keep_last, milestones)."""
    newest_line = next((line for line in lines[::-1] if line != UNREADABLE), None)
    own = [
        p
        for p, line in zip(existing[::-1], lines[::-1], strict=True)
        if line == UNREADABLE or same_line(line, newest_line)
    ]
    if not existing:
        return Decision(False, [Path(start.source)] if start.kind == CHECKPOINT else [])
    if resume == "auto":
        return Decision(True, own)
    if same_line(start, newest_line):
        setting = f"checkpoint.resume={resume}" + (f" (init_from {start.source})" if start.kind == WEIGHTS else "")
        return Decision(
            True,
            own,
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
