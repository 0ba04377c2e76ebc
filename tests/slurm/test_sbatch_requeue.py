"""Slurm jobs that submitit does not run are requeued too: a batch script whose ranks are started by torchrun, or by
srun with one task per rank, gets the time-limit warning (USR2), saves at the step it arrived in, and global rank 0
requeues the job with `scontrol requeue`; the requeued job resumes exactly there and ends with an uninterrupted run's
losses."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from shardlab.distributed import env as dist_env
from shardlab.jobs import run_record
from shardlab.runner import run_rank
from tests.conftest import TINY_LM
from tests.events import scalars
from tests.faults.test_fault_matrix import FAULT_STEP, MAX_STEPS, RUN, SITE, TWO_RANKS
from tests.slurm.test_slurm import slurm_state, start_requeued_job_now, wait_for

pytestmark = pytest.mark.slurm
ROOT = Path(__file__).resolve().parents[2]

SCRIPTS = {
    "torchrun": """#!/bin/bash
#SBATCH --ntasks=1 --cpus-per-task=2 --requeue --open-mode=append
# torchrun's agent must pass USR2 on to its workers, not die of it.
srun {python} -m torch.distributed.run --signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR2 --nproc_per_node=2 \\
    --master_port=$((20000 + SLURM_JOB_ID % 20000)) -m shardlab.train {overrides}
""",
    "srun_tasks": """#!/bin/bash
#SBATCH --ntasks=2 --cpus-per-task=1 --requeue --open-mode=append
srun {python} -m shardlab.train {overrides}
""",
}


@pytest.fixture(scope="module")
def uninterrupted(tiny_lm, tmp_path_factory) -> dict[int, float]:
    result = run_rank(tiny_lm(*RUN[len(TINY_LM) :]), tmp_path_factory.mktemp("sbatch_ref"), dist_env.detect())
    return {r["step"]: r["loss"] for r in result["history"] if r["split"] == "train"}


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["torchrun", "srun_tasks"], ids=["torchrun", "srun-tasks"])
def test_a_batch_job_without_submitit_is_requeued_at_the_time_limit_warning(
    layout, slurm_env, corpus_cache, tmp_path, uninterrupted
):
    run_dir, fault_dir = tmp_path / "run", tmp_path / "fault"
    fault_dir.mkdir()
    overrides = [*RUN, f"data.cache_dir={corpus_cache}", *TWO_RANKS, f"hydra.run.dir={run_dir}"]
    script = tmp_path / "job.sh"
    script.write_text(SCRIPTS[layout].format(python=sys.executable, overrides=" ".join(overrides)))
    fault = {"event": "pause", "rank": 0, "step": FAULT_STEP, "dir": str(fault_dir)}
    env = {**slurm_env, "PYTHONPATH": f"{SITE}:{ROOT}", "SHARDLAB_FAULT": json.dumps(fault)}
    submitted = subprocess.run(
        ["sbatch", "--parsable", f"--chdir={ROOT}", f"--output={tmp_path}/slurm-%j.out", str(script)],
        env=env, capture_output=True, text=True, check=True,
    )  # fmt: skip
    job_id = submitted.stdout.strip().split(";")[0]
    log = lambda: (tmp_path / f"slurm-{job_id}.out").read_text()  # noqa: E731
    try:
        wait_for(lambda: (fault_dir / "paused").is_file(), 300, "step 7")
        subprocess.run(["scancel", f"--signal={signal.SIGUSR2.name[3:]}", job_id], env=env, check=True)
        start_requeued_job_now(env, job_id)
        wait_for(lambda: slurm_state(env, job_id) in ("COMPLETED", "FAILED", "CANCELLED"), 600, "the job's end")
    finally:
        subprocess.run(["scancel", job_id], env=env, capture_output=True)
    assert slurm_state(env, job_id) == "COMPLETED", log()[-3000:]
    train_log = (run_dir / "train.log").read_text()
    assert f"requeued Slurm job {job_id}: it resumes from this checkpoint" in log()
    assert f"stopped at step {FAULT_STEP} on SIGUSR2" in train_log
    assert re.findall(r"\] resumed from \S+ \(step (\d+),", train_log) == [str(FAULT_STEP)]
    assert run_record.read(run_dir)["restarts"] == 1 and run_record.read(run_dir)["status"] == "completed"
    got = dict(scalars(run_dir))
    assert sorted(got) == list(range(1, MAX_STEPS + 1))
    torch.testing.assert_close(
        torch.tensor([got[s] for s in sorted(got)], dtype=torch.float64),
        torch.tensor([uninterrupted[s] for s in sorted(got)], dtype=torch.float64), rtol=1e-5, atol=0,
    )  # fmt: skip
    assert not os.environ.get("SUBMITIT_EXECUTOR")
