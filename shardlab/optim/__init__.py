"""Optimizers and learning-rate schedules by name (optimizer.name, lr_scheduler.name).

- ``optimizers``: adamw and sgd from torch, and the parameter groups (no weight decay on norms and biases).
- ``cpu_adam``: AdamW stepped on the local shards of CPU-offloaded parameters.
- ``lars``: SGD with momentum and a layer-wise trust ratio over plain or sharded parameters (SimCLR, SwAV).
- ``schedules``: linear warmup, then cosine, inverse_sqrt or constant.
- ``divergence``: a loss not finite for optimization.max_nonfinite_steps steps, weights not finite before a save.

This module registers them in OPTIMIZERS (each with the state it keeps per parameter, for the memory plan) and
LR_SCHEDULERS with their schemas (``schema/optimizer/<name>``, ``schema/lr_scheduler/<name>``, named by
conf/optimizer/*.yaml and conf/lr_scheduler/*.yaml). It is light on purpose: it is imported at start-up, before the
config composes, and each factory's module (and torch) is imported when the factory is first used (``register_lazy``).
"""

from __future__ import annotations

from shardlab.config import LRSchedulerConfig, OptimizerConfig
from shardlab.registry import LR_SCHEDULERS, OPTIMIZERS

__all__ = ["LR_SCHEDULERS", "OPTIMIZERS"]


def momentum_buffers(cfg: OptimizerConfig) -> int:
    """sgd's and lars' state per parameter: one fp32 momentum buffer when momentum is on, none without."""
    return 1 if cfg.momentum > 0 else 0


# state_tensors: what each keeps per parameter, which the memory plan counts (Adam: its two moments).
OPTIMIZERS.register_lazy("adamw", "shardlab.optim.optimizers:build_adamw", dataclass=OptimizerConfig, state_tensors=2)
OPTIMIZERS.register_lazy(
    "sgd", "shardlab.optim.optimizers:build_sgd", dataclass=OptimizerConfig, state_tensors=momentum_buffers
)
OPTIMIZERS.register_lazy(
    "cpu_adam", "shardlab.optim.cpu_adam:build_cpu_adam", dataclass=OptimizerConfig, state_tensors=2
)
OPTIMIZERS.register_lazy(
    "lars", "shardlab.optim.lars:build_lars", dataclass=OptimizerConfig, state_tensors=momentum_buffers
)
for _name in ("cosine", "inverse_sqrt", "constant"):  # one factory: linear warmup, then the decay the name says
    LR_SCHEDULERS.register_lazy(_name, "shardlab.optim.schedules:build_schedule", dataclass=LRSchedulerConfig)
