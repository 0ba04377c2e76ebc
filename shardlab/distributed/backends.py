"""Registers every distributed backend in BACKENDS (imported by the runner)."""

from __future__ import annotations

from shardlab.config import DistributedConfig
from shardlab.distributed.backend import Backend
from shardlab.distributed.ddp import DDPBackend
from shardlab.distributed.env import DistEnv
from shardlab.distributed.fully_sharded import FullyShardedBackend
from shardlab.errors import ConfigError
from shardlab.registry import BACKENDS


@BACKENDS.register("single")
def build_single(cfg: DistributedConfig, env: DistEnv) -> Backend:
    if env.world_size > 1:
        raise ConfigError(
            f"distributed.backend=single runs one process but this job has {env.world_size} ranks; "
            "use distributed.backend=ddp or fully_sharded"
        )
    return Backend(cfg, env)


@BACKENDS.register("ddp")
def build_ddp(cfg: DistributedConfig, env: DistEnv) -> Backend:
    return DDPBackend(cfg, env)


@BACKENDS.register("fully_sharded")
def build_fully_sharded(cfg: DistributedConfig, env: DistEnv) -> Backend:
    return FullyShardedBackend(cfg, env)
