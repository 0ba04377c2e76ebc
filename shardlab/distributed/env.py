"""Who am I in the job? One place decides rank / world size / local rank / rendezvous from whichever launcher ran us.

Order: shardlab's own local spawn (distributed.world_size), torchrun (RANK, WORLD_SIZE, MASTER_ADDR set), the tasks
of a Slurm job step or of a submitit local job (read through submitit's JobEnvironment classes, the well-kept parser
of Slurm's node lists; they also serve plain `srun`, where submitit's TorchDistributedEnvironment would insist on
SUBMITIT_EXECUTOR), else a single process.
"""

from __future__ import annotations

import os
import socket
import sys
import zlib
from dataclasses import dataclass
from typing import NoReturn


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    launcher: str
    """torchrun, slurm, submitit_local, local (shardlab spawned the ranks) or none (one process)."""
    spawned: bool = False
    """shardlab started this rank: on one machine (launcher local), or as one of the local ranks a Slurm task starts
    on its node (launcher slurm / submitit_local); its launcher process, not the rank, speaks for the job."""

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def detect(spawned_rank: int | None = None, spawned_world: int = 1, spawned_port: int = 0) -> DistEnv:
    """Rank and rendezvous for this process; ``spawned_*`` come from shardlab's own launcher when it started us
    (``spawned_rank``: the index on this machine). A rank spawned by one task of a multi-task job (one task per node,
    each starting its share of distributed.world_size) takes its global rank and the job's rendezvous from the task."""
    if spawned_rank is not None:
        task = detect()
        if task.world_size > 1:
            per_task = spawned_world // task.world_size
            return DistEnv(
                task.rank * per_task + spawned_rank, spawned_world, spawned_rank, task.master_addr, task.master_port,
                task.launcher, spawned=True,
            )  # fmt: skip
        return DistEnv(spawned_rank, spawned_world, spawned_rank, "127.0.0.1", spawned_port, "local", spawned=True)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ:
        return DistEnv(
            rank=int(os.environ["RANK"]),
            world_size=int(os.environ["WORLD_SIZE"]),
            local_rank=int(os.environ.get("LOCAL_RANK", 0)),
            master_addr=os.environ["MASTER_ADDR"],
            master_port=int(os.environ.get("MASTER_PORT", 29500)),
            launcher="torchrun",
        )
    job = _job_environment()
    if job is not None and job.num_tasks > 1:  # one task: like no launcher, so distributed.world_size spawns ranks
        launcher = "submitit_local" if os.environ.get("SUBMITIT_EXECUTOR") == "local" else "slurm"
        return DistEnv(job.global_rank, job.num_tasks, job.local_rank, job.hostnames[0], job_port(job), launcher)
    return DistEnv(0, 1, 0, "127.0.0.1", 0, "none")


def _job_environment():
    """submitit's view of a Slurm task (or of a submitit local job), else None.

    The master address is the first node of the *step* (srun puts task 0 there), which is the job's first node unless
    the step runs on part of the allocation; submitit reads the job's list, so it is pointed at the step's here."""
    if os.environ.get("SUBMITIT_EXECUTOR") == "local":
        from submitit.local.local import LocalJobEnvironment

        return LocalJobEnvironment()
    if "SLURM_PROCID" not in os.environ:
        return None
    from submitit.slurm.slurm import SlurmJobEnvironment

    class SlurmStepEnvironment(SlurmJobEnvironment):
        _env = {**SlurmJobEnvironment._env, "nodes": "SLURM_STEP_NODELIST"}

    return SlurmStepEnvironment() if os.environ.get("SLURM_STEP_NODELIST") else SlurmJobEnvironment()


def job_port(job) -> int:
    """The rendezvous port, the same on every task of a job and different between jobs on one node: from the job's
    own id (each array task has its own SLURM_JOB_ID; the array's id would give all of them one port), unless
    MASTER_PORT pins one."""
    if os.environ.get("MASTER_PORT"):
        return int(os.environ["MASTER_PORT"])
    raw = job.raw_job_id
    number = int(raw) if raw.isdigit() else zlib.crc32(raw.encode())
    return 20000 + number % 40000


def current_job() -> str | None:
    """The scheduler's id for this job, the same on every requeue: Slurm's (one per array task), submitit's local
    one, or torchrun's rendezvous id (elastic restarts keep it; its default "none" names nothing)."""
    for key in ("SLURM_JOB_ID", "SUBMITIT_LOCAL_JOB_ID"):
        if os.environ.get(key):
            return os.environ[key]
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    return f"torchelastic-{run_id}" if run_id and run_id != "none" else None


def ranks_to_spawn(world_size: int, env: DistEnv) -> int:
    """How many ranks this process starts itself (0: it is a rank): ``world_size`` (distributed.world_size) on one
    machine without a launcher, or, in a Slurm (or submitit local) job with fewer tasks than ``world_size``, its share
    of them: one task per node, each starting world_size / tasks local ranks. torchrun starts every rank itself."""
    if env.launcher == "none":
        return world_size if world_size > 1 else 0
    if env.launcher in ("slurm", "submitit_local") and not env.spawned and world_size > env.world_size:
        if world_size % env.world_size:
            from shardlab.errors import ConfigError

            raise ConfigError(
                f"distributed.world_size={world_size} cannot be split over this job's {env.world_size} tasks; use a "
                f"multiple of {env.world_size} (each task starts world_size / {env.world_size} ranks on its node), "
                f"or {env.world_size} (each task is one rank)"
            )
        return world_size // env.world_size
    return 0


def set_local_rank_defaults(world_size: int) -> None:
    """Environment for ranks this process is about to spawn (children inherit it), unless the user set it: one
    OpenMP thread per core per rank (oversubscribed OpenMP threads spin and collapse throughput). How a CPU rank's
    allocator treats freed memory is the rank's own setting (distributed.cpu_allocator), on every launcher."""
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // world_size)))


def ranks_per_node(world_size: int) -> int:
    """Ranks on each machine of the job: torchrun's LOCAL_WORLD_SIZE, the Slurm step's tasks over its nodes, else all
    of them (one machine)."""
    if os.environ.get("LOCAL_WORLD_SIZE"):
        return int(os.environ["LOCAL_WORLD_SIZE"])
    nodes = os.environ.get("SLURM_STEP_NUM_NODES") or os.environ.get("SLURM_NNODES")
    if nodes and int(nodes) > 0 and "SLURM_PROCID" in os.environ:
        return max(1, world_size // int(nodes))
    return world_size


def end_finished_rank() -> NoReturn:
    """End a spawned rank whose work is done (results written) without the interpreter's teardown: on this 2-core
    machine under load, torch's C++ process-group threads were seen to abort such a rank in that teardown
    (std::terminate: "terminate called without an active exception"), turning a finished rank into a failed one."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
