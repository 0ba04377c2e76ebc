"""Tensor parallelism: a task's plan (which module is column-wise, row-wise, sequence-parallel) applied over the mesh's
"tp" axis with torch's own ``parallelize_module``, before activation checkpointing, compile and FSDP (torchtitan's
order). The plan is data the task hands over (Task.tensor_parallel_plan), as it hands its FSDP units: a dict from a
module path (``*`` matches any one name: ``blocks.*.attn.q``) to a torch ParallelStyle.

Applied on the meta device, so nothing is allocated: each parameter becomes a DTensor over the tp axis and the
materialization (shardlab.distributed.materialize) fills its shard from the same full value one process draws.
"""

from __future__ import annotations

import contextlib

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import loss_parallel, parallelize_module

from shardlab.config import TrainConfig
from shardlab.distributed import torch_internals
from shardlab.distributed.materialize import shared_parameter_slots


def apply_tensor_parallel(model: nn.Module, plan: dict, tp_mesh: DeviceMesh) -> nn.Module:
    """``model`` with ``plan`` applied over ``tp_mesh``. Parameters held by two modules (tied embedding and head)
    stay one parameter: parallelize_module distributes each module's parameters on its own, which would make two, so
    the slots are re-tied to the first module's; the plan must place both alike (the embedding row-wise and the head
    column-wise both shard the (vocabulary, dim) matrix by rows). Frozen parameters stay frozen."""
    shared = shared_parameter_slots(model)
    # torch's styles make each split weight a new nn.Parameter, which requires grad: a frozen one would start training.
    frozen = {name for name, param in model.named_parameters() if not param.requires_grad}
    parallelize_module(model, tp_mesh, plan)
    for name, param in model.named_parameters():
        param.requires_grad_(name not in frozen)
    for slots in shared:
        first_module, first_name = slots[0]
        tied = first_module._parameters[first_name]
        for module, name in slots[1:]:
            other = module._parameters[name]
            if getattr(other, "placements", None) != getattr(tied, "placements", None):
                raise ValueError(  # the task's plan is wrong, not the user's config
                    f"the tensor-parallel plan places the tied weight {first_name} differently in two modules "
                    f"({getattr(tied, 'placements', None)} and {getattr(other, 'placements', None)})"
                )
            module._parameters[name] = tied
    return model


def enable_async_tensor_parallel(tp_mesh: DeviceMesh) -> bool:
    """distributed.async_tensor_parallel (CUDA, with distributed.compile): compiled graphs overlap the tensor-parallel
    all-gathers and reduce-scatters with the matmuls that use them (torch's micro-pipeline TP, as torchtitan enables
    it: inductor's pass and symmetric memory for the tp group; private names, torch_internals). Whether it is on: a
    torch where those names moved runs TP synchronously."""
    switches = torch_internals.micro_pipeline_tp_switches()
    if switches is None:
        return False
    inductor_config, enable_symm_mem_for_group = switches
    inductor_config._micro_pipeline_tp = True
    enable_symm_mem_for_group(tp_mesh.get_group().group_name)
    return True


def loss_parallel_on(cfg: TrainConfig) -> bool:
    """Whether the run's loss takes logits split over the vocabulary (distributed.loss_parallel under tensor
    parallelism); false for a stored config written before the key (it gathered them)."""
    d = cfg.distributed
    return d.tensor_parallel_degree > 1 and bool(getattr(d, "loss_parallel", False))


def split_vocabulary_loss(on: bool) -> contextlib.AbstractContextManager:
    """Around a micro-batch's forward, loss and backward (both passes: the backward of the loss-parallel
    cross-entropy is the same custom DTensor op handlers): torch's loss_parallel, under which F.cross_entropy of logits
    split over the vocabulary reduces across the tensor-parallel ranks (a max and two sums of (tokens,) values) instead
    of gathering them. Entered once, never nested: its exit switches the handlers off."""
    return loss_parallel() if on else contextlib.nullcontext()
