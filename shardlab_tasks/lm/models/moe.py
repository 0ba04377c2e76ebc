"""A mixture-of-experts feed-forward block (issue 49, item 1): a router, top-k routed SwiGLU experts held as grouped
weights (shardlab_tasks/lm/models/moe_experts.py), optional shared experts, and the balancing signals: the families'
auxiliary loss, the router z-loss, DeepSeek-V3's bias-based balancing, and the per-expert load for logging.

The families, as ``MoEConfig`` values (``family_config`` builds them; transformers 5.25's blocks are the reference,
tests/unit/test_moe_block.py compares outputs):

- Mixtral: softmax over the router logits, top-k, the k weights renormalised to sum to 1 (``norm_topk_prob``).
- Qwen2-MoE: softmax, top-k, renormalised only if ``norm_topk_prob`` (false in Qwen1.5-MoE), plus one shared SwiGLU
  expert whose output is scaled by sigmoid(a linear gate of the token) (``shared_expert_gate``).
- Qwen3-MoE: softmax, top-k, ``norm_topk_prob`` (true in the released models), no shared expert.
- DeepSeek-V3: sigmoid scores; experts in ``num_groups`` groups, each group scored by the sum of its 2 best
  (bias-corrected) scores, only the best ``topk_groups`` groups eligible; experts chosen on score + correction bias,
  weighted by the plain scores, renormalised, times ``routed_scaling``; shared experts without a gate.

Balancing. The auxiliary loss is Switch Transformer's (Mixtral's and Qwen's ``load_balancing_loss_func``):
num_experts * sum_i f_i * P_i, with f_i the fraction of (token, choice) assignments expert i got and P_i its mean
routing probability; transformers pools f and P over all layers before multiplying, and so does
``load_balancing_loss``. The z-loss (ST-MoE) is the mean of logsumexp(logits)^2. DeepSeek-V3's auxiliary-loss-free
balancing keeps a per-expert bias that only chooses experts (never weights them) and moves it outside autograd after
each optimizer step: bias_i += rate * sign(mean load - load_i) (``MoEBlock.update_score_bias``).

Hub names. Per expert, one tensor each: Qwen2/3-MoE and DeepSeek-V3 ``model.layers.N.mlp.experts.E.{gate,up,down}
_proj.weight`` and ``mlp.gate.weight`` (the router); Mixtral ``block_sparse_moe.experts.E.w1`` (gate), ``w3`` (up),
``w2`` (down) and ``block_sparse_moe.gate.weight``. ``experts.gate_up_proj[E] = cat(gate_E, up_E)``,
``experts.down_proj[E] = down_E``; the split back is exact (no arithmetic).

Under tensor parallelism (shardlab_tasks/lm/models/tensor_parallel.py's SequenceShardedMoE) the block runs on this
rank's slice of the sequence, its weights whole on every rank of the group (``token_group``): each rank routes its own
tokens, so the routing statistics are summed over the group (``over_tokens``: the loads, the probabilities' sum, the
z-loss's terms) and every rank holds what one process computes; each weight's gradient, its tokens' share, is summed
over the group on its way back (``grad_summed``), as FSDP2 sums a replicated DTensor's partial gradient.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from shardlab_tasks.lm.config import MoEConfig
from shardlab_tasks.lm.models.moe_experts import EXPERT_IMPLS, GroupedExperts, dispatch, expert_counts
from shardlab_tasks.lm.models.moe_parallel import grad_summed, summed_over

SCORE_FUNCS = ("softmax", "sigmoid")


FAMILIES = {
    "mixtral": MoEConfig(score_func="softmax", norm_topk_prob=True, aux_loss_coef=0.02),
    "qwen2_moe": MoEConfig(score_func="softmax", norm_topk_prob=False, shared_expert_gate=True, aux_loss_coef=0.001),
    "qwen3_moe": MoEConfig(score_func="softmax", norm_topk_prob=True, aux_loss_coef=0.001),
    "deepseek_v3": MoEConfig(score_func="sigmoid", norm_topk_prob=True, routed_scaling=2.5, score_bias=True),
}
"""Each family's routing rule and default coefficients; sizes (and the fields a checkpoint's config.json sets)
come in as overrides: ``family_config("qwen2_moe", num_experts=60, top_k=4, shared_ffn_dim=5632)``."""


def family_config(family: str, **overrides) -> MoEConfig:
    """The MoEConfig of ``family`` (a key of FAMILIES) with ``overrides``."""
    if family not in FAMILIES:
        raise ValueError(f"MoE family {family!r} is not one of {', '.join(FAMILIES)}")
    return replace(FAMILIES[family], **overrides)


def moe_config_errors(m: MoEConfig, prefix: str = "model.moe") -> list[str]:
    """Problems of an MoE section, each naming its dotted key."""
    sizes = ("num_experts", "top_k", "ffn_dim")
    errors = [f"{prefix}.{k} must be >= 1, got {getattr(m, k)}" for k in sizes if getattr(m, k) < 1]
    if m.top_k > m.num_experts:
        errors.append(f"{prefix}.top_k ({m.top_k}) must be <= {prefix}.num_experts ({m.num_experts})")
    if m.score_func not in SCORE_FUNCS:
        errors.append(f"{prefix}.score_func={m.score_func!r} is not one of {', '.join(SCORE_FUNCS)}")
    if m.experts_impl not in EXPERT_IMPLS:
        errors.append(f"{prefix}.experts_impl={m.experts_impl!r} is not one of {', '.join(EXPERT_IMPLS)}")
    if m.num_groups < 1 or m.num_experts % m.num_groups or not 1 <= m.topk_groups <= m.num_groups:
        errors.append(
            f"{prefix}.num_groups ({m.num_groups}) must divide {prefix}.num_experts ({m.num_experts}) and "
            f"{prefix}.topk_groups ({m.topk_groups}) lie in 1..num_groups"
        )
    elif m.num_groups > 1 and m.topk_groups * m.num_experts // m.num_groups < m.top_k:
        errors.append(f"{prefix}.topk_groups ({m.topk_groups}) groups hold fewer than top_k ({m.top_k}) experts")
    if m.bias_update_rate < 0 or (m.bias_update_rate > 0 and not m.score_bias):
        errors.append(f"{prefix}.bias_update_rate ({m.bias_update_rate}) must be >= 0, and > 0 needs score_bias=true")
    if m.idle_expert_warning_steps < 0:
        errors.append(f"{prefix}.idle_expert_warning_steps must be >= 0 (0: never), got {m.idle_expert_warning_steps}")
    if m.capacity_factor is not None and m.capacity_factor <= 0:
        errors.append(f"{prefix}.capacity_factor must be > 0 (or null: no dropping), got {m.capacity_factor}")
    if min(m.aux_loss_coef, m.z_loss_coef, m.shared_ffn_dim) < 0 or m.routed_scaling <= 0:
        errors.append(f"{prefix}.aux_loss_coef, z_loss_coef, shared_ffn_dim must be >= 0 and routed_scaling > 0")
    if m.shared_expert_gate and not m.shared_ffn_dim:
        errors.append(f"{prefix}.shared_expert_gate needs a shared expert ({prefix}.shared_ffn_dim > 0)")
    return errors


class Routing(NamedTuple):
    logits: torch.Tensor
    """(tokens, experts) router logits, as transformers returns them (``output_router_logits``)."""
    probs: torch.Tensor
    """(tokens, experts) fp32 routing probabilities (softmax, or the sigmoid scores normalised per token)."""
    weights: torch.Tensor
    """(tokens, top_k) fp32 weight of each chosen expert."""
    indices: torch.Tensor
    """(tokens, top_k) the chosen experts."""


class Router(nn.Module):
    """Logits = linear(token), then the family's scores, choice and weights (see the module docstring)."""

    token_group = None
    """The tensor-parallel group whose ranks route different tokens with this router (module docstring)."""

    def __init__(self, cfg: MoEConfig, dim: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, dim))
        if cfg.score_bias:
            self.register_buffer("score_bias", torch.zeros(cfg.num_experts, dtype=torch.float32))
        else:
            self.score_bias = None

    def forward(self, x: torch.Tensor) -> Routing:
        cfg = self.cfg
        logits = F.linear(x, grad_summed(self.weight, self.token_group))
        if cfg.score_func == "softmax":
            scores = torch.softmax(logits.float(), dim=-1)
            probs = scores
        else:
            scores = torch.sigmoid(logits.float())
            probs = scores / scores.sum(dim=-1, keepdim=True)
        choice = scores.detach() if self.score_bias is None else scores.detach() + self.score_bias
        if cfg.num_groups > 1:
            choice = self._eligible_groups_only(choice)
        indices = torch.topk(choice, cfg.top_k, dim=-1).indices
        weights = scores.gather(1, indices)
        if cfg.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + (1e-20 if cfg.score_func == "sigmoid" else 0))
        return Routing(logits, probs, weights * cfg.routed_scaling, indices)

    def _eligible_groups_only(self, choice: torch.Tensor) -> torch.Tensor:
        """``choice`` with the experts outside each token's ``topk_groups`` best groups set to -inf; a group's
        score is the sum of its two best choice scores (DeepSeek-V3)."""
        tokens, groups = choice.shape[0], self.cfg.num_groups
        grouped = choice.view(tokens, groups, -1)
        group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(dim=-1)
        best = group_scores.topk(self.cfg.topk_groups, dim=-1).indices
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
        return grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(tokens, -1)


