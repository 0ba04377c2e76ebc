"""A gradient scaler for sharded (DTensor) gradients.

torch.amp.GradScaler checks each gradient for inf/nan, but a rank holds only its shards: one rank may overflow while
another does not, and ranks that disagree on skipping a step drift apart. This scaler unscales the local shards, then
all-reduces "found inf" (max) so every rank skips the same steps. (torch's FSDP1 ShardedGradScaler keeps a found-inf
of shape [1], which the fused Adam kernels reject; this one keeps torch's scalar.)
"""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


class ShardedGradScaler(torch.amp.GradScaler):
    def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16):
        grads_by_device: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = defaultdict(list)
        for group in optimizer.param_groups:
            for param in group["params"]:
                if param.grad is None:
                    continue
                grad = param.grad.to_local() if isinstance(param.grad, DTensor) else param.grad
                if not allow_fp16 and grad.dtype == torch.float16:
                    raise ValueError("Attempting to unscale FP16 gradients.")
                grads_by_device[(grad.device, grad.dtype)].append(grad)
        found_by_device: dict[torch.device, torch.Tensor] = {}
        with torch.no_grad():
            for (device, _), grads in grads_by_device.items():
                found = found_by_device.setdefault(device, torch.zeros_like(found_inf, device=device))
                torch._amp_foreach_non_finite_check_and_unscale_(grads, found, inv_scale.to(device))
            if not found_by_device:  # a rank without any shard still takes part in the vote
                found_by_device[found_inf.device] = found_inf
            if dist.is_initialized():
                for found in found_by_device.values():
                    dist.all_reduce(found, op=dist.ReduceOp.MAX)
        return found_by_device
