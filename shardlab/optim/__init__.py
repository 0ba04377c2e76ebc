"""Optimizers and learning-rate schedules by name (optimizer.name, lr_scheduler.name).

- ``optimizers``: adamw and sgd from torch, and the parameter groups (no weight decay on norms and biases).
- ``cpu_adam``: AdamW stepped on the local shards of CPU-offloaded parameters.
- ``lars``: SGD with momentum and a layer-wise trust ratio over plain or sharded parameters (SimCLR, SwAV).
- ``schedules``: linear warmup, then cosine, inverse_sqrt or constant.

Importing the package registers all of them in OPTIMIZERS and LR_SCHEDULERS.
"""

from __future__ import annotations

from shardlab.optim import cpu_adam, lars, optimizers, schedules
from shardlab.optim.cpu_adam import CPUAdam
from shardlab.optim.lars import LARS
from shardlab.optim.optimizers import param_groups
from shardlab.optim.schedules import lr_lambda
from shardlab.registry import LR_SCHEDULERS, OPTIMIZERS

__all__ = [
    "CPUAdam",
    "LARS",
    "LR_SCHEDULERS",
    "OPTIMIZERS",
    "cpu_adam",
    "lars",
    "lr_lambda",
    "optimizers",
    "param_groups",
    "schedules",
]
