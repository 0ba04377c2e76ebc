"""Learning curves of several runs or sweep points in one PNG, read from the runs' own train.log.

    shardlab-plot runs/lm/default runs/lm/optimizer.lr=1e-3 --out curves.png
    shardlab-plot multirun/lm/optimizer.lr=1e-3,3e-3               # a sweep folder: each of its points
    shardlab-sweep-summary multirun/lm/optimizer.lr=1e-3,3e-3 --plot curves.png   # the same, with the table

Four panels: training loss (top) and validation loss (bottom), against the optimizer step (left) and against the
tokens seen (right; samples for tasks without data.seq_len: step x optimization.batch_size x update_freq
[x data.seq_len], from the run's .hydra/config.yaml). A loss axis is logarithmic when the curves span more than 3x,
a step or token axis when it spans more than two decades. Each run is labelled by the overrides that differ between
the runs (.hydra/overrides.yaml); the overrides they share that name the experiment are the title. A run that was
resumed logs the steps after its checkpoint twice; the later lines win, as TensorBoard's purge does. Needs matplotlib
(pip install -e '.[plot]').
"""

from __future__ import annotations

import argparse
import re
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

from shardlab.cli.run_names import names_the_run
from shardlab.errors import ConfigError, DataError
from shardlab.files.regular_file import SMALL_FILE_MAX_BYTES, read_regular
from shardlab.jobs.sweep import collect
from shardlab.logging import LOG_FILE

LINE = re.compile(r"\[(?P<split>train|valid)\] step (?P<step>\d+) \| (?P<metrics>.*)$")
"""A metrics line as shardlab.logging.RunLogger.log writes it (after the time stamp): [split] step N | k v | k v."""
LOG_SPAN_LOSS = 3.0
LOG_SPAN_X = 100.0


@dataclass
class Curves:
    run_dir: Path
    overrides: list[str]
    unit: str
    """What the right-hand panels count: tokens (a task with data.seq_len) or samples."""
    per_step: int | None
    """Tokens (or samples) per optimizer step; None when the run's config is gone."""
    loss: dict[str, dict[int, float]] = field(default_factory=lambda: {"train": {}, "valid": {}})
    """split -> step -> loss."""
    label: str = ""


LOG_MAX_BYTES = 1 << 32
"""The largest train.log read (4 GiB, some 40 million log lines): a run folder's files are read as files, through
shardlab's one reader (no FIFO, device or link; bounded)."""


def read_log(path: Path) -> dict[str, dict[int, float]]:
    """split -> step -> loss from a train.log. A resumed run trains the steps after its checkpoint again: a line for
    a step at or below one already read drops every later step of that split (the first attempt's tail)."""
    curves: dict[str, dict[int, float]] = {"train": {}, "valid": {}}
    for line in read_regular(path, max_bytes=LOG_MAX_BYTES).decode(errors="replace").splitlines():
        m = LINE.search(line)
        if not m:
            continue
        metrics = dict(part.split(" ", 1) for part in m["metrics"].split(" | ") if " " in part)
        try:
            loss = float(metrics["loss"])
        except (KeyError, ValueError):
            continue
        split, step = curves[m["split"]], int(m["step"])
        for later in [s for s in split if s >= step]:
            del split[later]
        split[step] = loss
    return curves


def _overrides(run_dir: Path) -> list[str]:
    path = run_dir / ".hydra" / "overrides.yaml"
    if not path.is_file():
        return []
    import yaml

    return [str(o) for o in yaml.safe_load(read_regular(path, max_bytes=SMALL_FILE_MAX_BYTES)) or []]


def _per_step(run_dir: Path) -> tuple[str, int | None]:
    """(unit, units per optimizer step) from the run's composed config."""
    path = run_dir / ".hydra" / "config.yaml"
    if not path.is_file():
        return "tokens", None
    import yaml

    cfg = yaml.safe_load(read_regular(path, max_bytes=SMALL_FILE_MAX_BYTES)) or {}
    o, data = cfg.get("optimization") or {}, cfg.get("data") or {}
    samples = int(o.get("batch_size", 0)) * int(o.get("update_freq", 1) or 1)
    return ("tokens", samples * int(data["seq_len"])) if data.get("seq_len") else ("samples", samples)


def find_runs(paths: list[Path]) -> list[Path]:
    """Run folders (holding train.log) from the arguments: a run folder itself, or a sweep folder's points."""
    runs: list[Path] = []
    for path in paths:
        if (path / LOG_FILE).is_file():
            runs.append(path)
            continue
        if not path.is_dir():
            raise ConfigError(f"{path} is not a directory; give run folders (with {LOG_FILE}) or a sweep folder")
        # A sweep: its points in job order, as shardlab-sweep-summary lists them (a Slurm sweep's manifest too).
        points = [Path(row["run_dir"]) for row in collect(path) if (Path(row["run_dir"]) / LOG_FILE).is_file()]
        if not points:
            raise DataError(f"{path} holds no {LOG_FILE}, nor do its sweep points: has the run (or sweep) started?")
        runs += points
    return list(dict.fromkeys(runs))


