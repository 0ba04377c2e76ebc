"""shardlab on a real (one-node) Slurm through its submitit launcher: parity with a local run, job arrays and their
summary, USR2 preemption with requeue and an exact resume, failures and cancellations reported to the submitter."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from shardlab.jobs import run_record
from tests.conftest import TINY_LM
from tests.distributed.harness import run_spawned
from tests.events import logged_steps, scalars

pytestmark = pytest.mark.slurm
ROOT = Path(__file__).resolve().parents[2]
# Long enough to signal mid-run; validation only at the end; no periodic checkpoint inside the run.
RUN = [
    *TINY_LM,
    "optimization.max_steps=60",
    "validation.interval_steps=0",
    "checkpoint.interval_steps=1000",
    "logging.tensorboard=true",
    "distributed.backend=fully_sharded",
]


def submit(env: dict, sweep_dir: Path, corpus_cache: str, *overrides: str, wait: bool = True) -> subprocess.Popen:
    cmd = [
        sys.executable, "-m", "shardlab.train", "-m", *RUN, f"data.cache_dir={corpus_cache}", "hydra/launcher=slurm",
        f"hydra.sweep.dir={sweep_dir}", "hydra.launcher.poll_s=1", *overrides,
    ]  # fmt: skip
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(proc: subprocess.Popen, timeout: float = 300) -> str:
    out, _ = proc.communicate(timeout=timeout)
    return out


def wait_for(condition, timeout: float, what: str, interval: float = 0.2):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def manifest(sweep_dir: Path) -> list[dict]:
    path = sweep_dir / "sweep.json"
    return json.loads(path.read_text()) if path.is_file() else []


def slurm_state(env: dict, job_id: str) -> str:
    out = subprocess.run(
        ["squeue", "-h", "-t", "all", "-j", job_id, "-o", "%T"], env=env, capture_output=True, text=True
    )
    return out.stdout.strip()


def start_requeued_job_now(env: dict, job_id: str) -> None:
    """Slurm holds a requeued job ~120 s (its BeginTime); once it is pending again, start it now. Slurm refuses the
    update for a moment after the requeue, longer on a loaded machine: tried again until it takes. And not within
    the requeue's second: slurmd compares a job credential's creation time, in whole seconds, with the revocation of
    the previous incarnation's, so a start in the same second is killed as "Job credential revoked" (seen here: the
    requeue at 14:38:44.33, the update accepted at .46, the job killed at .88, and the test's job ended FAILED)."""
    wait_for(lambda: slurm_state(env, job_id) == "PENDING", 120, "the requeue")
    time.sleep(2.0)
    update = ["scontrol", "update", f"JobId={job_id}", "StartTime=now"]
    wait_for(
        lambda: subprocess.run(update, env=env, capture_output=True).returncode == 0, 60, "Slurm to take StartTime=now"
    )


def assert_losses_equal(got: list[float], expected: list[float]) -> None:
    torch.testing.assert_close(
        torch.tensor(got, dtype=torch.float64), torch.tensor(expected, dtype=torch.float64), rtol=1e-5, atol=0
    )


@pytest.fixture(scope="module")
def local_two_ranks(tiny_lm, tmp_path_factory) -> dict:
    """The same run on 2 local ranks: the reference every Slurm run must match."""
    (result,) = run_spawned([tiny_lm(*RUN[len(TINY_LM) :])], world_size=2, run_dirs=[tmp_path_factory.mktemp("local")])
    return result


def train_losses(result: dict) -> list[float]:
    return [r["loss"] for r in result["history"] if r["split"] == "train"]


def test_two_task_fully_sharded_job_matches_the_local_two_rank_run(slurm_env, corpus_cache, tmp_path, local_two_ranks):
    out = finish(submit(slurm_env, tmp_path, corpus_cache, "hydra.launcher.tasks_per_node=2"))
    (job,) = manifest(tmp_path)
    assert f"#0 job {job['job_id']} completed at step 60" in out, out[-3000:]
    assert f"log     {job['log']}" in out
    run_dir = Path(job["run_dir"])
    assert "world size 2 (slurm)" in Path(job["log"]).read_text()
    got = scalars(run_dir)
    assert [s for s, _ in got] == list(range(1, 61))
    assert_losses_equal([v for _, v in got], train_losses(local_two_ranks))
    assert run_record.read(run_dir)["final"]["loss"] == pytest.approx(local_two_ranks["final"]["loss"], rel=1e-5)


