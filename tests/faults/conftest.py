"""The fault matrix's results: with ``SHARDLAB_FAULT_MATRIX_OUT=<file.json>`` each cell's outcome is merged into that
file as soon as the cell ends (so a partial run, or a run of some cells, updates what the file held), for
shardlab_bench/fault_matrix.py to render."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from shardlab.files.durable import write_json_atomic
from tests.slurm.conftest import multi_node_env, slurm_env  # noqa: F401  (the Slurm cells share its cluster)


def record_cell(outcome: dict) -> None:
    out = os.environ.get("SHARDLAB_FAULT_MATRIX_OUT")
    if not out:
        return
    path = Path(out)
    cells = {}
    if path.is_file():
        cells = {(c["layout"], c["event"], c["resume"]): c for c in json.loads(path.read_text())["cells"]}
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    cells[(outcome["layout"], outcome["event"], outcome["resume"])] = {**outcome, "commit": commit}
    ordered = sorted(cells.values(), key=lambda c: (c["layout"], c["event"], c["resume"]))
    write_json_atomic(path, {"commit": commit, "cells": ordered}, indent=1)
