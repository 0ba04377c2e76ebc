"""lars: SGD with momentum and a layer-wise trust ratio (You et al., 2017), the optimizer of SimCLR and SwAV.

The rule, per parameter w with gradient g (the LARC form that SwAV and VISSL use through apex, and timm's Lars):

    adapted (matrices and kernels):  g <- (g + wd * w) * eta * |w| / (|g| + wd * |w| + eps)   (x 1 if |w| or |g| is 0)
    excluded (biases, norms; optimizer.exclude_norm_and_bias):  g unchanged (no weight decay, no adaptation)
    buf <- momentum * buf + g;   w <- w - lr * (g + momentum * buf if nesterov else buf)

|w| and |g| are norms of the whole parameter. Under fully_sharded each rank holds a shard (a DTensor): the norms are
taken from the local shards' sums of squares, all-reduced over the mesh dimensions the parameter is sharded on, in one
collective per group of parameters with the same mesh and placements (not one per parameter); everything else is
elementwise on the local shards, as cpu_adam does, so cpu_offload's CPU shards step where they live. The momentum
buffer has the parameter's type (a DTensor for a DTensor), so DCP reshards it with the weights.

Why our own: torch has no LARS; timm's (the one well-kept implementation) takes each norm of a DTensor with its own
collective and would make timm a dependency for forty lines.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from shardlab.config import OptimizerConfig
from shardlab.distributed.torch_internals import local_shard


def global_norms(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The L2 norm of each (possibly sharded) tensor over all its shards: one all-reduce of the local sums of squares
    per mesh dimension a group of same-placed DTensors is sharded on."""
    squares = torch.zeros(len(tensors), dtype=torch.float32, device=local_shard(tensors[0]).device)
    placed: dict[tuple, list[int]] = {}
    for i, t in enumerate(tensors):
        squares[i] = local_shard(t).float().pow(2).sum()
        if isinstance(t, DTensor):
            placed.setdefault((t.device_mesh, tuple(t.placements)), []).append(i)
    for (mesh, placements), indices in placed.items():
        index = torch.tensor(indices, device=squares.device)
        part = squares.index_select(0, index)
        for dim, placement in enumerate(placements):
            if isinstance(placement, Shard) and mesh.size(dim) > 1:
                dist.all_reduce(part, group=mesh.get_group(dim))
        squares.index_copy_(0, index, part)
    return squares.sqrt()


class LARS(torch.optim.Optimizer):
    """LARS over plain or sharded (DTensor) parameters; a group with ``adapt=False`` is plain SGD with momentum."""

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float,
        momentum: float = 0.9,
        weight_decay: float = 0.0,
        trust_coefficient: float = 1e-3,
        eps: float = 1e-8,
        nesterov: bool = False,
    ) -> None:
        if lr < 0 or momentum < 0 or weight_decay < 0 or trust_coefficient <= 0 or eps < 0:
            raise ValueError(
                f"invalid LARS hyper-parameters: lr={lr}, momentum={momentum}, weight_decay={weight_decay}, "
                f"trust_coefficient={trust_coefficient}, eps={eps}"
            )
        defaults = {
            "lr": lr,
            "momentum": momentum,
            "weight_decay": weight_decay,
            "trust_coefficient": trust_coefficient,
            "eps": eps,
            "nesterov": nesterov,
            "adapt": True,
        }
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            if group["momentum"]:
                # Every parameter gets its buffer at the first step, also one without a gradient (frozen, e.g. SwAV's
                # prototypes early on): a checkpoint then holds the same keys whatever was frozen when it was saved,
                # which the resume's freshly built optimizer (DCP initialises all of its state) expects.
                for p in group["params"]:
                    if p.requires_grad and "momentum_buffer" not in self.state[p]:
                        self.state[p]["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            params = [p for p in group["params"] if p.grad is not None]
            if params:
                self._step_group(group, params)
        return loss

    def _step_group(self, group: dict[str, Any], params: list[torch.Tensor]) -> None:
        lr, momentum, wd = group["lr"], group["momentum"], group["weight_decay"]
        adapt = group["adapt"]
        if adapt:  # one trust ratio per parameter, kept on the device (no host sync)
            norms = global_norms([*params, *(p.grad for p in params)])
            w_norm, g_norm = norms[: len(params)], norms[len(params) :]
            ratio = group["trust_coefficient"] * w_norm / (g_norm + wd * w_norm + group["eps"])
            trust = torch.where((w_norm > 0) & (g_norm > 0), ratio, torch.ones_like(ratio))
        for i, p in enumerate(params):
            w, g = local_shard(p), local_shard(p.grad)
            if adapt:
                update = g.add(w, alpha=wd) if wd else g.clone()
                update.mul_(trust[i].to(update.dtype))
            else:
                update = g.clone()
            if momentum:
                buf = local_shard(self.state[p]["momentum_buffer"])
                buf.mul_(momentum).add_(update)
                update = update.add(buf, alpha=momentum) if group["nesterov"] else buf
            w.add_(update, alpha=-lr)


def lars_groups(model: nn.Module, cfg: OptimizerConfig) -> list[dict]:
    """Matrices and kernels adapted and decayed; biases and norm weights (1-D) neither, when exclude_norm_and_bias."""
    params = [p for p in model.parameters() if p.requires_grad]
    if not cfg.exclude_norm_and_bias:
        return [{"params": params}]
    return [
        {"params": [p for p in params if p.ndim >= 2]},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0, "adapt": False},
    ]


def build_lars(model: nn.Module, cfg: OptimizerConfig) -> torch.optim.Optimizer:
    return LARS(
        lars_groups(model, cfg),
        lr=cfg.lr,
        momentum=cfg.momentum,
        weight_decay=cfg.weight_decay,
        trust_coefficient=cfg.trust_coefficient,
        eps=cfg.eps,
        nesterov=cfg.nesterov and cfg.momentum > 0,
    )
