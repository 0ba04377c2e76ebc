"""Torch's fake process group for a block: rank r of any world size in one process, every collective answered
without communicating (torch.testing._internal.distributed.fake_pg, as torchtitan's dry runs use it). What
distributed.verify_plan builds the real mesh, fully_shard and a pipeline rank's step on (verify, stage_step)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist

from shardlab.distributed import torch_internals
from shardlab.errors import ConfigError

__all__ = ["fake_process_group"]


@contextlib.contextmanager
def fake_process_group(world_size: int, rank: int) -> Iterator[None]:
    """The default process group as torch's fake backend, rank ``rank`` of ``world_size``, for the block."""
    if not torch_internals.tested():
        raise ConfigError(
            "distributed.verify_plan uses torch's fake process group and FSDP2 internals, checked on torch "
            f"{'.'.join(map(str, torch_internals.TESTED_TORCH[0]))} only; this is {torch.__version__}: drop it"
        )
    if dist.is_initialized():
        raise ConfigError("distributed.verify_plan runs in a process without a process group (a dry run)")
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    dist.init_process_group("fake", rank=rank, world_size=world_size, store=FakeStore())
    try:
        yield
    finally:
        dist.destroy_process_group()
