"""Who am I in the job? One place decides rank / world size / local rank / rendezvous from whichever launcher ran us.

Order: torchrun (RANK, WORLD_SIZE, MASTER_ADDR set), then Slurm (SLURM_PROCID... via submitit's
TorchDistributedEnvironment, the well-kept parser of Slurm's node lists), then shardlab's own local spawn
(distributed.world_size), else a single process.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    launcher: str
    """torchrun, slurm, local (shardlab spawned the ranks) or none (one process)."""

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def detect(spawned_rank: int | None = None, spawned_world: int = 1, spawned_port: int = 0) -> DistEnv:
    """Rank and rendezvous for this process; ``spawned_*`` come from shardlab's own launcher when it started us."""
    if spawned_rank is not None:
        return DistEnv(spawned_rank, spawned_world, spawned_rank, "127.0.0.1", spawned_port, "local")
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ:
        return DistEnv(
            rank=int(os.environ["RANK"]),
            world_size=int(os.environ["WORLD_SIZE"]),
            local_rank=int(os.environ.get("LOCAL_RANK", 0)),
            master_addr=os.environ["MASTER_ADDR"],
            master_port=int(os.environ.get("MASTER_PORT", 29500)),
            launcher="torchrun",
        )
    if int(os.environ.get("SLURM_NTASKS", "1")) > 1 and "SLURM_PROCID" in os.environ:
        from submitit.helpers import TorchDistributedEnvironment

        env = TorchDistributedEnvironment()
        return DistEnv(env.rank, env.world_size, env.local_rank, env.master_addr, env.master_port, "slurm")
    return DistEnv(0, 1, 0, "127.0.0.1", 0, "none")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
