"""shardlab_bench/max_model.py's parts that need no long run: the budget watcher's memory reading, the line it parses
from a run, and the ratios it reports. The measured figures are in docs/memory-plan.md."""

from __future__ import annotations

import subprocess
import sys

import pytest

from shardlab_bench import max_model


def test_the_watcher_sums_a_process_group_and_parses_the_trainers_memory_line():
    child = subprocess.Popen(
        [sys.executable, "-c", "import time; b = bytearray(200 * 2**20); time.sleep(30)"], start_new_session=True
    )
    try:
        for _ in range(100):
            if max_model.tree_pss(child.pid) > 150 * 2**20:
                break
            subprocess.run(["sleep", "0.05"])
        assert max_model.tree_pss(child.pid) > 150 * 2**20  # the 200 MiB the child touched
    finally:
        child.kill()
        child.wait()
    # The exact line shardlab.trainer logs at the end of a run.
    line = (
        "memory per rank (fullest rank): training-step peak 3.96 GiB (peak RSS above the rank's start), plan 3.85; "
        "held between steps 2.10 GiB, plan 2.05"
    )
    assert max_model.MEMORY_LINE.search(line).groups() == ("3.96", "3.85", "2.10", "2.05")


def test_summary_reports_the_largest_fit_and_its_ratio_to_ddp():
    runs = [
        {"layout": "ddp", "vary": "k", "k": 16, "params": 200e6, "prediction_error": -0.02},
        {"layout": "fully_sharded", "vary": "k", "k": 26, "params": 865e6, "prediction_error": 0.05},
        {"layout": "fully_sharded", "vary": "k", "k": 27, "params": 968e6},  # killed: no prediction error
    ]
    summary = max_model.summarize({"largest_k": {"ddp": 16, "fully_sharded": 26}, "runs": runs})
    assert summary["largest_model"]["fully_sharded"] == {"k": 26, "params": 865e6}
    assert summary["params_ratio_vs_ddp"]["fully_sharded"] == pytest.approx(4.325)
    assert summary["max_abs_prediction_error"] == pytest.approx(0.05)
    assert max_model.model_overrides(3, 64)[:3] == ["model.num_layers=3", "model.dim=192", "model.num_heads=3"]
