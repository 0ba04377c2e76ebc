"""docs/tutorial.md's Slurm command, run as written on the test cluster: both plug-ins of examples/my_research as a job
array, 2 Slurm tasks (ranks) per job, each job importing the user_dir from its recorded path; every point must
reproduce a one-process run of the same plug-in."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from shardlab.distributed import env as dist_env
from shardlab.runner import run_rank
from tests.conftest import compose_config
from tests.distributed.test_tutorial import on_slurm, run_command, tutorial_commands
from tests.events import scalars

# Slow (~55 s on 2 cores): the tutorial's commands run in CI's e2e pass in test_tutorial.py, and Slurm
# sweeps in tests/slurm/test_slurm.py.
pytestmark = [pytest.mark.slurm, pytest.mark.slow]


def one_process(research_root: Path, corpus_cache: str, task: str, run_dir: Path) -> dict:
    overrides = [f"user_dir={research_root / 'examples' / 'my_research'}", f"task={task}"]
    if task == "gated_conv_lm":
        overrides.append(f"data.cache_dir={corpus_cache}")  # where the corpus is cached changes no number
    return run_rank(compose_config(overrides), run_dir, dist_env.detect())


def test_the_tutorial_sweep_on_slurm_matches_one_process_runs(slurm_env, research_root, corpus_cache, tmp_path):
    (command,) = [c for c in tutorial_commands() if on_slurm(c)]
    proc = run_command(command, research_root, slurm_env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (manifest,) = research_root.glob("multirun/*/*/sweep.json")
    jobs = json.loads(manifest.read_text())
    assert len(jobs) == 2 and len({j["job_id"].split("_")[0] for j in jobs}) == 1  # one array
    for job in jobs:
        task = next(o.split("=")[1] for o in job["overrides"] if o.startswith("task="))
        assert "world size 2 (slurm)" in Path(job["log"]).read_text()
        expected = one_process(research_root, corpus_cache, task, tmp_path / task)["history"]
        for split in ("train", "valid"):
            got = scalars(research_root / job["run_dir"], f"{split}/loss")  # relative to the submitting directory
            want = [(r["step"], r["loss"]) for r in expected if r["split"] == split]
            assert [s for s, _ in got] == [s for s, _ in want] and got, (task, split)
            torch.testing.assert_close(
                torch.tensor([v for _, v in got], dtype=torch.float64),
                torch.tensor([v for _, v in want], dtype=torch.float64),
                rtol=1e-5,
                atol=0,
            )
