"""shardlab across hosts: the test cluster's partition `multi` is two hosts made of network namespaces
(tools/slurm_cluster.sh), each with its own name, address and slurmd, whose own names resolve to loopback as
Debian's installer writes them. The layouts clusters use, losses equal to one process's, a host lost mid-run, a
checkpoint folder only one host sees, and a torchrun across the hosts."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shardlab.distributed import env as dist_env
from shardlab.jobs import run_record
from shardlab.runner import run_rank
from tests.conftest import TINY_LM
from tests.events import scalars
from tests.slurm.conftest import CLUSTER_DIR, cluster
from tests.slurm.test_slurm import (
    RUN,
    assert_losses_equal,
    finish,
    manifest,
    slurm_state,
    submit,
    train_losses,
    wait_for,
)

pytestmark = pytest.mark.slurm
ROOT = Path(__file__).resolve().parents[2]
STEPS = 20
ON_TWO_HOSTS = ["hydra.launcher.partition=multi", "hydra.launcher.nodes=2"]


@pytest.fixture(scope="module")
def one_process(tiny_lm, tmp_path_factory) -> dict:
    """The reference: the same run (global batch, seed, steps) in one process."""
    cfg = tiny_lm(*RUN[len(TINY_LM) :], f"optimization.max_steps={STEPS}", "distributed.backend=single")
    return run_rank(cfg, tmp_path_factory.mktemp("one_process"), dist_env.detect())


def run_on_two_hosts(env, tmp_path, corpus_cache, *overrides) -> tuple[str, Path, str]:
    out = finish(submit(env, tmp_path, corpus_cache, *ON_TWO_HOSTS, f"optimization.max_steps={STEPS}", *overrides))
    (job,) = manifest(tmp_path)
    return out, Path(job["run_dir"]), Path(job["log"]).read_text()


def test_one_task_per_rank_on_two_hosts_matches_one_process(multi_node_env, corpus_cache, tmp_path, one_process):
    out, run_dir, log = run_on_two_hosts(multi_node_env, tmp_path, corpus_cache)
    assert f"completed at step {STEPS}" in out, out[-3000:]
    assert "world size 2 (slurm)" in log and "network: 2 hosts, master shl-n1:" in log, log[-3000:]
    got = scalars(run_dir)
    assert [s for s, _ in got] == list(range(1, STEPS + 1))
    assert_losses_equal([v for _, v in got], train_losses(one_process))


def test_one_task_per_host_starting_two_ranks_with_hybrid_sharding_matches_one_process(
    multi_node_env, corpus_cache, tmp_path, one_process
):
    """One Slurm task per host, each starting 2 local ranks (distributed.world_size=4 over 2 tasks); hybrid sharding
    shards inside a host and replicates across the two."""
    out, run_dir, log = run_on_two_hosts(
        multi_node_env, tmp_path, corpus_cache, "distributed.world_size=4", "distributed.sharding_degree=2"
    )
    assert f"completed at step {STEPS}" in out, out[-3000:]
    assert "world size 4 (slurm)" in log and "mesh 2x2 ('dp_replicate', 'dp_shard')" in log, log[-3000:]
    got = scalars(run_dir)
    assert [s for s, _ in got] == list(range(1, STEPS + 1))
    assert_losses_equal([v for _, v in got], train_losses(one_process))


def test_a_checkpoint_folder_only_one_host_sees_is_refused_before_training(multi_node_env, corpus_cache, tmp_path):
    local = CLUSTER_DIR / "scratch" / tmp_path.name  # each host's own tmpfs
    proc = submit(multi_node_env, tmp_path, corpus_cache, *ON_TWO_HOSTS, f"checkpoint.dir={local}")
    out = finish(proc)
    (job,) = manifest(tmp_path)
    assert proc.returncode == 1
    expected = (
        f"failed: checkpoint.dir {local} is not shared between the job's hosts: shl-n2 (rank 1) cannot see the file "
        "rank 0 on shl-n1 wrote there"
    )
    assert expected in out, out[-3000:]
    status = run_record.read(Path(job["run_dir"]))
    assert status["status"] == "failed" and status.get("step", 0) == 0


def test_a_lost_host_ends_the_job_naming_it_and_its_requeue_finishes_the_run(
    multi_node_env, corpus_cache, tmp_path, one_process
):
    """Every process of shl-n2 killed, its slurmd included, mid-run: rank 0 names the lost host at once (not after
    distributed.timeout_s), Slurm requeues the job for its failed node, and once the host is back the job resumes from
    the newest complete checkpoint and ends with the uninterrupted run's losses."""
    proc = submit(
        multi_node_env, tmp_path, corpus_cache, *ON_TWO_HOSTS, f"optimization.max_steps={STEPS}",
        "checkpoint.interval_steps=5", "distributed.timeout_s=120",
    )  # fmt: skip
    try:
        job = wait_for(lambda: (manifest(tmp_path) or [None])[0], 60, "the submission")
        run_dir, job_id = Path(job["run_dir"]), job["job_id"]
        wait_for(lambda: (run_record.read(run_dir) or {}).get("step", 0) >= 8, 120, "step 8")
        killed = time.monotonic()
        assert cluster(multi_node_env, "kill-node", "shl-n2").returncode == 0
        status = wait_for(
            lambda: (s := run_record.read(run_dir) or {}).get("status") == "failed" and s, 120, "rank 0 to fail"
        )
        assert time.monotonic() - killed < 120
        assert status["error"].startswith("lost shl-n2 (10.77.0.12, rank 1): its processes ended or its host went "), (
            status["error"]
        )
        # The host comes back only once Slurm has seen it go (a slurmd back before that is sent the requeued job's
        # termination late, which then kills the new start).
        wait_for(lambda: "down" in node_state(multi_node_env, "shl-n2"), 120, "Slurm to mark shl-n2 down")
        assert cluster(multi_node_env, "node-up", "shl-n2").returncode == 0
        start_once_pending(multi_node_env, job_id)
        out = finish(proc)
    finally:
        cluster(multi_node_env, "node-up", "shl-n2")
        proc.kill()
    assert f"#0 job {job_id} completed at step {STEPS}" in out, out[-3000:]
    status = run_record.read(run_dir)
    assert status["restarts"] == 1
    resumed = re.search(r"resumed from \S*step_(\d+) \(step (\d+),", (run_dir / "train.log").read_text())
    assert resumed and int(resumed[1]) == int(resumed[2]) >= 5 and int(resumed[2]) % 5 == 0
    # The steps after the resumed checkpoint were trained twice; TensorBoard shows the second time (purge_step).
    last = dict(scalars(run_dir))
    assert sorted(last) == list(range(1, STEPS + 1))
    assert_losses_equal([last[s] for s in sorted(last)], train_losses(one_process))
    assert status["final"]["loss"] == pytest.approx(one_process["final"]["loss"], rel=1e-5)


