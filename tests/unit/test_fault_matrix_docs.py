"""The fault matrix's pages say what its JSON holds: docs/fault-matrix.md and the README's summary are what
shardlab_bench/fault_matrix.py renders from docs/fault_matrix.json (rerun it after a run of the matrix)."""

from __future__ import annotations

import json

from shardlab_bench import fault_matrix
from tests.conftest import ROOT


def test_the_fault_matrix_page_and_the_readme_summary_are_rendered_from_the_json():
    results = json.loads((ROOT / "docs" / "fault_matrix.json").read_text())
    fix = "python -m shardlab_bench fault_matrix docs/fault_matrix.json --out docs/fault-matrix.md --readme README.md"
    assert (ROOT / "docs" / "fault-matrix.md").read_text() == fault_matrix.render(results), f"stale: run {fix}"
    block = fault_matrix.README_BLOCK.search((ROOT / "README.md").read_text())
    assert block is not None and block[0] == block[1] + fault_matrix.summary(results) + block[2], f"stale: run {fix}"


def test_a_failed_or_missing_cell_shows_in_both():
    results = {
        "commit": "abc",
        "cells": [
            {"layout": "local", "event": "usr2", "resume": "auto", "passed": False, "first_attempt": "hung"},
            {"layout": "local", "event": "usr2", "resume": "path", "passed": True, "first_attempt": "stopped"},
        ],
    }
    row = next(line for line in fault_matrix.summary(results).splitlines() if line.startswith("| SIGUSR2"))
    assert row.split(" | ")[1] == "FAIL / pass / - / -"
    page = fault_matrix.render(results)
    assert "**FAIL**: hung" in page and "1 of 2 cells run passed" in page
