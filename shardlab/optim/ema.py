"""optimization.ema: an exponential moving average of the model's parameters, kept where the parameters are.

Each rank averages the parameter tensors it holds: under fully_sharded its own shards (the DTensors' local tensors),
so an update is one fused lerp over local memory and gathers nothing; under ddp and single the whole parameters. The
average is fp32 whatever the parameters' dtype. It is saved through DCP beside the model, as ``ema.<name>`` with the
names of ``model.<name>`` (DTensors under fully_sharded), so a resume restores it exactly and on another world size
reshards it like the weights. Validation (validation.ema), shardlab-export --ema and a teacher network read it.

Parameters only: buffers (BatchNorm statistics) are the model's own wherever the average is used.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch
from torch import Tensor, nn

from shardlab.config import EMAConfig
from shardlab.distributed.materialize import clean_name


def _local(t: Tensor) -> Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _fp32_copy(param: Tensor) -> Tensor:
    """An fp32 copy of ``param`` placed as it is: a DTensor with the same mesh, placements and global shape."""
    local = _local(param).detach().to(torch.float32, copy=True)
    if not hasattr(param, "to_local"):
        return local
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(
        local, param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride()
    )


def ema_decay(cfg: EMAConfig, step: int, max_steps: int) -> float:
    """The decay of the update after optimizer step ``step`` (0-based): optimization.ema.decay, or under
    schedule=cosine the half cosine from decay at start_step to final_decay at max_steps (DINO's momentum schedule)."""
    if cfg.schedule == "constant":
        return cfg.decay
    progress = (step - cfg.start_step) / max(1, max_steps - cfg.start_step)
    return cfg.final_decay - (cfg.final_decay - cfg.decay) * (1 + math.cos(math.pi * min(progress, 1.0))) / 2


class WeightAverage:
    """The moving average of ``model``'s parameters (optimization.ema), built after the model is sharded and
    materialized. Stateful: ``state_dict`` gives {name: average} for DCP (tied parameters under each of their names,
    as the model's state dict lists them), ``load_state_dict`` reads it back in place."""

    def __init__(self, model: nn.Module, cfg: EMAConfig, max_steps: int) -> None:
        self.cfg, self.max_steps = cfg, max_steps
        self.params: list[Tensor] = []
        """The model's parameters, each once: FSDP2 keeps the sharded objects (it swaps in gathered ones during a
        forward), so reading them through these references always sees this rank's shards."""
        self.index: dict[str, int] = {}
        """Each parameter name (wrapper prefixes removed, as in the model's state dict) -> its place in params."""
        seen: dict[int, int] = {}
        for name, param in model.named_parameters(remove_duplicate=False):
            self.index[clean_name(name)] = seen.setdefault(id(param), len(self.params))
            if len(seen) > len(self.params):
                self.params.append(param)
        with torch.no_grad():
            self.average = [_fp32_copy(p) for p in self.params]
        self.local = [_local(a) for a in self.average]
        """The average's tensors on this rank (views of ``average``'s: what the updates write)."""

    @torch.no_grad()
    def reset(self) -> None:
        """The average := the weights (a run begun from checkpoint.init_from's)."""
        torch._foreach_copy_(self.local, [_local(p).detach().float() for p in self.params])

    @torch.no_grad()
    def update(self, step: int) -> None:
        """Fold the weights after optimizer step ``step`` (0-based) in: a copy before start_step, then
        average = decay * average + (1 - decay) * weights, over this rank's tensors only."""
        weights = [_local(p).detach() for p in self.params]
        weights = [w if w.dtype == torch.float32 else w.float() for w in weights]
        if step < self.cfg.start_step:
            torch._foreach_copy_(self.local, weights)
        else:
            torch._foreach_lerp_(self.local, weights, 1.0 - ema_decay(self.cfg, step, self.max_steps))

    @contextlib.contextmanager
    def swapped_into(self, model: nn.Module) -> Iterator[None]:
        """Inside, ``model``'s parameters hold the average (each rank its own part, nothing gathered); its own weights
        come back after. Under fully_sharded every FSDP unit is resharded on both sides: a forward without backward
        leaves gathered copies that the next forward would use instead of the shards."""
        _reshard(model)
        with torch.no_grad():
            kept = [_local(p).detach().clone() for p in self.params]
            for p, a in zip(self.params, self.local, strict=True):
                _local(p).copy_(a)
        try:
            yield
        finally:
            _reshard(model)
            with torch.no_grad():
                for p, k in zip(self.params, kept, strict=True):
                    _local(p).copy_(k)

    def state_dict(self) -> dict[str, Tensor]:
        return {name: self.average[i] for name, i in self.index.items()}

    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        with torch.no_grad():
            for name, i in self.index.items():  # DCP loaded into state_dict()'s tensors; a copy keeps other callers
                if state[name] is not self.average[i]:
                    self.local[i].copy_(_local(state[name]))


def _reshard(model: nn.Module) -> None:
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()
