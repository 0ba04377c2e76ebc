"""The docs' lines that submit to Slurm (hydra/launcher=slurm), run as written on the test cluster (issue #51): the
walk of tests/doc_walk.py (each run shortened to optimization.max_steps=1, said on its printed line), each line
from a fresh working folder, a line naming ``hydra.launcher.partition=multi`` on the cluster's two hosts. A sweep
must finish with every point completed; one submitted with ``hydra.launcher.wait=false`` must say it submitted its
jobs, and is then followed to its end with shardlab-sweep-summary. Lines the test cluster cannot take (GPUs, 32
ranks, 64 preprocessing tasks) are marked ``# not checked: KIND`` in the docs and listed by
tests/unit/test_docs_commands.py; docs/tutorial.md's Slurm line runs in test_tutorial_slurm.py."""

from __future__ import annotations

import json
import subprocess
import time

import pytest

from tests.distributed.test_docs_pages_run import PAGES, new_walk, on_slurm, page_lines, skipped_why

pytestmark = [pytest.mark.slurm, pytest.mark.slow]


def slurm_lines() -> list[tuple[str, str]]:
    """(page, line) of every Slurm line of PAGES not marked not checked."""
    return [(page, line) for page in PAGES for line in page_lines(page) if on_slurm(line) and "not checked" not in (
        skipped_why(line) or "")]  # fmt: skip


@pytest.mark.parametrize(("page", "line"), slurm_lines(), ids=lambda x: x[:60])
def test_the_slurm_line_runs_on_the_test_cluster(page, line, request, tmp_path, monkeypatch):
    env = request.getfixturevalue("multi_node_env" if "partition=multi" in line else "slurm_env")
    walk = new_walk(tmp_path)
    walk.env = {**env, "HOME": walk.env["HOME"]}
    monkeypatch.setenv("HOME", walk.env["HOME"])
    ((_, proc),) = walk.run(line)
    if "hydra.launcher.wait=false" in line:
        assert "not waiting (wait=false)" in proc.stdout, proc.stdout[-2000:]
        (summary_dir,) = {p.parent for p in walk.cwd.glob("multirun/*/*/sweep.json")}
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            argv = walk.argv(["shardlab-sweep-summary", str(summary_dir), "--json"])
            rows = subprocess.run(argv, cwd=walk.cwd, env=walk.env, capture_output=True, text=True, check=True).stdout
            if all(r["status"] == "completed" for r in json.loads(rows)):
                break
            time.sleep(10)
        else:
            raise AssertionError(f"{line}: its jobs did not complete in 10 minutes")


def test_the_slurm_lines_are_few_and_found():
    lines = slurm_lines()
    assert 1 <= len(lines) <= 6, lines
    assert all("hydra/launcher=slurm" in line for _, line in lines), lines