def load(run_dirs: list[Path]) -> tuple[list[Curves], list[str]]:
    """Each run's curves, labelled by the overrides that differ between the runs; and the overrides all share."""
    runs = []
    for run_dir in run_dirs:
        unit, per_step = _per_step(run_dir)
        runs.append(Curves(run_dir, _overrides(run_dir), unit, per_step, read_log(run_dir / LOG_FILE)))
    shared = [o for o in runs[0].overrides if all(o in r.overrides for r in runs[1:])] if len(runs) > 1 else []
    for r in runs:
        r.label = " ".join(o for o in r.overrides if o not in shared) or r.run_dir.name
    labels = [r.label for r in runs]
    for r in runs:  # two runs with the same overrides (the same command in two folders): the folder tells them apart
        if labels.count(r.label) > 1:
            r.label = f"{r.label} ({r.run_dir.name})"
    return runs, shared


def _log_if_wide(ax, axis: str, values: list[float], span: float) -> None:
    positive = [v for v in values if v > 0]
    if positive and len(positive) == len(values) and max(positive) / min(positive) > span:
        (ax.set_xscale if axis == "x" else ax.set_yscale)("log")


def draw(runs: list[Curves], shared: list[str], out: Path):
    """The four-panel figure, saved to ``out``; returns it (tests read its lines and legend)."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # a file, never a window: runs on login nodes and in CI
        import matplotlib.pyplot as plt
    except ImportError:
        raise ConfigError("shardlab-plot needs matplotlib, which is not installed: pip install -e '.[plot]'") from None
    units = {r.unit for r in runs}
    unit = units.pop() if len(units) == 1 else "tokens or samples"
    fig, axes = plt.subplots(2, 2, figsize=(12, 8), sharex="col", sharey="row")
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for row, split in enumerate(("train", "valid")):
        losses = []
        for i, r in enumerate(runs):
            steps = sorted(r.loss[split])
            ys = [r.loss[split][s] for s in steps]
            losses += ys
            style = {"color": colors[i % len(colors)], "label": r.label, "marker": "o" if split == "valid" else None}
            style["markersize"] = 3
            axes[row, 0].plot(steps, ys, **style)
            if r.per_step is not None:
                axes[row, 1].plot([s * r.per_step for s in steps], ys, **style)
        name = "training" if split == "train" else "validation"
        axes[row, 0].set_ylabel(f"{name} loss")
        _log_if_wide(axes[row, 0], "y", losses, LOG_SPAN_LOSS)
    for col, xlabel in enumerate(("step", unit)):
        axes[1, col].set_xlabel(xlabel)
        for ax in axes[:, col]:
            ax.grid(True, which="both", alpha=0.3)
        xs = [x for ax in axes[:, col] for line in ax.get_lines() for x in line.get_xdata()]
        _log_if_wide(axes[1, col], "x", xs, LOG_SPAN_X)  # shared by the column: train and valid on one scale
    axes[0, 0].set_title("against the optimizer step")
    axes[0, 1].set_title(f"against the {unit} seen")
    axes[0, 0].legend(fontsize=8, title="runs", title_fontsize=8)
    # Above the panels: the shared overrides that define the experiment (not logging.*, checkpoint.*, data.cache_dir
    # and the other keys that do not name a run directory), wrapped: a sweep's run to hundreds of characters.
    shared = [o for o in shared if names_the_run(o.split("=", 1)[0].lstrip("+~"))]
    if shared:
        fig.suptitle(textwrap.fill("common: " + " ".join(shared), width=170, break_on_hyphens=False), fontsize=8)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    return fig


def plot_runs(paths: list[Path], out: Path):
    """Draw the runs (or sweeps' points) under ``paths`` into ``out``; returns the figure."""
    runs, shared = load(find_runs(paths))
    empty = [str(r.run_dir) for r in runs if not r.loss["train"] and not r.loss["valid"]]
    if len(empty) == len(runs):
        raise DataError(f"no loss lines in the {LOG_FILE} of {', '.join(empty)}: nothing logged yet")
    return draw(runs, shared, out)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", type=Path, help="run folders, or sweep folders (each of their points)")
    parser.add_argument("--out", type=Path, default=Path("curves.png"), help="the PNG to write (curves.png)")
    args = parser.parse_args(argv)
    fig = plot_runs(args.runs, args.out)
    print(f"{args.out}: {len(fig.axes[0].get_lines())} runs")


def cli() -> None:
    """The console script (pyproject.toml's [project.scripts]): a mistake is one line and exit code 2."""
    from shardlab.train import run_tool

    run_tool(main)


if __name__ == "__main__":
    cli()
