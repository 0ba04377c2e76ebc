"""Expert parallelism for the MoE block (issue 49, item 3, its first piece): the experts' dim sharded over a group
of ranks, each rank holding ``num_experts / degree`` consecutive experts; a rank's assignment rows travel to the
ranks holding their experts and their outputs travel back, by ``all_to_all_single`` of uneven sizes.

``expert_parallel_run`` takes the place of ``moe_experts.run_experts`` (GroupedExperts calls it when the backend
set its ``expert_group``: shardlab/distributed/expert_parallel.py) between the dispatch (sort by expert, gather)
and the combine (weight, ``index_add_``), which stay on the token's own rank. Two exchanges each way: first the
per-expert counts (equal splits: one count per expert), then the rows with the split sizes the counts give. The
rows a rank receives are ordered by (source rank, expert); a stable sort by expert groups them for the local
experts, and the inverse order puts the outputs back before the return exchange. Autograd runs both exchanges in
reverse (torch.distributed.nn.functional.all_to_all_single), so gradients reach the rows and the local experts.

Deterministic: a token's experts are chosen on its own rank from the replicated router, so the same tokens reach
the same experts at any expert-parallel degree; each row's output is the same SwiGLU of the same weights.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_autograd

DEPRECATION = r"torch\.distributed\.nn\.functional\.all_to_all_single is deprecated"


def expert_parallel_run(
    rows: torch.Tensor,
    counts: torch.Tensor,
    num_local: int,
    local_experts: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """The routed experts' outputs for this rank's ``rows`` (sorted by global expert, ``counts`` per expert over all
    ``num_experts``), computed by the ranks of ``group`` that hold them: each holds ``num_local`` = num_experts /
    group size (rank r holds experts r*L .. r*L + L - 1) and runs ``local_experts(rows, counts)`` on the rows it
    receives, grouped by its experts (moe_experts.run_experts on its slices)."""
    world = dist.get_world_size(group)
    if counts.numel() != world * num_local:
        raise ValueError(f"counts cover {counts.numel()} experts, the group holds {world} x {num_local}")
    received_counts = torch.empty_like(counts)
    dist.all_to_all_single(received_counts, counts, group=group)  # [source rank, local expert]
    by_source = received_counts.view(world, num_local)
    send_splits = counts.view(world, num_local).sum(dim=1).tolist()
    receive_splits = by_source.sum(dim=1).tolist()
    received = _exchange(rows, receive_splits, send_splits, group)
    expert_of = torch.arange(num_local, device=rows.device).repeat(world).repeat_interleave(received_counts)
    order = torch.argsort(expert_of, stable=True)
    outputs = local_experts(received[order], by_source.sum(dim=0))
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    return _exchange(outputs[inverse], send_splits, receive_splits, group)


def _exchange(
    rows: torch.Tensor, receive_splits: list[int], send_splits: list[int], group: dist.ProcessGroup | None
) -> torch.Tensor:
    """all_to_all_single of uneven sizes along dim 0, differentiable: torch's public autograd-aware one. Torch 2.14
    marks it deprecated in favour of the private ``_functional_collectives`` (the project keeps to public APIs), and
    says so in a FutureWarning on every rank's first call: that one warning is silenced here, nothing else."""
    output = rows.new_empty(sum(receive_splits), *rows.shape[1:])
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=DEPRECATION, category=FutureWarning)
        return dist_autograd.all_to_all_single(output, rows.contiguous(), receive_splits, send_splits, group=group)


class _SumOverGroup(torch.autograd.Function):
    """The sum over a group's ranks of each one's ``tensor``; backward: each rank's gradient to its own term as is
    (every rank's loss holds the same sum, whose gradient per term is the one upstream gradient: DTensor's Partial to
    Replicate)."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        total = tensor.clone()
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def summed_over(tensor: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """``tensor`` summed over ``group`` (None, or a meta tensor of the memory plan's trace: as is), differentiable."""
    if group is None or tensor.is_meta:
        return tensor
    if not tensor.requires_grad:
        total = tensor.clone()
        dist.all_reduce(total, group=group)
        return total
    return _SumOverGroup.apply(tensor, group)


class _GradientSummed(torch.autograd.Function):
    """Identity forward; backward: the gradient summed over the group."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def grad_summed(weight: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """``weight`` for a forward on this rank's tokens only, whose gradient is summed over ``group``'s ranks (each of
    which ran it on other tokens of the same sequences) before it reaches the parameter: the gradient one process
    gets; ``weight`` itself without a group (or on meta, the memory plan's trace)."""
    if group is None or weight.is_meta or not weight.requires_grad:
        return weight
    return _GradientSummed.apply(weight, group)