class SharedExpert(nn.Module):
    """The always-on SwiGLU expert(s) (Qwen2-MoE's shared_expert, DeepSeek-V3's shared_experts as one wide one),
    optionally scaled by sigmoid(gate(token))."""

    token_group = None
    """The tensor-parallel group whose ranks run it on different tokens (module docstring)."""

    def __init__(self, dim: int, ffn_dim: int, gated: bool) -> None:
        super().__init__()
        self.gate = nn.Linear(dim, ffn_dim, bias=False)
        self.up = nn.Linear(dim, ffn_dim, bias=False)
        self.down = nn.Linear(ffn_dim, dim, bias=False)
        self.output_gate = nn.Linear(dim, 1, bias=False) if gated else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        def linear(inputs: torch.Tensor, layer: nn.Linear) -> torch.Tensor:
            return F.linear(inputs, grad_summed(layer.weight, self.token_group))

        out = linear(F.silu(linear(x, self.gate)) * linear(x, self.up), self.down)
        return out if self.output_gate is None else torch.sigmoid(linear(x, self.output_gate)) * out


class RoutingStats(NamedTuple):
    """One MoE layer's routing on one batch: what its losses and the load logging need."""

    logits: torch.Tensor
    """(tokens, experts) router logits (this rank's tokens)."""
    tokens_per_expert: torch.Tensor
    """(experts,) assignments each expert was chosen for, before any capacity drop (int64, no gradient)."""
    prob_sum: torch.Tensor
    """(experts,) fp32 sum over tokens of the routing probabilities (carries the router's gradient)."""
    z_loss: torch.Tensor
    """() mean over tokens of logsumexp(logits)^2."""
    num_dropped: torch.Tensor
    """() assignments dropped by the capacity factor."""
    rows: int
    """Tokens the statistics above cover (all of the tensor-parallel group's, under tensor parallelism)."""