def test_sweep_runs_as_a_job_array_and_the_summary_tool_collects_it(slurm_env, corpus_cache, tmp_path):
    """In a folder with ``%`` in its name, as a sweep over absolute paths is named (``data.path=%2Fa,...``): sbatch
    reads it as a filename pattern unless escaped (shardlab/jobs/sbatch_paths.py); unescaped, every job failed."""
    sweep_dir = tmp_path / "path%2Fa%2Fb"  # (an override's "=" would need quoting for Hydra)
    out = finish(submit(slurm_env, sweep_dir, corpus_cache, "optimizer.lr=1e-3,3e-3", "optimization.max_steps=10"))
    jobs = manifest(sweep_dir)
    assert jobs, out[-3000:]
    array_ids = {j["job_id"].split("_")[0] for j in jobs}
    assert len(jobs) == 2 and len(array_ids) == 1 and [j["job_id"].split("_")[1] for j in jobs] == ["0", "1"]
    assert len({j["run_dir"] for j in jobs}) == 2
    assert out.count("completed at step 10") == 2, out[-3000:]
    summary = subprocess.run(
        [sys.executable, "-m", "shardlab_commands.sweep_summary", str(sweep_dir), "--json"], cwd=ROOT, env=slurm_env,
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    rows = json.loads(summary.stdout)
    assert [(r["job"], r["status"], r["step"]) for r in rows] == [(j["job_id"], "completed", 10) for j in jobs]
    assert all(r["final"]["loss"] > 0 for r in rows) and rows[0]["final"] != rows[1]["final"]


def test_usr2_requeues_and_resumes_at_the_signalled_step(slurm_env, corpus_cache, tmp_path, local_two_ranks):
    proc = submit(slurm_env, tmp_path, corpus_cache, "hydra.launcher.tasks_per_node=2")
    job = wait_for(lambda: (manifest(tmp_path) or [None])[0], 60, "the submission")
    run_dir, job_id = Path(job["run_dir"]), job["job_id"]
    wait_for(lambda: (run_record.read(run_dir) or {}).get("step", 0) >= 5, 120, "step 5")
    subprocess.run(["scancel", "--signal=USR2", job_id], env=slurm_env, check=True)
    start_requeued_job_now(slurm_env, job_id)
    out = finish(proc)
    assert f"#0 job {job_id} completed at step 60" in out, out[-3000:]

    status = run_record.read(run_dir)
    assert status["restarts"] == 1
    log = (run_dir / "train.log").read_text()
    stopped_at = int(log.split("stopped at step ")[1].split()[0])
    assert 5 <= stopped_at < 60 and f"step_{stopped_at:08d} (step {stopped_at}," in log  # resumed exactly there
    assert logged_steps(run_dir) == list(range(1, 61)), "no step is trained twice, none is skipped"
    got = scalars(run_dir)
    assert [s for s, _ in got] == list(range(1, 61)), "one continuous TensorBoard history"
    assert_losses_equal([v for _, v in got], train_losses(local_two_ranks))
    assert status["final"]["loss"] == pytest.approx(local_two_ranks["final"]["loss"], rel=1e-5)


def test_a_job_slurm_requeues_saves_first_and_is_followed_to_its_end(
    slurm_env, corpus_cache, tmp_path, local_two_ranks
):
    """`scontrol requeue` (what preemption with requeue does): SIGTERM, an agreed stop with a checkpoint, an exit
    without a result, so the submitter keeps following the job through its requeue to the end."""
    proc = submit(slurm_env, tmp_path, corpus_cache, "hydra.launcher.tasks_per_node=2", "checkpoint.interval_steps=5")
    job = wait_for(lambda: (manifest(tmp_path) or [None])[0], 60, "the submission")
    run_dir, job_id = Path(job["run_dir"]), job["job_id"]
    wait_for(lambda: (run_record.read(run_dir) or {}).get("step", 0) >= 7, 120, "step 7")
    subprocess.run(["scontrol", "requeue", job_id], env=slurm_env, check=True)
    start_requeued_job_now(slurm_env, job_id)
    out = finish(proc)
    assert f"#0 job {job_id} completed at step 60" in out, out[-3000:]
    log = (run_dir / "train.log").read_text()
    stopped_at = int(log.split("stopped at step ")[1].split()[0])
    assert f"step_{stopped_at:08d} (step {stopped_at}," in log and "on SIGTERM" in log
    assert logged_steps(run_dir) == list(range(1, 61))
    got = scalars(run_dir)
    assert [s for s, _ in got] == list(range(1, 61))
    assert_losses_equal([v for _, v in got], train_losses(local_two_ranks))


def test_a_bad_config_reports_its_one_line_error_and_the_job_fails(slurm_env, corpus_cache, tmp_path):
    proc = submit(slurm_env, tmp_path, corpus_cache, "model.num_heads=3")
    out = finish(proc)
    (job,) = manifest(tmp_path)
    assert proc.returncode == 1
    assert f"#0 job {job['job_id']} failed: model.num_heads (3) must divide model.dim (64)" in out, out[-3000:]
    wait_for(lambda: slurm_state(slurm_env, job["job_id"]) == "FAILED", 60, "Slurm to record the job as FAILED")


def test_a_task_whose_checks_fail_stops_the_job_at_once_with_its_reason(slurm_env, corpus_cache, tmp_path):
    """One task per rank, and only rank 1 cannot create its checkpoint directory (below a regular file): rank 1 fails
    its start-up checks before it joins; rank 0, which hosts the rendezvous store under Slurm, stops with rank 1's
    reason at once instead of waiting for it until the collective timeout."""
    (tmp_path / "ckpt1").write_text("a regular file where rank 1's checkpoint folder should go")
    per_task_dir = f"checkpoint.dir={tmp_path}/ckpt${{oc.env:SLURM_PROCID,0}}/checkpoints"
    started = time.monotonic()
    out = finish(submit(slurm_env, tmp_path, corpus_cache, "hydra.launcher.tasks_per_node=2", per_task_dir), 240)
    (job,) = manifest(tmp_path)
    assert time.monotonic() - started < 150, out[-3000:]
    reason = f"checkpoint.dir: cannot create or write {tmp_path}/ckpt1/checkpoints ({tmp_path}/ckpt1 is a file"
    # Rank 0 heard it from rank 1 and records it as it heard it: the message names the rank that failed and why.
    assert f"#0 job {job['job_id']} failed: rank 1 failed before joining: {reason}" in out, out[-3000:]
    status = run_record.read(Path(job["run_dir"]))
    assert status["status"] == "failed" and reason in status["error"]


def start_long_job(env: dict, sweep_dir: Path, corpus_cache: str) -> tuple[subprocess.Popen, dict]:
    proc = submit(env, sweep_dir, corpus_cache, "optimization.max_steps=100000")
    job = wait_for(lambda: (manifest(sweep_dir) or [None])[0], 60, "the submission")
    wait_for(lambda: (run_record.read(Path(job["run_dir"])) or {}).get("step", 0) >= 2, 120, "training")
    return proc, job


def test_a_cancelled_job_saves_and_the_submitter_returns(slurm_env, corpus_cache, tmp_path):
    proc, job = start_long_job(slurm_env, tmp_path, corpus_cache)
    subprocess.run(["scancel", job["job_id"]], env=slurm_env, check=True)  # SIGTERM: agreed stop, save
    out = finish(proc, timeout=180)
    assert proc.returncode == 1
    stopped_at = run_record.read(Path(job["run_dir"]))["step"]
    assert f"#0 job {job['job_id']} stopped at step {stopped_at}" in out, out[-3000:]
    assert (Path(job["run_dir"]) / "checkpoints" / f"step_{stopped_at:08d}" / "shardlab.json").is_file()


def test_a_job_killed_without_warning_does_not_leave_the_submitter_waiting(slurm_env, corpus_cache, tmp_path):
    proc, job = start_long_job(slurm_env, tmp_path, corpus_cache)
    subprocess.run(["pkill", "-KILL", "-f", f"submitit.core._submit {tmp_path}"], check=True)  # a node/OOM death
    out = finish(proc, timeout=180)
    assert proc.returncode == 1
    assert f"#0 job {job['job_id']} failed:" in out, out[-3000:]
    assert "died" in out.split("\nsweep ")[1]  # the summary says Slurm lost it; status.json alone still says running
