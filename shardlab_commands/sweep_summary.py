"""The summary table of a sweep, rebuilt from its directory: for a sweep that ran (or still runs) on Slurm, or a local
one whose terminal is gone.

    shardlab-sweep-summary multirun/lm/optimizer.lr=1e-3,3e-3
    shardlab-sweep-summary <sweep dir> --json      # the rows as JSON on stdout
    shardlab-sweep-summary <sweep dir> --plot curves.png   # and every point's learning curves in one PNG

One row per point: overrides, status (pending, running, completed, stopped, failed, died (<Slurm state>)), step
reached, wall time, final validation metrics, and for a failed point its one-line error. Also written to
<sweep dir>/summary.json and summary.csv. --plot draws what shardlab-plot draws for the points that have logged.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from shardlab.errors import ConfigError
from shardlab.jobs.sweep import collect, summarize
from shardlab.train import run_tool


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sweep_dir", type=Path, help="the sweep's directory (hydra.sweep.dir)")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON instead of a table")
    parser.add_argument("--plot", type=Path, metavar="OUT.png", help="also draw the points' learning curves there")
    args = parser.parse_args(argv)
    if not args.sweep_dir.is_dir():
        raise ConfigError(
            f"{args.sweep_dir} is not a directory; give the sweep's hydra.sweep.dir "
            "(e.g. multirun/lm/optimizer.lr=1e-3,3e-3)"
        )
    if args.json:
        print(json.dumps(collect(args.sweep_dir), indent=1))
    elif not summarize(args.sweep_dir):
        raise ConfigError(f"{args.sweep_dir} holds no sweep points (no sweep.json, no */.hydra/overrides.yaml)")
    if args.plot:
        from shardlab_commands.plot import plot_runs

        fig = plot_runs([args.sweep_dir], args.plot)
        print(f"{args.plot}: learning curves of {len(fig.axes[0].get_lines())} points", file=sys.stderr)


def cli() -> None:
    """The console script (pyproject.toml's [project.scripts]): a mistake is one line and exit code 2."""
    run_tool(main)


if __name__ == "__main__":
    cli()
