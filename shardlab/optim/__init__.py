"""Optimizers and learning-rate schedules by name (optimizer.name, lr_scheduler.name).

- ``optimizers``: adamw and sgd from torch, and the parameter groups (no weight decay on norms and biases).
- ``cpu_adam``: AdamW stepped on the local shards of CPU-offloaded parameters.
- ``schedules``: linear warmup, then cosine, inverse_sqrt or constant.

This module registers them in OPTIMIZERS and LR_SCHEDULERS with their schemas (``schema/optimizer/<name>``,
``schema/lr_scheduler/<name>``, named by conf/optimizer/*.yaml and conf/lr_scheduler/*.yaml). It is light on purpose:
it is imported at start-up, before the config composes, and each factory imports its implementation (and torch) when
first called.
"""

from __future__ import annotations

from shardlab.config import LRSchedulerConfig, OptimizerConfig
from shardlab.registry import LR_SCHEDULERS, OPTIMIZERS

__all__ = ["LR_SCHEDULERS", "OPTIMIZERS"]


@OPTIMIZERS.register("adamw", dataclass=OptimizerConfig)
def adamw(model, cfg: OptimizerConfig):
    from shardlab.optim.optimizers import build_adamw

    return build_adamw(model, cfg)


@OPTIMIZERS.register("sgd", dataclass=OptimizerConfig)
def sgd(model, cfg: OptimizerConfig):
    from shardlab.optim.optimizers import build_sgd

    return build_sgd(model, cfg)


@OPTIMIZERS.register("cpu_adam", dataclass=OptimizerConfig)
def cpu_adam(model, cfg: OptimizerConfig):
    from shardlab.optim.cpu_adam import build_cpu_adam

    return build_cpu_adam(model, cfg)


def warmup_then_decay(optimizer, cfg: LRSchedulerConfig, max_steps: int):
    """Every built-in schedule: linear warmup, then the decay lr_scheduler.name names."""
    from shardlab.optim.schedules import build_schedule

    return build_schedule(optimizer, cfg, max_steps)


for _name in ("cosine", "inverse_sqrt", "constant"):
    LR_SCHEDULERS.register(_name, dataclass=LRSchedulerConfig)(warmup_then_decay)
