"""One checkpoint write in the background (checkpoint.async_save): DCP stages the state into CPU memory, training goes
on, and a thread writes the files.

The thread's collectives (DCP's plan exchange and the final gather) run on a process group of their own: sharing the
training group, they would interleave with the training all-reduces in a different order on each rank and hang or
mix up data. It is gloo, because DCP's async save needs a CPU-capable group also when training uses NCCL.
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp


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
    def __init__(self) -> None:
        # Created here, by every rank in the same order (Trainer.setup), as new_group requires.
        self.group = dist.new_group(backend="gloo") if dist.is_initialized() else None
        self.pending: PendingSave | None = None

    def start(self, state: dict, tmp: Path, final: Path, meta: dict, start: float) -> None:
        assert self.pending is None, "the previous asynchronous save must be finished first"
        response = dcp.async_save(state, checkpoint_id=str(tmp), process_group=self.group)
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
