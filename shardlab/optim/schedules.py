"""Learning-rate schedules: linear warmup, then a cosine, inverse-sqrt or constant decay (registered by name,
lr_scheduler.name, in shardlab/optim/__init__.py). The scheduler's state is saved with the training state
(shardlab.train_state)."""

from __future__ import annotations

import math

import torch

from shardlab.config import LRSchedulerConfig


def lr_lambda(cfg: LRSchedulerConfig, max_steps: int):
    """Multiplier of the peak lr at a step: linear warmup, then the named decay."""
    warmup = warmup_steps(cfg, max_steps)

    def warm(step: int) -> float | None:
        return (step + 1) / (warmup + 1) if step < warmup else None

    if cfg.name == "constant":
        return lambda step: warm(step) or 1.0
    if cfg.name == "inverse_sqrt":
        return lambda step: warm(step) or math.sqrt(max(warmup, 1) / max(step, 1))

    def cosine(step: int) -> float:
        w = warm(step)
        if w is not None:
            return w
        progress = min(1.0, (step - warmup) / max(1, max_steps - warmup))
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return cosine


def warmup_steps(cfg: LRSchedulerConfig, max_steps: int) -> int:
    """The warm-up a run of ``max_steps`` uses: lr_scheduler.warmup_steps, clipped to the run. One rule for every task,
    so a short try (optimization.max_steps=20) runs with any task's default warm-up (clipped_warmup_line says so)."""
    return min(cfg.warmup_steps, max_steps)


def clipped_warmup_line(cfg: LRSchedulerConfig, max_steps: int) -> str | None:
    """The one line a run whose warm-up was clipped prints at its start; None when it was not."""
    if cfg.warmup_steps <= max_steps:
        return None
    return (
        f"[lr] lr_scheduler.warmup_steps={cfg.warmup_steps} is longer than the run "
        f"(optimization.max_steps={max_steps}): warming up over all {max_steps} steps "
        f"(set lr_scheduler.warmup_steps=N below {max_steps} for a decay)"
    )


def build_schedule(optimizer, cfg: LRSchedulerConfig, max_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg, max_steps))
