"""The two collectives the methods need over the data-parallel ranks (all ranks: every rank reads its own slice of
the global batch), as torch's functional collectives: differentiable, and they run on the meta device, where the
memory plan traces the loss. Without a process group of more than one rank both are the identity.

Tests replace these two functions with local ones to show what the global batch changes (tests/distributed).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol


def data_parallel_world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def data_parallel_rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def all_reduce(x: torch.Tensor, op: str = "sum") -> torch.Tensor:
    """``x`` reduced over all ranks (op: sum or max), without gradient."""
    if data_parallel_world() == 1:
        return x
    return funcol.all_reduce(x.detach(), op, dist.group.WORLD)


def all_gather_with_grad(x: torch.Tensor) -> torch.Tensor:
    """Every rank's ``x`` stacked along dim 0 in rank order; backward sends each rank the gradient of its own rows,
    summed over the ranks whose losses used them."""
    if data_parallel_world() == 1:
        return x
    return funcol.all_gather_single_autograd(x.contiguous(), 0, dist.group.WORLD)