class MoEBlock(nn.Module):
    """(…, dim) -> (…, dim) and the layer's RoutingStats: the routed experts' weighted sum, plus the shared expert."""

    token_group = None
    """The tensor-parallel group whose ranks hold different tokens of the sequence (module docstring); None: all."""

    def __init__(self, cfg: MoEConfig, dim: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.router = Router(cfg, dim)
        self.experts = GroupedExperts(cfg.num_experts, dim, cfg.ffn_dim, cfg.experts_impl)
        self.shared = SharedExpert(dim, cfg.shared_ffn_dim, cfg.shared_expert_gate) if cfg.shared_ffn_dim else None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, RoutingStats]:
        tokens = x.reshape(-1, x.shape[-1])
        routing = self.router(tokens)
        route = dispatch(routing.indices, routing.weights, self.cfg.num_experts, self.cfg.capacity_factor)
        out = self.experts(tokens, route)
        if self.shared is not None:
            out = out + self.shared(tokens)
        return out.view(x.shape), self.routing_stats(routing, route.num_dropped)

    def routing_stats(self, routing: Routing, num_dropped: torch.Tensor) -> RoutingStats:
        """The layer's statistics over all the tokens of the group that routed them (summed over ``token_group``:
        one process's numbers; the gradients of the sums reach each rank's own terms unchanged)."""
        load = summed_over(expert_counts(routing.indices.reshape(-1), self.cfg.num_experts), self.token_group)
        prob_sum = summed_over(routing.probs.sum(dim=0), self.token_group)
        z_sum = summed_over(torch.logsumexp(routing.logits.float(), dim=-1).square().sum(), self.token_group)
        rows = routing.logits.shape[0] * (1 if self.token_group is None else dist.get_world_size(self.token_group))
        return RoutingStats(routing.logits, load, prob_sum, z_sum / rows, num_dropped, rows)

    @torch.no_grad()
    def update_score_bias(self, tokens_per_expert: torch.Tensor) -> None:
        """DeepSeek-V3's auxiliary-loss-free step: each expert's bias rises by ``bias_update_rate`` if it got fewer
        than the mean load, falls if more. ``tokens_per_expert`` must be the same on every rank (summed over the
        step's micro-batches and the data-parallel ranks), so the biases stay identical everywhere."""
        if self.router.score_bias is None or self.cfg.bias_update_rate == 0:
            return
        load = tokens_per_expert.float()
        self.router.score_bias.add_(torch.sign(load.mean() - load), alpha=self.cfg.bias_update_rate)


