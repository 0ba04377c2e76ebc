"""cpu_adam: AdamW for parameters whose (local shards) live on the CPU, e.g. under distributed.cpu_offload=true.

What it does: torch's fused AdamW kernel (``torch._fused_adamw_``), called once per (group, dtype) on the *local*
tensors of the parameters, gradients and moments. FSDP2's parameters are DTensors, and a DTensor op goes through
DTensor's sharding propagation once per tensor (~50-80 us each, measured); Adam is elementwise, so the local shards
are all it needs and that overhead goes. The math is torch.optim.AdamW's (same kernel), and so is the state layout
(``step``, ``exp_avg``, ``exp_avg_sq`` per parameter, DTensors for DTensor parameters), so checkpoints move between
optimizer=adamw and optimizer=cpu_adam and DCP still reshards them to another world size.

Why not something faster: the fused kernel streams 28 bytes per fp32 parameter (read param, grad, m, v; write
param, m, v) at this machine's memory bandwidth (~21 GB/s on one core, the same as ``Tensor.addcmul_``), so a better
kernel has nothing left to win. One flat buffer per group measured 1.3-1.6x slower, because autograd and FSDP2
allocate gradients per tensor and they must be copied in; even with gradients already flat it gained 0-15%.
DeepSpeed's CPUAdam was measured 1.15x slower than the fused kernel on this machine (a new dependency: not kept).
On gpt_small, 2 ranks, fully_sharded + cpu_offload, the optimizer step took 31.8 ms with optimizer=adamw (fused) and
22.5 ms with cpu_adam; shardlab_bench/cpu_adam.py times every candidate.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from shardlab.config import OptimizerConfig
from shardlab.distributed.torch_internals import local_shard
from shardlab.errors import ConfigError
from shardlab.optim.optimizers import param_groups


class CPUAdam(torch.optim.Optimizer):
    """AdamW (decoupled weight decay, as torch.optim.AdamW) over CPU parameters, stepped on their local shards.

    Parameters on another device raise a ConfigError: on a GPU, torch's fused CUDA AdamW is the right kernel, and a
    CPU step over GPU tensors would not run at all. ``names`` (parameter -> dotted name) only improves that message.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        names: dict[torch.Tensor, str] | None = None,
    ) -> None:
        if lr < 0 or eps < 0 or weight_decay < 0 or not all(0 <= b < 1 for b in betas):
            raise ValueError(f"invalid CPUAdam hyper-parameters: lr={lr}, betas={betas}, eps={eps}, wd={weight_decay}")
        self._names = {id(p): n for p, n in (names or {}).items()}
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay})

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        for i, p in enumerate(self.param_groups[-1]["params"]):
            device = local_shard(p).device
            if device.type != "cpu":
                name = self._names.get(id(p), f"parameter {i} of group {len(self.param_groups) - 1}")
                raise ConfigError(
                    f"optimizer.name=cpu_adam steps parameters on the CPU, but {name} is on {device}; "
                    "set distributed.cpu_offload=true (with distributed.backend=fully_sharded) or use optimizer=adamw"
                )

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            lr = group["lr"]
            lr = float(lr) if isinstance(lr, torch.Tensor) else lr
            # One kernel call per dtype: the fused kernel takes lists but needs one dtype per list.
            buckets: dict[torch.dtype, tuple[list, list, list, list, list]] = {}
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("cpu_adam does not support sparse gradients")
                state = self.state[p]
                if not state:  # torch.optim.AdamW's layout, so state dicts are interchangeable
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                param = local_shard(p)
                grad = local_shard(p.grad)
                if grad.dtype != param.dtype:
                    grad = grad.to(param.dtype)
                lists = buckets.setdefault(param.dtype, ([], [], [], [], []))
                lists[0].append(param)
                lists[1].append(grad)
                lists[2].append(local_shard(state["exp_avg"]))
                lists[3].append(local_shard(state["exp_avg_sq"]))
                lists[4].append(state["step"])
            for params, grads, exp_avgs, exp_avg_sqs, steps in buckets.values():
                torch._foreach_add_(steps, 1)
                torch._fused_adamw_(
                    params,
                    grads,
                    exp_avgs,
                    exp_avg_sqs,
                    [],
                    steps,
                    lr=lr,
                    beta1=beta1,
                    beta2=beta2,
                    weight_decay=group["weight_decay"],
                    eps=group["eps"],
                    amsgrad=False,
                    maximize=False,
                )
        return loss


def build_cpu_adam(model: nn.Module, cfg: OptimizerConfig) -> CPUAdam:
    """optimizer=cpu_adam: the groups and hyper-parameters of optimizer=adamw; ``implementation`` does not apply."""
    names = {p: n for n, p in model.named_parameters()}
    return CPUAdam(
        param_groups(model, cfg),
        lr=cfg.lr,
        betas=tuple(cfg.betas),
        eps=cfg.eps,
        weight_decay=cfg.weight_decay,
        names=names,
    )
