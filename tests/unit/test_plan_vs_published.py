"""shardlab_bench/plan_vs_published.py: the table of the plan against published GPU measurements in docs/memory-plan.md
holds what the plan gives now, and every published figure names where it was published."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shardlab_bench import plan_vs_published

REPO = Path(__file__).resolve().parents[2]

JSON = REPO / "docs" / "bench" / "plan_vs_published.json"
STALE = (
    "the plan changed since docs/bench/plan_vs_published.json was written: "
    "run python -m shardlab_bench plan_vs_published"
)


def recorded() -> dict[str, dict]:
    return {r["key"]: r for r in json.loads(JSON.read_text())["rows"]}


def replanned(key: str) -> dict:
    published = next(p for p in plan_vs_published.PUBLISHED if p["key"] == key)
    return plan_vs_published.plan(published)


def test_the_table_holds_the_plan_of_todays_code_for_a_published_run():
    """Table 1's eager run (8 H100s, 2 x 8192, selective op), planned again: both plans equal the JSON's to the byte,
    so a change to the plan cannot leave the docs' table behind (every row: the slow test below)."""
    row, now = recorded()["t1_fsdp"], replanned("t1_fsdp")
    assert now["overrides"] == row["overrides"]
    assert (
        "distributed.ac_matmul_save_every=2" in now["overrides"]
        and "distributed.ac_skip_units=[0,-1]" in row["overrides"]
    )
    assert now["plan"] == row["plan"], STALE
    assert now["mode_defaults"] == row["mode_defaults"], STALE
    # torchtitan keeps fewer matmul outputs and leaves the head unwrapped: its plan is lower, the state the same.
    assert now["plan"]["activation_bytes"] < now["mode_defaults"]["activation_bytes"]
    assert now["plan"]["state_bytes"] == now["mode_defaults"]["state_bytes"]


@pytest.mark.slow
def test_every_row_of_the_table_holds_the_plan_of_todays_code():
    rows = recorded()
    assert set(rows) == {p["key"] for p in plan_vs_published.PUBLISHED}
    for row in plan_vs_published.run(plan_vs_published.PUBLISHED):
        assert {k: row[k] for k in ("plan", "mode_defaults")} == {
            k: rows[row["key"]][k] for k in ("plan", "mode_defaults")
        }, f"{row['key']}: {STALE}"


def test_every_published_figure_cites_its_file_commit_table_and_row():
    for p in plan_vs_published.PUBLISHED:
        src = p["source"]
        assert src["commit"] in src["url"] and src["url"].endswith(src["file"]), p["key"]
        assert src["table"] and src["row"] and src["run"], p["key"]
        assert p["published_gib"] > 0 and "reserved" in p["measures"]
