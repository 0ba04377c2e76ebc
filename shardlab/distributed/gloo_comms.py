"""FSDP2's reduce-scatter issued as one all-reduce, through FSDP2's public custom-comm hook; optionally overlapped.

Why: gloo's ring all-reduce is its best-tuned collective; on CPU its reduce_scatter measured 1.3-1.6x slower for the
same buffer (tools/bench_collectives.py). And on CPU FSDP2 blocks on every unit's reduce-scatter in backward (CUDA
hides it on a side stream), so the slower rank's lag is paid at every unit. Only the collective changes: FSDP2 still
owns the sharding, the buffers, the copy-in/out and the reduce op it asks for. On NCCL a reduce-scatter moves half an
all-reduce's bytes, so this is for gloo only (distributed.reduce_scatter=auto).

Overlap: with ``overlap`` set, an averaging reduce is started asynchronously and its shard is written into FSDP2's
output tensor later: when the next unit's reduce is issued (at most ``max_in_flight`` in flight) or at ``wait()``.
That is only correct while nothing reads the gradient before ``wait()``: FSDP2 reads its output at once when it
post-divides (fp16), casts to another dtype, all-reduces across replicas (HSDP) or accumulates into an existing
gradient. The fully_sharded backend enables overlap only outside those cases and calls ``wait()`` after every backward.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter


class AllReduceReduceScatter(ReduceScatter):
    """All-reduce the whole input in place (FSDP2 drops that buffer after), then keep this rank's chunk."""

    def __init__(self, max_in_flight: int = 1) -> None:
        self.overlap = False
        self.max_in_flight = max_in_flight
        """Unfinished reduces kept: each holds a unit's full gradient buffer, so this bounds the extra memory."""
        self._pending: list[tuple[dist.Work, torch.Tensor, torch.Tensor, int, int]] = []

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        if async_op or op not in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):  # e.g. PREMUL_SUM: gloo has no such op
            return dist.reduce_scatter_single(output_tensor, input_tensor, group=group, op=op, async_op=async_op)
        world, rank = group.size(), group.rank()
        if self.overlap and op == dist.ReduceOp.AVG:  # SUM means FSDP2 post-divides the output right away
            while len(self._pending) >= self.max_in_flight:
                self._finish(*self._pending.pop(0))
            work = dist.all_reduce(input_tensor, group=group, async_op=True)
            self._pending.append((work, input_tensor, output_tensor, world, rank))
            return None
        dist.all_reduce(input_tensor, group=group)
        self._write_shard(input_tensor, output_tensor, world, rank, average=op == dist.ReduceOp.AVG)
        return None

    def wait(self) -> None:
        """Finish every started reduce: after this the sharded gradients hold their reduced values."""
        while self._pending:
            self._finish(*self._pending.pop(0))

    def _finish(self, work: dist.Work, summed: torch.Tensor, output: torch.Tensor, world: int, rank: int) -> None:
        work.wait()
        self._write_shard(summed, output, world, rank, average=True)

    @staticmethod
    def _write_shard(summed: torch.Tensor, output: torch.Tensor, world: int, rank: int, average: bool) -> None:
        mine = summed.view(world, -1)[rank]
        if average:
            torch.div(mine, world, out=output)
        else:
            output.copy_(mine)
