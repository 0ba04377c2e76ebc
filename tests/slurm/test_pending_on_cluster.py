"""Must-show 4 of issue #51 on the real test cluster: the README's multi-node line without
hydra.launcher.partition asks the default partition (debug, one node) for two nodes; Slurm keeps the job pending for
ever, and the submitter says so in one line naming hydra.launcher.partition, cancels the job and exits non-zero,
within a minute of submission (tests/unit/test_pending_jobs.py covers the reasons with squeue/sinfo stand-ins)."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest

from shardlab.jobs import run_record
from tests.slurm.test_slurm import finish, manifest, submit

pytestmark = pytest.mark.slurm
README_LINE = [  # README.md's multi-node line, as written (no hydra.launcher.partition)
    "hydra.launcher.nodes=2", "distributed.world_size=8", "distributed.backend=fully_sharded",
    "distributed.sharding_degree=4",
]  # fmt: skip


def test_the_readme_multi_node_line_without_a_partition_is_refused_in_one_line(slurm_env, corpus_cache, tmp_path):
    started = time.monotonic()
    proc = submit(slurm_env, tmp_path, corpus_cache, *README_LINE)
    try:
        out = finish(proc, 90)
    except subprocess.TimeoutExpired:  # the submitter waits silently: stop it and its job, then fail
        proc.kill()
        for job in manifest(tmp_path):
            subprocess.run(["scancel", job["job_id"].split("_")[0]], env=slurm_env, capture_output=True)
        pytest.fail(f"no answer after 90 s: {(proc.communicate()[0] or '')[-3000:]}")
    elapsed = time.monotonic() - started
    (job,) = manifest(tmp_path)
    assert proc.returncode != 0, out[-3000:]
    reports = [line for line in out.splitlines() if f"job {job['job_id']} cannot start" in line]
    assert len(reports) == 1, out[-3000:]  # the sweep's summary then repeats the reason on the job's own row
    assert (
        "cancelled: it asks for 2 nodes and partition debug has 1 node (PartitionNodeLimit): set "
        "hydra.launcher.partition to a partition with 2 nodes" in reports[0]
    ), reports[0]
    assert elapsed < 60, f"answered after {elapsed:.0f} s:\n{out[-3000:]}"
    queue = subprocess.run(["squeue", "-h", "-j", job["job_id"].split("_")[0], "-t", "PD,R,CG"], env=slurm_env,
                           capture_output=True, text=True)  # fmt: skip
    assert queue.stdout.strip() == "", queue.stdout
    status = run_record.read(Path(job["run_dir"]))
    assert status["status"] == "failed" and "hydra.launcher.partition" in status["error"]
