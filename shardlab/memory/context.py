"""Everything besides the layout that a plan's bytes depend on (``PlanContext``): the world, the device planned for,
the dtypes, the optimizer's state per parameter as its registration declares it, accumulation and prefetch.
"""

from __future__ import annotations

from dataclasses import dataclass

from shardlab.memory import devices
from shardlab.registry import OPTIMIZERS

UNDECLARED_STATE_TENSORS = 2
"""What an optimizer whose registration declares no ``state_tensors`` is planned with: Adam's two moments (the plan
says so in a warning)."""


@dataclass(frozen=True)
class PlanContext:
    """Everything besides the layout that the bytes depend on."""

    world_size: int
    ranks_per_node: int
    device: str
    """cpu or cuda: the kind of device planned for (on CPU, offloaded state shares the memory it was moved from)."""
    param_bytes: int
    """Bytes per gathered parameter and activation element (distributed.param_dtype)."""
    reduce_bytes: int
    optimizer_state_bytes: int
    """fp32 bytes of optimizer state per trainable parameter element: 4 per tensor its registration declares
    (shardlab.registry.Registry.state_tensors), plus the EMA's copy."""
    update_freq: int = 1
    reduce_every_microbatch: bool = True
    prefetch_units: int = 0
    offload_activations: bool = False
    target: str = "cpu"
    """distributed.plan_device as resolved: cpu, cuda (this machine's GPU) or a name of devices.DEVICES."""
    capacity: int = 0
    """The target's memory per rank, bytes (0: unknown)."""
    local: bool = True
    """Whether the target is this machine's own device (else no trial can run on it: backend=auto plans only)."""
    undeclared_optimizer: str | None = None
    """The optimizer's name where its registration declares no state per parameter (planned as
    UNDECLARED_STATE_TENSORS); else None."""

    @classmethod
    def from_config(
        cls, cfg, world_size: int, ranks_per_node: int, device: str, target: str | None = None, capacity: int = 0
    ) -> PlanContext:
        """``device``: cpu or cuda; ``target``: the plan_device it stands for (default: ``device`` itself, here)."""
        from shardlab.distributed.base import resolve_dtypes

        d, opt = cfg.distributed, cfg.optimizer
        param, reduce = resolve_dtypes(d)
        tensors = OPTIMIZERS.state_tensors(opt.name, opt)  # as the optimizer's registration declares
        state = 4 * (UNDECLARED_STATE_TENSORS if tensors is None else tensors)
        ema = getattr(cfg.optimization, "ema", None)
        if ema is not None and ema.enabled:  # optimization.ema: an fp32 average beside each local parameter shard
            state += 4
        return cls(
            world_size=world_size,
            ranks_per_node=max(1, min(ranks_per_node, world_size)),
            device=device,
            param_bytes=param.itemsize,
            reduce_bytes=reduce.itemsize,
            optimizer_state_bytes=state,
            update_freq=cfg.optimization.update_freq,
            reduce_every_microbatch=d.reduce_every_microbatch,
            prefetch_units=d.prefetch_units,
            offload_activations=d.offload_activations,
            target=target or device,
            capacity=capacity,
            local=target is None or target in devices.LOCAL,
            undeclared_optimizer=opt.name if tensors is None else None,
        )
