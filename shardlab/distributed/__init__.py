"""How a model is placed on ranks and devices: the backends (``distributed.backend``) and what they share.

- ``env``: who this process is in the job (rank, world size, rendezvous) for every launcher.
- ``base``: the Backend interface, and ``single`` (one process, no wrapping).
- ``ddp``, ``fully_sharded``: DistributedDataParallel, and PyTorch's FSDP2 (``fully_shard``) with every knob.
- ``mesh``: ParallelDims, the degree of each mesh axis (pp, dp_replicate, dp_shard, cp, tp), and the one mesh.
- ``tensor_parallel``: a task's tensor-parallel plan applied over the mesh's tp axis, before FSDP.
- ``units``: the model's FSDP units before allocation (the task's plan, else a size policy).
- ``materialize``: weights of a meta-built model, filled per parameter from (seed, name), identical on any world size.
- ``activation_checkpointing``, ``sync_bn``, ``grad_scaler``: what the backends wrap a model with.
- ``gloo_comms``, ``torch_internals``: the opt-in CPU reduce-scatter path and the private torch APIs it needs.
- ``cpu_allocator``: how glibc treats a CPU rank's freed memory (distributed.cpu_allocator).

Importing this package is light (no torch); ``load_backends()`` registers the three backends in BACKENDS.
"""

from __future__ import annotations

__all__ = ["load_backends"]


def load_backends() -> None:
    """Register single, ddp and fully_sharded in shardlab.registry.BACKENDS (each module registers itself)."""
    from shardlab.distributed import base, ddp, fully_sharded  # noqa: F401
