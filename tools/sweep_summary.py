"""The summary table of a sweep, rebuilt from its directory: for a sweep that ran (or still runs) on Slurm, or a local
one whose terminal is gone.

    python tools/sweep_summary.py multirun/lm/optimizer.lr=1e-3,3e-3
    python tools/sweep_summary.py <sweep dir> --json      # the rows as JSON on stdout

One row per point: overrides, status (pending, running, completed, stopped, failed, died (<Slurm state>)), step
reached, wall time, final validation metrics, and for a failed point its one-line error. Also written to
<sweep dir>/summary.json and summary.csv.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from shardlab.errors import ConfigError
from shardlab.jobs.sweep import collect, summarize
from shardlab.train import run_tool


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sweep_dir", type=Path, help="the sweep's directory (hydra.sweep.dir)")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON instead of a table")
    args = parser.parse_args()
    if not args.sweep_dir.is_dir():
        raise ConfigError(
            f"{args.sweep_dir} is not a directory; give the sweep's hydra.sweep.dir "
            "(e.g. multirun/lm/optimizer.lr=1e-3,3e-3)"
        )
    if args.json:
        print(json.dumps(collect(args.sweep_dir), indent=1))
        return
    if not summarize(args.sweep_dir):
        raise ConfigError(f"{args.sweep_dir} holds no sweep points (no sweep.json, no */.hydra/overrides.yaml)")


if __name__ == "__main__":
    run_tool(main)