def start_once_pending(env, job_id: str) -> None:
    """A requeued job that Slurm holds until its BeginTime (~2 minutes) is started now; one that Slurm started as soon
    as its nodes were back needs nothing."""
    update = ["scontrol", "update", f"JobId={job_id}", "StartTime=now"]
    pending_since = None

    def started() -> bool:
        nonlocal pending_since
        state = slurm_state(env, job_id)
        if state != "PENDING":
            return state in ("RUNNING", "COMPLETING", "COMPLETED")
        pending_since = pending_since or time.monotonic()
        if time.monotonic() - pending_since > 2.0:  # not in the requeue's own second (see start_requeued_job_now)
            subprocess.run(update, env=env, capture_output=True)
        return False

    wait_for(started, 180, "the requeued job to start")


def node_state(env, host: str) -> str:
    return subprocess.run(["sinfo", "-h", "-n", host, "-o", "%T"], env=env, capture_output=True, text=True).stdout


def torchrun_on(env, host: str, node_rank: int, port: int, args: list[str], out: Path) -> subprocess.Popen:
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1", f"--node_rank={node_rank}",
        "--master_addr=shl-n1", f"--master_port={port}", "-m", "shardlab.train", *args,
    ]  # fmt: skip
    return subprocess.Popen(
        ["bash", str(ROOT / "tools" / "slurm_cluster.sh"), "on", host, "env", "OMP_NUM_THREADS=1", *command],
        cwd=ROOT, env=env, stdout=out.open("w"), stderr=subprocess.STDOUT,
    )  # fmt: skip


