"""DistributedDataParallel: every rank holds the whole model; gradients are all-reduced in buckets."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence

import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from shardlab.distributed.activation_checkpointing import checkpoint_units
from shardlab.distributed.base import Backend, refuse_tensor_parallel
from shardlab.registry import BACKENDS


@BACKENDS.register("ddp")
class DDPBackend(Backend):
    name = "ddp"

    def parallelize(
        self,
        model: nn.Module,
        units: list[nn.Module],
        materialize: Callable[[nn.Module], None],
        full_precision_modules: Sequence[nn.Module] = (),
        tensor_parallel_plan: dict | None = None,
        expert_modules: Sequence[nn.Module] = (),
        recomputed: Sequence[int] | None = None,
    ) -> nn.Module:
        refuse_tensor_parallel(self.name, tensor_parallel_plan, expert_modules)
        materialize(model)
        units = checkpoint_units(model, units, self.cfg, recomputed)
        self.compile_units(units or [model])
        ddp = DistributedDataParallel(model, device_ids=[self.device.index] if self.device.type == "cuda" else None)
        # Reduce in the configured dtype: DDP's compression hooks cast each bucket before the all-reduce.
        if self.reduce_dtype == torch.float16:
            ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
        elif self.reduce_dtype == torch.bfloat16:
            ddp.register_comm_hook(None, default_hooks.bf16_compress_hook)
        return ddp

    def grad_sync(self, model: nn.Module, is_last_microbatch: bool) -> contextlib.AbstractContextManager:
        if is_last_microbatch or self.cfg.reduce_every_microbatch:
            return contextlib.nullcontext()
        return model.no_sync()
