"""The routed experts of an MoE block: SwiGLU experts held as grouped weights, computed on tokens sorted by expert.

Weights as transformers 5 holds them in memory (``MixtralExperts``, ``Qwen2MoeExperts``, ``Qwen3MoeExperts``,
``DeepseekV3Experts``): ``gate_up_proj`` of shape (experts, 2 * ffn, dim), the gate rows first and the up rows
after, and ``down_proj`` of shape (experts, dim, ffn); each expert's slice is an ``nn.Linear`` weight (out, in). The
hub files hold one tensor per expert (``experts.E.gate_proj.weight``...); shardlab_tasks/lm/models/moe.py's docstring
says how they map.

The computation: every (token, choice) assignment is sorted by expert (a stable sort, so within an expert the
tokens keep their order), the token rows are gathered in that order, each expert's contiguous group goes through its
SwiGLU, and the results, scaled by their routing weights, are added back to their tokens. Two exact ways to run the
groups: ``torch.nn.functional.grouped_mm`` (public since torch 2.10; one call for all experts, the CUDA kernel on
SM80+ in bf16, a CPU kernel in fp32/bf16 too) and a loop of ``F.linear`` over the contiguous slices (any device,
any dtype). shardlab_bench/moe.py measures them against transformers' per-expert loop.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed import ProcessGroup

from shardlab.distributed.expert_parallel import local_experts
from shardlab_tasks.lm.models.moe_parallel import expert_parallel_run, grad_summed

EXPERT_IMPLS = ("auto", "grouped_mm", "loop")
"""model.moe.experts_impl values: auto = grouped_mm where the device and dtype have it, else the loop."""


def grouped_mm_function():
    """``torch.nn.functional.grouped_mm``, or None on a torch without it. Public API (torch >= 2.10): no private
    name is used; tests/unit/test_moe_block.py fails loudly if torch moves it or changes what it computes."""
    return getattr(F, "grouped_mm", None)


def grouped_mm_usable(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether grouped_mm runs ``x`` against ``weight`` here: CUDA needs SM80+, bf16, and rows of a multiple of 16
    bytes (its TMA alignment); the CPU kernel takes fp32, bf16 and fp16."""
    if grouped_mm_function() is None or x.dtype != weight.dtype:
        return False
    if x.device.type == "cuda":
        aligned = all(size % 8 == 0 for size in weight.shape[1:])
        return x.dtype == torch.bfloat16 and aligned and torch.cuda.get_device_capability(x.device) >= (8, 0)
    return x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16, torch.float16)


class Dispatch(NamedTuple):
    """Where each kept (token, choice) assignment went, in expert order."""

    token: torch.Tensor
    """(assignments,) the token row of each assignment, sorted by expert."""
    weight: torch.Tensor
    """(assignments,) its routing weight."""
    counts: torch.Tensor
    """(experts,) kept assignments per expert (int64)."""
    num_dropped: torch.Tensor
    """() assignments dropped because their expert was over capacity (0 without a capacity factor)."""


def expert_counts(flat_indices: torch.Tensor, num_experts: int) -> torch.Tensor:
    """(experts,) how many of ``flat_indices`` chose each expert (int64). On the meta device (the memory plan's
    shape-only forward) the counts are data it does not hold: zeros of the right shape, so the forward runs on."""
    if flat_indices.is_meta:
        return flat_indices.new_zeros(num_experts)
    return torch.bincount(flat_indices, minlength=num_experts)


def dispatch(indices: torch.Tensor, weights: torch.Tensor, num_experts: int, capacity_factor: float | None) -> Dispatch:
    """Sort the (tokens, top_k) ``indices`` and their ``weights`` by expert. With a capacity factor, each expert keeps
    its first ceil(factor * tokens * top_k / experts) assignments in token order (Switch Transformer's rule); the rest
    are dropped (their token gets nothing from that expert: the residual carries it)."""
    flat = indices.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = expert_counts(flat, num_experts)
    token = order // indices.shape[1]
    weight = weights.reshape(-1)[order]
    dropped = torch.zeros((), dtype=torch.int64, device=flat.device)
    if capacity_factor is not None and flat.is_meta:  # the memory plan: at most every expert full, shapes only
        kept = min(flat.numel(), num_experts * math.ceil(capacity_factor * indices.numel() / num_experts))
        return Dispatch(token[:kept], weight[:kept], counts, dropped)
    if capacity_factor is not None:
        capacity = math.ceil(capacity_factor * indices.numel() / num_experts)
        starts = torch.cumsum(counts, 0) - counts
        rank_in_expert = torch.arange(flat.numel(), device=flat.device) - starts.repeat_interleave(counts)
        keep = rank_in_expert < capacity
        token, weight = token[keep], weight[keep]
        dropped = (~keep).sum()
        counts = counts.clamp(max=capacity)
    return Dispatch(token, weight, counts, dropped)


