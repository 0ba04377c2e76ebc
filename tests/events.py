"""Read what a run logged: TensorBoard scalars (float32, exact to ~1e-7) and the run's train.log lines."""

from __future__ import annotations

import re
from pathlib import Path


def scalars(run_dir: Path, tag: str = "train/loss") -> list[tuple[int, float]]:
    """(step, value) of every event of ``tag`` in the run's TensorBoard files, in the order written."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = []
    for path in sorted((Path(run_dir) / "tensorboard").glob("events.out.tfevents.*")):
        acc = EventAccumulator(str(path), size_guidance={"scalars": 0})
        acc.Reload()
        if tag in acc.Tags()["scalars"]:
            events += [(e.step, e.value) for e in acc.Scalars(tag)]
    return events


def logged_steps(run_dir: Path, split: str = "train") -> list[int]:
    """Steps of the ``[split] step N`` lines in the run's train.log, in the order written (repeats included)."""
    text = (Path(run_dir) / "train.log").read_text()
    return [int(m) for m in re.findall(rf"\[{split}\] step (\d+) \|", text)]
