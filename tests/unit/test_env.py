"""shardlab.distributed.env reads rank and rendezvous from whichever launcher started the process."""

from __future__ import annotations

import pytest

from shardlab.distributed import env as dist_env
from shardlab.errors import ConfigError

LAUNCHER_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "SLURM_NTASKS",
    "SLURM_PROCID",
    "SLURM_LOCALID",
    "SLURM_JOB_ID",
    "SLURM_JOB_NODELIST",
    "SLURM_JOB_NUM_NODES",
    "SLURM_NODEID",
    "SLURM_STEP_NODELIST",
    "SLURM_ARRAY_JOB_ID",
    "SLURM_ARRAY_TASK_ID",
    "SUBMITIT_EXECUTOR",
    "SUBMITIT_LOCAL_JOB_ID",
    "SUBMITIT_LOCAL_NTASKS",
    "SUBMITIT_LOCAL_GLOBALID",
    "SUBMITIT_LOCAL_LOCALID",
)


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for var in LAUNCHER_VARS:
        monkeypatch.delenv(var, raising=False)


def test_single_process_without_launcher():
    env = dist_env.detect()
    assert (env.rank, env.world_size, env.launcher) == (0, 1, "none")


def setenv_all(monkeypatch, **variables: str) -> None:
    for key, value in variables.items():
        monkeypatch.setenv(key, value)


def test_torchrun_variables(monkeypatch):
    setenv_all(monkeypatch, RANK="3", WORLD_SIZE="4", LOCAL_RANK="1", MASTER_ADDR="10.1.2.3", MASTER_PORT="29555")
    env = dist_env.detect()
    assert (env.rank, env.world_size, env.local_rank, env.master_addr, env.master_port, env.launcher) == (
        3,
        4,
        1,
        "10.1.2.3",
        29555,
        "torchrun",
    )


def test_slurm_tasks_through_submitit(monkeypatch):
    setenv_all(
        monkeypatch,
        SLURM_NTASKS="8",
        SLURM_PROCID="5",
        SLURM_LOCALID="1",
        SLURM_JOB_ID="4242",
        SLURM_JOB_NODELIST="gpu[07-08]",
        SLURM_JOB_NUM_NODES="2",
        SLURM_NODEID="1",
    )
    env = dist_env.detect()
    assert (env.rank, env.world_size, env.local_rank, env.master_addr, env.launcher) == (5, 8, 1, "gpu07", "slurm")
    assert 20000 <= env.master_port < 65536  # derived from the job id, the same on every task


def test_locally_spawned_rank():
    env = dist_env.detect(spawned_rank=1, spawned_world=2, spawned_port=1234)
    assert (env.rank, env.world_size, env.master_port, env.launcher) == (1, 2, 1234, "local")


def slurm_task(monkeypatch, job_id: str, **extra: str) -> dist_env.DistEnv:
    setenv_all(
        monkeypatch,
        SLURM_NTASKS="2",
        SLURM_PROCID="1",
        SLURM_LOCALID="1",
        SLURM_JOB_ID=job_id,
        SLURM_JOB_NODELIST="node[3-4]",
        SLURM_JOB_NUM_NODES="1",
        SLURM_NODEID="0",
        **extra,
    )
    return dist_env.detect()


def test_array_tasks_on_one_node_get_different_ports(monkeypatch):
    first = slurm_task(monkeypatch, "101", SLURM_ARRAY_JOB_ID="100", SLURM_ARRAY_TASK_ID="0")
    second = slurm_task(monkeypatch, "102", SLURM_ARRAY_JOB_ID="100", SLURM_ARRAY_TASK_ID="1")
    assert first.master_port != second.master_port
    assert slurm_task(monkeypatch, "101").master_port == first.master_port  # every task of a job agrees


def test_master_is_the_first_node_of_the_step(monkeypatch):
    assert slurm_task(monkeypatch, "7").master_addr == "node3"
    assert slurm_task(monkeypatch, "7", SLURM_STEP_NODELIST="node[4-5]").master_addr == "node4"


def test_a_one_task_slurm_job_spawns_its_own_ranks(monkeypatch):
    setenv_all(monkeypatch, SLURM_NTASKS="1", SLURM_PROCID="0", SLURM_JOB_ID="9", SLURM_JOB_NODELIST="n1")
    assert dist_env.detect().launcher == "none"


def test_submitit_local_job_tasks(monkeypatch):
    setenv_all(
        monkeypatch,
        SUBMITIT_EXECUTOR="local",
        SUBMITIT_LOCAL_JOB_ID="31337",
        SUBMITIT_LOCAL_NTASKS="2",
        SUBMITIT_LOCAL_GLOBALID="1",
        SUBMITIT_LOCAL_LOCALID="1",
    )
    env = dist_env.detect()
    assert (env.rank, env.world_size, env.local_rank, env.launcher) == (1, 2, 1, "submitit_local")


def test_a_rank_spawned_by_one_task_per_node_takes_its_global_rank_and_the_jobs_rendezvous(monkeypatch):
    """Two Slurm tasks (one per node), distributed.world_size=4: the second task's ranks are 2 and 3, meeting at the
    first node with the job's port."""
    setenv_all(
        monkeypatch, SLURM_NTASKS="2", SLURM_PROCID="1", SLURM_LOCALID="0", SLURM_JOB_ID="4242",
        SLURM_JOB_NODELIST="gpu[07-08]", SLURM_JOB_NUM_NODES="2", SLURM_NODEID="1",
    )  # fmt: skip
    task = dist_env.detect()
    assert dist_env.ranks_to_spawn(4, task) == 2
    assert dist_env.ranks_to_spawn(2, task) == 0  # as many tasks as ranks: each task is a rank
    rank = dist_env.detect(spawned_rank=1, spawned_world=4, spawned_port=1234)
    assert (rank.rank, rank.world_size, rank.local_rank, rank.master_addr, rank.launcher, rank.spawned) == (
        3, 4, 1, "gpu07", "slurm", True,
    )  # fmt: skip
    assert rank.master_port == task.master_port != 1234
    assert dist_env.ranks_to_spawn(4, rank) == 0  # a spawned rank spawns nothing
    with pytest.raises(ConfigError, match=r"^distributed.world_size=3 cannot be split over this job's 2 tasks; "):
        dist_env.ranks_to_spawn(3, task)


def test_only_shardlab_or_a_slurm_task_spawns_ranks(monkeypatch):
    assert dist_env.ranks_to_spawn(1, dist_env.detect()) == 0
    assert dist_env.ranks_to_spawn(4, dist_env.detect()) == 4
    setenv_all(monkeypatch, RANK="0", WORLD_SIZE="2", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
    assert dist_env.ranks_to_spawn(4, dist_env.detect()) == 0  # torchrun starts every rank itself