def swiglu_grouped_mm(x: torch.Tensor, counts: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """SwiGLU of each expert's contiguous group of rows of ``x``, as two grouped matrix products."""
    offsets = torch.cumsum(counts, 0).to(torch.int32)
    hidden = F.grouped_mm(x, gate_up.transpose(-2, -1), offs=offsets)
    gate, up = hidden.chunk(2, dim=-1)
    return F.grouped_mm(F.silu(gate) * up, down.transpose(-2, -1), offs=offsets)


def swiglu_loop(x: torch.Tensor, counts: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """The same, one ``F.linear`` pair per expert on its contiguous slice (any device, any dtype); an expert with no
    rows is skipped. One host sync for the counts. No rows at all (an expert-parallel rank whose experts got none)
    still give a (0, dim) result computed from ``x`` and the weights: its backward must run on every rank, for the
    all-to-all it contains, and give the weights a (zero) gradient, as FSDP2 reduces them on every rank."""
    outputs, start = [], 0
    for expert, count in enumerate(counts.tolist()):
        if count or (expert == 0 and not x.shape[0]):
            gate, up = F.linear(x[start : start + count], gate_up[expert]).chunk(2, dim=-1)
            outputs.append(F.linear(F.silu(gate) * up, down[expert]))
        start += count
    return torch.cat(outputs)


def swiglu_shapes(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """On the meta device: every row through the first expert's weights. Which rows reach which expert is data meta
    does not hold, but the tensors autograd saves (the rows, the gate/up output, the SiLU output, the product) have
    the shapes of the grouped or looped run over all rows, which is what the memory plan counts."""
    gate, up = F.linear(x, gate_up[0]).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, down[0])


def run_experts(
    rows: torch.Tensor, counts: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, impl: str
) -> torch.Tensor:
    """Each expert's SwiGLU on its contiguous group of ``rows`` (``counts`` per expert), by ``impl``: auto takes
    grouped_mm where grouped_mm_usable says the device and dtype have it, else the loop."""
    if rows.is_meta:
        return swiglu_shapes(rows, gate_up, down)
    grouped = impl == "grouped_mm" or (impl == "auto" and grouped_mm_usable(rows, gate_up))
    if grouped and rows.shape[0]:
        return swiglu_grouped_mm(rows, counts, gate_up, down)
    return swiglu_loop(rows, counts, gate_up, down)


class GroupedExperts(nn.Module):
    """``num_experts`` SwiGLU experts of width ``ffn_dim`` over ``dim``, as transformers 5 holds them."""

    def __init__(self, num_experts: int, dim: int, ffn_dim: int, impl: str = "auto") -> None:
        super().__init__()
        if impl not in EXPERT_IMPLS:
            raise ValueError(f"experts impl {impl!r} is not one of {', '.join(EXPERT_IMPLS)}")
        self.num_experts, self.impl = num_experts, impl
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * ffn_dim, dim))
        self.down_proj = nn.Parameter(torch.empty(num_experts, dim, ffn_dim))
        self.expert_group: ProcessGroup | None = None
        """Set by expert parallelism (shardlab/distributed/expert_parallel.py), which splits both weights by experts
        over this group: the rows then travel to their experts' ranks and back
        (shardlab_tasks/lm/models/moe_parallel.py)."""
        self.token_group: ProcessGroup | None = None
        """Set by tensor parallelism (shardlab_tasks/lm/models/tensor_parallel.py's SequenceShardedMoE): its ranks route
        different tokens through the same experts, so each weight's gradient is summed over it
        (moe_parallel.grad_summed)."""

    def forward(self, x: torch.Tensor, route: Dispatch) -> torch.Tensor:
        """(tokens, dim) ``x`` -> (tokens, dim): the sum over each token's kept assignments of weight * expert(x)."""
        rows = x[route.token]
        gate_up, down = (grad_summed(local_experts(w), self.token_group) for w in (self.gate_up_proj, self.down_proj))
        if self.expert_group is None:
            expert_out = run_experts(rows, route.counts, gate_up, down, self.impl)
        else:  # this rank's experts: the local rows of the split weights, whose gradients flow back into them
            expert_out = expert_parallel_run(
                rows, route.counts, gate_up.shape[0], lambda r, c: run_experts(r, c, gate_up, down, self.impl),
                self.expert_group,
            )  # fmt: skip
        expert_out = expert_out * route.weight.unsqueeze(-1).to(expert_out.dtype)
        return torch.zeros_like(x).index_add_(0, route.token, expert_out.to(x.dtype))