@pytest.mark.slow  # ~100 s; the submitit layouts of this file run one task per host by default
def test_a_plain_sbatch_script_with_one_srun_task_per_host_starting_two_ddp_ranks_matches_one_process(
    multi_node_env, corpus_cache, tmp_path, one_process
):
    """No submitit: `srun` starts one task per host, each of which starts 2 local ranks (ddp across 4 ranks)."""
    overrides = [*RUN, f"optimization.max_steps={STEPS}", f"data.cache_dir={corpus_cache}", "distributed.backend=ddp",
                 "distributed.world_size=4", f"hydra.run.dir={tmp_path}/run"]  # fmt: skip
    script = tmp_path / "job.sh"
    script.write_text(
        "#!/bin/bash\n#SBATCH --partition=multi --nodes=2 --ntasks-per-node=1 --cpus-per-task=2\n"
        f"srun {sys.executable} -m shardlab.train {' '.join(overrides)}\n"
    )
    sbatch = subprocess.run(
        ["sbatch", "--parsable", "--wait", f"--output={tmp_path}/job.out", str(script)], cwd=ROOT,
        env={**multi_node_env, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    out = (tmp_path / "job.out").read_text()
    assert sbatch.returncode == 0, out[-3000:]
    assert "world size 4 (slurm)" in out and "network: 2 hosts" in out and "backend ddp" in out, out[-3000:]
    got = scalars(tmp_path / "run")
    assert [s for s, _ in got] == list(range(1, STEPS + 1))
    assert_losses_equal([v for _, v in got], train_losses(one_process))


def test_torchrun_across_two_hosts_matches_one_process(multi_node_env, corpus_cache, tmp_path, one_process):
    """Host names that resolve to loopback on their own host: each rank offers gloo the interface its peers reach."""
    args = [*RUN, f"optimization.max_steps={STEPS}", f"data.cache_dir={corpus_cache}", f"hydra.run.dir={tmp_path}/run",
            "distributed.backend=ddp"]  # fmt: skip
    logs = [tmp_path / "n1.log", tmp_path / "n2.log"]
    agents = [
        torchrun_on(multi_node_env, f"shl-n{n + 1}", n, 29_400 + os.getpid() % 500, args, logs[n]) for n in (0, 1)
    ]
    try:
        codes = [agent.wait(timeout=300) for agent in agents]
    finally:
        for agent in agents:
            agent.kill()
    assert codes == [0, 0], "\n".join(log.read_text()[-2000:] for log in logs)
    text = logs[0].read_text()
    assert "world size 2 (torchrun)" in text and "ranks talk on shlv1p" in text, text[-3000:]
    got = scalars(tmp_path / "run")
    assert [s for s, _ in got] == list(range(1, STEPS + 1))
    assert_losses_equal([v for _, v in got], train_losses(one_process))


def test_a_host_that_cannot_reach_the_master_fails_in_one_line(multi_node_env, corpus_cache, tmp_path):
    """A rank on shl-n2 whose master (shl-n1) has nothing on the port: one line naming the address, the port and the
    interface, after distributed.init_timeout_s."""
    port = 29_900 + os.getpid() % 50
    env = {**multi_node_env, "RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "shl-n1",
           "MASTER_PORT": str(port)}  # fmt: skip
    started = time.monotonic()
    out = subprocess.run(
        ["bash", str(ROOT / "tools" / "slurm_cluster.sh"), "on", "shl-n2", sys.executable, "-m", "shardlab.train",
         *TINY_LM, f"data.cache_dir={corpus_cache}", "distributed.backend=ddp", "distributed.init_timeout_s=4",
         f"hydra.run.dir={tmp_path}/run"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode != 0
    assert time.monotonic() - started < 60
    expected = (
        f"rank 1 on shl-n2 could not reach the master at shl-n1 (10.77.0.11) port {port} from shlv2p (10.77.0.12) "
        "within distributed.init_timeout_s=4 s (Connection refused)"
    )
    assert expected in out.stdout + out.stderr, (out.stdout + out.stderr)[-3000:]
