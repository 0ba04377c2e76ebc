"""FSDP2's reduce-scatter issued as one all-reduce, through FSDP2's custom-comm hook; optionally overlapped. Opt-in.

Why: gloo's ring all-reduce is its best-tuned collective; on CPU its reduce_scatter measured slower for the same buffer
(shardlab_bench/collectives.py; the table: docs/benchmarks.md). And on CPU FSDP2 blocks on every unit's reduce-scatter
in backward (CUDA hides it on a side stream), so the slower rank's lag is paid at every unit. Only the collective
changes: FSDP2 still owns the sharding, the buffers, the copy-in/out and the reduce op it asks for. On NCCL a
reduce-scatter moves half an all-reduce's bytes, so this is for gloo only (distributed.reduce_scatter=all_reduce,
refused with CUDA devices).

Opt-in, not the default: the hook's interface class lives in a private torch module (see torch_internals), and side by
side on the 2-core development machine it did not beat the native reduce-scatter beyond run-to-run noise
(docs/benchmarks.md).

Overlap: with ``overlap`` set, an averaging reduce is started asynchronously and its shard is written into FSDP2's
output tensor later: when the next unit's reduce is issued (one in flight at a time, so the extra memory is one
unit's gradient buffer) or at ``wait()``. That is only correct while nothing reads the gradient before ``wait()``;
the fully_sharded backend decides when that holds (FullyShardedBackend.grad_sync) and calls ``wait()`` after every
backward. A summing reduce never overlaps: FSDP2 post-divides its output at once (fp16).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from shardlab.distributed import torch_internals


def make_reduce_comm() -> AllReduceReduceScatter | None:
    """The comm for ``FSDPModule.set_custom_reduce_scatter``, or None where this torch's hook interface is untested
    (then FSDP2's native reduce-scatter runs)."""
    base = torch_internals.reduce_scatter_base()
    if base is None:
        return None
    base.register(AllReduceReduceScatter)  # FSDP2's ReduceScatter interface, as a virtual base (an ABC)
    return AllReduceReduceScatter()


class AllReduceReduceScatter:
    """All-reduce the whole input in place (FSDP2 drops that buffer after), then keep this rank's chunk. Implements
    FSDP2's ReduceScatter interface (allocate, __call__); build it with make_reduce_comm."""

    def __init__(self) -> None:
        self.overlap = False
        self._pending: tuple[dist.Work, torch.Tensor, torch.Tensor, int, int] | None = None

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        if async_op or op not in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):  # e.g. PREMUL_SUM: gloo has no such op
            return dist.reduce_scatter_single(output_tensor, input_tensor, group=group, op=op, async_op=async_op)
        world, rank = group.size(), group.rank()
        if self.overlap and op == dist.ReduceOp.AVG:
            self.wait()  # the previous unit's reduce had this unit's backward to finish under
            work = dist.all_reduce(input_tensor, group=group, async_op=True)
            self._pending = (work, input_tensor, output_tensor, world, rank)  # keeps the input alive until then
            return None
        dist.all_reduce(input_tensor, group=group)
        _write_shard(input_tensor, output_tensor, world, rank, average=op == dist.ReduceOp.AVG)
        return None

    def wait(self) -> None:
        """Finish the started reduce: after this every sharded gradient holds its reduced value."""
        if self._pending is not None:
            work, summed, output, world, rank = self._pending
            self._pending = None
            work.wait()
            _write_shard(summed, output, world, rank, average=True)

    def discard(self) -> None:
        """Forget the started reduce (backward failed: its gradients are dropped anyway)."""
        self._pending = None


def _write_shard(summed: torch.Tensor, output: torch.Tensor, world: int, rank: int, average: bool) -> None:
    mine = summed.view(world, -1)[rank]
    if average:
        torch.div(mine, world, out=output)
    else:
        output.copy_(mine)