def load_balancing_loss(stats: Sequence[RoutingStats]) -> torch.Tensor:
    """Switch Transformer's loss over the layers' ``stats``, pooled as transformers' ``load_balancing_loss_func``:
    num_experts * sum_i (assignments_i / rows) * (prob_sum_i / rows), rows = tokens x layers."""
    rows = sum(s.rows for s in stats)
    load = torch.stack([s.tokens_per_expert for s in stats]).sum(dim=0).float() / rows
    probs = torch.stack([s.prob_sum for s in stats]).sum(dim=0) / rows
    return load.numel() * torch.sum(load * probs)


def auxiliary_loss(stats: Sequence[RoutingStats], cfg: MoEConfig) -> torch.Tensor:
    """What the MoE layers add to the training loss: aux_loss_coef x the balancing loss + z_loss_coef x the mean
    z-loss; zero (with the router's graph, so every rank's backward is the same) when both are 0."""
    total = stats[0].prob_sum.sum() * 0.0
    if cfg.aux_loss_coef:
        total = total + cfg.aux_loss_coef * load_balancing_loss(stats)
    if cfg.z_loss_coef:
        total = total + cfg.z_loss_coef * torch.stack([s.z_loss for s in stats]).mean()
    return total


def load_summary(tokens_per_expert: torch.Tensor) -> dict[str, float]:
    """Scalars to log for one layer's load: max/mean (1 = balanced, num_experts/top_k = collapsed) and the experts
    that got nothing."""
    load = tokens_per_expert.float()
    mean = load.mean().clamp(min=1e-9)
    return {"max_over_mean": float(load.max() / mean), "idle_experts": int((load == 0).sum())}


SHARED_INPUT_WEIGHTS = ("shared.gate.weight", "shared.up.weight", "shared.output_gate.weight")


def init_moe_tensor(
    name: str, tensor: torch.Tensor, generator: torch.Generator, std: float, residual_std: float
) -> bool:
    """Initialise ``name`` if it belongs to an MoE block (True), as Llama.init_tensor would: N(0, std), the
    projections back into the residual stream (experts' and shared down) N(0, residual_std), the score bias 0."""
    if name.endswith("router.score_bias"):
        tensor.zero_()
    elif name.endswith(("experts.down_proj", "shared.down.weight")):
        tensor.normal_(0.0, residual_std, generator=generator)
    elif name.endswith(("experts.gate_up_proj", "router.weight", *SHARED_INPUT_WEIGHTS)):
        tensor.normal_(0.0, std, generator=generator)
    else:
        return False
    return True
