"""Context parallelism: each sequence split over the mesh's "cp" ranks, attention run as a ring over them, through
torch's ``context_parallel`` as torchtitan's train step uses it (a GPU-path feature: torch 2.14 has no sharding rule
for any CPU attention kernel, so the pre-flight refuses it on a machine without CUDA).

Per micro-batch, inside one context that covers forward and backward (backward reaches the ring through the same
swapped attention, so it must run inside too): the task's sequence tensors (inputs, targets, positions:
Task.sequence_shards) are rearranged by torch's head-tail load balancer and each rank keeps its slice, in place
(not restored: nothing reads the whole batch after the step); ``scaled_dot_product_attention`` is dispatched to the
ring (flash, memory-efficient or cuDNN with ``is_causal``, which the context pins on CUDA); the key/value chunks pass
between ranks by all-gather or all-to-all (distributed.context_parallel_rotate_method).

FSDP2 shards parameters over the data-shard and context ranks together (torchtitan's dp_shard_cp), so a context rank
holds 1/(dp_shard x cp) of each weight and the gradient reduce averages over both; losses and token counts are summed
over the data and context axes (ParallelDims.loss_dims).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
from torch.distributed.device_mesh import DeviceMesh

from shardlab.distributed import torch_internals

ROTATE_METHODS = ("allgather", "alltoall")
"""How the ring passes key/value chunks (torch's set_rotate_method): all-gather once, or all-to-all per step."""

FLATTENED = "dp_shard_cp"
"""The name of the data-shard and context axes flattened into one: the ranks FSDP2 shards over under CP."""


def head_tail_positions(seq_len: int, cp: int, rank: int) -> list[int]:
    """The positions of a ``seq_len`` sequence (a multiple of 2 x ``cp``) that context rank ``rank`` holds after torch's
    head-tail load balancer: of 2 x cp equal chunks, chunk ``rank`` and chunk ``2cp - 1 - rank``, so that every rank
    does the same share of causal attention's work (an early chunk attends to few keys, a late one to many)."""
    chunk = seq_len // (2 * cp)
    head = range(rank * chunk, (rank + 1) * chunk)
    tail = range((2 * cp - 1 - rank) * chunk, (2 * cp - rank) * chunk)
    return [*head, *tail]


def data_mesh_with_context(mesh: DeviceMesh, device_type: str) -> DeviceMesh:
    """The mesh FSDP2 shards and replicates over when ``mesh`` has a "cp" dimension: ('dp_replicate',) 'dp_shard_cp'
    with 'dp_shard' x 'cp' flattened into one, sliced from the world's mesh as torchtitan does (so it shares its root
    with the "tp" axis, as FSDP2 over tensor-parallel weights requires). On a torch whose private flatten moved
    (torch_internals), a mesh of its own over the same ranks: public, right without tensor parallelism."""
    names = mesh.mesh_dim_names or ()
    shard = tuple(name for name in ("dp_shard", "cp") if name in names)
    data = (*(("dp_replicate",) if "dp_replicate" in names else ()), FLATTENED)
    flattened = torch_internals.flatten_mesh(mesh[shard], FLATTENED)
    if flattened is not None:  # hybrid: sliced from the root with the replicas (torch 2.14 warns it may stop)
        return flattened if len(data) == 1 else mesh[data]
    axes = [names.index(name) for name in ("dp_replicate", *shard) if name in names]
    rest = [i for i in range(len(names)) if i not in axes]
    shard_ranks = 1
    for name in shard:
        shard_ranks *= mesh.mesh.shape[names.index(name)]
    replicate = [mesh.mesh.shape[names.index("dp_replicate")]] if len(data) == 2 else []
    grid = mesh.mesh.permute(*rest, *axes).reshape(-1, *replicate, shard_ranks)
    own = DeviceMesh(device_type, grid, mesh_dim_names=("rest", *data))
    return own[data]


@contextlib.contextmanager
def sequence_sharded(
    cp_mesh: DeviceMesh, buffers: Sequence[torch.Tensor], seq_dims: Sequence[int], rotate_method: str
) -> Iterator[None]:
    """``buffers`` sharded in place along ``seq_dims`` over ``cp_mesh`` (load-balanced, not restored), and attention
    run as torch's ring over it, until the context ends: a micro-batch's forward and backward go inside."""
    from torch.distributed.tensor.experimental import context_parallel

    torch_internals.set_context_parallel_rotate_method(rotate_method)  # where it moved: torch's default, allgather
    with contextlib.ExitStack() as stack:
        if buffers[0].device.type == "cuda":  # the kernels the ring has rules for, each with is_causal
            from torch.nn.attention import SDPBackend, sdpa_kernel

            kernels = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]
            stack.enter_context(sdpa_kernel(kernels))
        stack.enter_context(
            context_parallel(
                cp_mesh, buffers=list(buffers), buffer_seq_dims=list(seq_dims), no_restore_buffers=set(buffers)
            )
        )
        yield
