"""Expert parallelism (distributed.expert_parallel_degree): an MoE layer's routed experts split over a group of ranks.

torchtitan's design. The group is borrowed from the data-sharding ranks (mesh.ParallelDims.expert_mesh splits
dp_shard into 'dp_shard_mod_ep' x 'ep'): the ranks of one group read different samples, route their own tokens with
the replicated router, and send each (token, expert) row to the rank holding that expert and back by all-to-all (the
task's expert module does the exchange, with ``expert_group``). Each expert module's parameters, experts along dim 0,
become DTensors sharded by rows over 'ep' (rank r of the group holds experts r * E/ep ...), then FSDP2 shards them
further over the data ranks outside the group ('dp_shard_mod_ep', with 'dp_replicate' when hybrid; along each
expert's rows where a rank holds fewer experts than those ranks: ``expert_shard_placement``), while every
other parameter shards over all of dp_shard as without experts. With tensor parallelism the expert mesh keeps 'tp'
innermost: an expert group is the ranks of ``ep`` consecutive dp_shard indices at one tensor-parallel index, each
exchanging its own slice of the sequence's tokens, and the experts are whole across the tensor-parallel group.

Gradients. An expert's gradient on its rank already sums the contributions of the whole group's tokens (the
all-to-all's backward brings them), and FSDP2 then averages over the 'dp_shard_mod_ep' ranks only: ``local_experts``
divides it by the group's size on its way back, which gives the mean over every data rank, the gradient every other
parameter gets. (FSDP2's ``set_gradient_divide_factor`` would say the same, but reduces with PREMUL_SUM, which gloo
does not have.)

Checkpoints. The parameters keep the unsplit model's names and global shapes (DTensors), so DCP writes and reads
them by slices: a step folder written at one expert-parallel degree resumes at any other, or on one process.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor


def split_experts(modules: Sequence[nn.Module], ep_mesh: DeviceMesh) -> None:
    """Each module's own parameters (experts along dim 0) sharded by rows over ``ep_mesh`` (built on meta: nothing
    is copied); ``module.expert_group`` set to the group the module's forward exchanges tokens over."""
    for module in modules:
        for name, param in list(module.named_parameters(recurse=False)):
            split = distribute_tensor(param.data, ep_mesh, [Shard(0)], src_data_rank=None)
            module.register_parameter(name, nn.Parameter(split, requires_grad=param.requires_grad))
        module.expert_group = ep_mesh.get_group()


def expert_shard_placement(param: nn.Parameter, degree: int) -> Shard | None:
    """Where FSDP2 shards an expert weight over ``degree`` ranks (``fully_shard``'s shard_placement_fn): by rows
    (Shard(1), torchtitan's choice) when this rank's experts are fewer than the ranks and the rows split evenly
    (FSDP2 shards dims above 0 evenly only), so no rank holds a padded whole expert; else along the experts (None:
    FSDP2's Shard(0))."""
    local = param.to_local() if isinstance(param, DTensor) else param
    if local.shape[0] < degree and local.dim() > 1 and local.shape[1] % degree == 0:
        return Shard(1)
    return None


def expert_fsdp_mesh(expert_mesh: DeviceMesh) -> DeviceMesh:
    """The data axes of the expert mesh that FSDP2 shards (and replicates) the experts over: all but 'ep' and 'tp'
    (the experts are whole on every rank of a tensor-parallel group, their gradients summed over it in the
    backward: shardlab_tasks/lm/moe_parallel.grad_summed)."""
    names = tuple(name for name in expert_mesh.mesh_dim_names or () if name not in ("ep", "tp"))
    return expert_mesh[names]


class _ScaleGradient(torch.autograd.Function):
    """Identity forward; the gradient times ``scale`` on the way back."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.scale, None


def local_experts(weight: torch.Tensor) -> torch.Tensor:
    """This rank's experts of an expert weight, for the forward: the local rows of a split one (a DTensor on the 'ep'
    axis once FSDP2 gathered it), whose gradient is divided by the group's size on its way back (the module
    docstring); ``weight`` itself when not split."""
    if not isinstance(weight, DTensor):
        return weight
    return _ScaleGradient.apply(weight.to_local(), 1.0 / weight.device_mesh.size())
