"""One checkpoint write in the background (checkpoint.async_save): DCP stages the state into CPU memory, training goes
on, and a thread writes the files.

The thread's collectives (DCP's plan exchange and the final gather) run on a process group of their own: sharing the
training group, they would interleave with the training all-reduces in a different order on each rank and hang or
mix up data. It is gloo, because DCP's async save needs a CPU-capable group also when training uses NCCL.

The staging buffers are allocated at the first save and reused (pinned on CUDA): a fresh copy per save paid the
allocation's page faults every time. They hold one copy of this rank's model and optimizer state for the whole run,
the price of not blocking (shardlab_bench/checkpoint.py measures both).
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict
from torch.distributed.checkpoint.staging import BlockingAsyncStager


class ReusedBufferStager(BlockingAsyncStager):
    """BlockingAsyncStager's cached staging, but pinned only where CUDA exists (torch's pins unconditionally).
    Reuse is safe because a save starts only after the previous one's write finished (AsyncSaver.pending)."""

    def stage(self, state_dict):
        if self.state_dict_cache is None:
            self.state_dict_cache = _create_cpu_state_dict(state_dict, pin_memory=torch.cuda.is_available())
        return _copy_state_dict(state_dict, self.state_dict_cache)


@dataclass
class PendingSave:
    tmp: Path
    final: Path
    meta: dict[str, Any]
    start: float
    """perf_counter() when the save was asked for."""
    blocked_s: float
    """Time training waited in the call that started it (staging)."""
    future: Future


class AsyncSaver:
    def __init__(self, timeout_s: float) -> None:
        # Created here, by every rank in the same order (Trainer.setup), as new_group requires; its collectives wait
        # for the slowest rank's writes, up to checkpoint.timeout_s.
        timeout = timedelta(seconds=timeout_s)
        self.group = dist.new_group(backend="gloo", timeout=timeout) if dist.is_initialized() else None
        self.pending: PendingSave | None = None
        self.stager = ReusedBufferStager(cache_staged_state_dict=True)

    def start(self, state: dict, tmp: Path, final: Path, meta: dict, start: float) -> None:
        assert self.pending is None, "the previous asynchronous save must be finished first"
        response = dcp.async_save(state, checkpoint_id=str(tmp), process_group=self.group, async_stager=self.stager)
        future = getattr(response, "upload_completion", response)  # newer torch returns AsyncSaveResponse
        self.pending = PendingSave(tmp, final, meta, start, time.perf_counter() - start, future)

    def wait(self, timeout: float | None = None) -> tuple[PendingSave, BaseException | None]:
        """The save in flight once it ended, and its error (None when it succeeded)."""
        pending, self.pending = self.pending, None
        assert pending is not None
        try:
            pending.future.result(timeout=timeout)
            return pending, None
        except FutureTimeout as e:
            return pending, e
        except BaseException as e:  # noqa: B036  (DCP's CheckpointException is a BaseException)
            return pending, e
