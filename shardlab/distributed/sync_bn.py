"""Synchronized BatchNorm: normalize with the statistics of the whole global batch, on CUDA and on CPU/gloo.

torch.nn.SyncBatchNorm needs CUDA kernels (batch_norm_stats, batch_norm_gather_stats_with_counts, ...). The module
here computes the same global statistics with plain tensor ops and autograd-aware collectives, so it runs on gloo:

- forward: each rank's (mean, biased variance, count) per channel is gathered from every rank of the group and
  combined with Chan's parallel formula, as batch_norm_gather_stats_with_counts does (ranks with an empty batch drop
  out through their zero count); the running mean takes the global mean, the running variance the unbiased global
  variance, with the module's momentum.
- backward: the gather is an all-reduce of one-row-per-rank tensors, whose backward is an all-reduce of the
  gradients (torch's functional collectives are differentiable). Autograd then gives each rank d(sum of all ranks'
  losses)/d(its input): what the sum_dy / sum_dy_xmu all-reduce of torch's hand-written backward computes. Weight
  and bias gradients stay local, to be reduced with every other gradient by DDP or FSDP.

``convert_sync_batchnorm(model, group_size)`` picks torch's module where its kernels run (nccl) and this one
elsewhere, over all ranks (0) or groups of ``group_size`` consecutive ranks.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

from shardlab.errors import ConfigError


def sync_batch_norm(
    x: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    running_mean: Tensor | None,
    running_var: Tensor | None,
    eps: float,
    momentum: float,
    group: dist.ProcessGroup,
) -> Tensor:
    """Training-mode batch norm of ``x`` (N, C, ...) over the union of the batches of ``group``'s ranks."""
    channels = x.size(1)
    dims = [0, *range(2, x.dim())]
    # Statistics in fp32 for low-precision inputs, as torch's kernels accumulate; float64 stays float64 (the
    # world-size parity test runs in it, docs/vision.md).
    x32 = x.to(torch.promote_types(x.dtype, torch.float32))
    count = x.numel() // channels
    if count > 0:
        var, mean = torch.var_mean(x32, dim=dims, correction=0)
        local = torch.cat([mean, var, mean.new_full((1,), float(count))])
    else:  # an empty batch still joins the collective, with zero weight
        local = x32.new_zeros(2 * channels + 1)
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    rows = [local if r == rank else torch.zeros_like(local) for r in range(world)]
    # An all-gather done as an all-reduce of one-row-per-rank tensors: the collective every backend has, and its
    # functional form is differentiable (backward: all-reduce of the gradients). world x (2C + 1) floats per BN is
    # nothing at the few-rank scale this module serves; CUDA runs take torch's module.
    gathered = funcol.all_reduce(torch.stack(rows), "sum", group)
    means, variances, counts = gathered.split([channels, channels, 1], dim=1)
    total = counts.sum()
    global_mean = (counts * means).sum(0) / total
    global_var = (counts * (variances + (means - global_mean) ** 2)).sum(0) / total
    if running_mean is not None and running_var is not None:
        with torch.no_grad():
            unbiased = global_var * (total / (total - 1).clamp(min=1))
            running_mean.mul_(1 - momentum).add_(global_mean.to(running_mean.dtype), alpha=momentum)
            running_var.mul_(1 - momentum).add_(unbiased.to(running_var.dtype), alpha=momentum)
    shape = [1, channels] + [1] * (x.dim() - 2)
    y = (x32 - global_mean.view(shape)) * torch.rsqrt(global_var + eps).view(shape)
    if weight is not None:
        y = y * weight.to(x32.dtype).view(shape)
    if bias is not None:
        y = y + bias.to(x32.dtype).view(shape)
    return y.to(x.dtype)


class SyncBatchNorm(_BatchNorm):
    """BatchNorm over the global batch of a process group, for any device (used on CPU/gloo).

    Same arguments and state as torch.nn.SyncBatchNorm; in eval mode, or without a process group of more than one
    rank, it is plain batch norm.
    """

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        process_group: dist.ProcessGroup | None = None,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device=device, dtype=dtype)
        self.process_group = process_group

    def _check_input_dim(self, input: Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def forward(self, input: Tensor) -> Tensor:
        self._check_input_dim(input)
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats:
            self.num_batches_tracked.add_(1)
            factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        bn_training = self.training or (self.running_mean is None and self.running_var is None)
        track = not self.training or self.track_running_stats
        running_mean = self.running_mean if track else None
        running_var = self.running_var if track else None
        group = self.process_group or (dist.group.WORLD if dist.is_available() and dist.is_initialized() else None)
        if not (bn_training and self.training and group is not None and dist.get_world_size(group) > 1):
            return F.batch_norm(input, running_mean, running_var, self.weight, self.bias, bn_training, factor, self.eps)
        return sync_batch_norm(input, self.weight, self.bias, running_mean, running_var, self.eps, factor, group)


def process_group_for(group_size: int, key: str = "model.sync_bn_group_size") -> dist.ProcessGroup | None:
    """The group this rank's BN statistics are shared in: all ranks (0), or ``group_size`` consecutive ranks;
    None when there is nothing to share (one rank, or groups of one). Collective: every rank must call it."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    world = dist.get_world_size()
    if group_size < 0 or group_size > world or (group_size and world % group_size):
        raise ConfigError(
            f"{key} ({group_size}) must divide the world size ({world}); use 0 to share BN statistics over all ranks"
        )
    if group_size in (0, world):
        return dist.group.WORLD if world > 1 else None
    if group_size == 1:
        return None
    subgroup, _ = dist.new_subgroups(group_size=group_size)
    return subgroup


def convert_sync_batchnorm(module: nn.Module, group_size: int = 0) -> nn.Module:
    """``module`` with every BatchNorm replaced by a synchronized one sharing statistics within ``group_size`` ranks
    (0 = all): torch.nn.SyncBatchNorm on nccl (CUDA), shardlab's SyncBatchNorm elsewhere. Call it on every rank
    after the process group exists (it may create subgroups); a no-op on one rank."""
    group = process_group_for(group_size)
    if group is None:
        return module
    # The CUDA process group maps cuda to nccl (and cpu to gloo): torch's module then runs on the CUDA tensors.
    if torch.cuda.is_available() and "cuda:nccl" in dist.get_backend_config(group):
        return nn.SyncBatchNorm.convert_sync_batchnorm(module, group)
    return _convert(module, group)


def _convert(module: nn.Module, group: dist.ProcessGroup) -> nn.Module:
    """torch's convert_sync_batchnorm, with shardlab's module: same parameters and buffers (shared, not copied)."""
    out = module
    if isinstance(module, _BatchNorm) and not isinstance(module, (SyncBatchNorm, nn.SyncBatchNorm)):
        out = SyncBatchNorm(
            module.num_features, module.eps, module.momentum, module.affine, module.track_running_stats, group
        )
        if module.affine:
            out.weight, out.bias = module.weight, module.bias
        out.running_mean, out.running_var = module.running_mean, module.running_var
        out.num_batches_tracked = module.num_batches_tracked
        out.training = module.training
    for name, child in module.named_children():
        out.add_module(name, _convert(child, group))
    return out
