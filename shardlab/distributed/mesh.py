"""The device mesh: how the world's ranks split into pipeline, data, context and tensor parallel groups.

One small value (ParallelDims) holds the degrees, as torchtitan's ParallelDims does; everything that samples data,
reduces a loss, clips gradients, counts tokens or shards parameters asks it which ranks it is with, instead of assuming
that a data-parallel rank is every rank. The dimensions run outermost to innermost in torchtitan's order

    pp, dp_replicate, dp_shard, cp, tp

so the ranks of one tensor-parallel group are consecutive: with one task (or one torchrun agent) per host starting its
ranks in order, TP stays inside a host and the data axes cross hosts, the placement TP's per-layer collectives need.
Every launcher numbers ranks that way: a Slurm task starting local ranks gives them task x ranks-per-task + local
index (env.detect), Slurm's default block distribution gives one task per rank consecutive SLURM_PROCIDs on each node,
torchrun gives node_rank x nproc_per_node + local rank. Where the hosts the ranks joined from (network.Joined.hosts)
still split a group (a cyclic distribution, a count of ranks per host that tensor_parallel_degree does not divide),
placement_warning says so in one line: a warning, not a refusal, since the results are the same (only slower over a
network) and hosts joined by NVLink (multi-node NVLink domains) run tensor parallelism across hosts on purpose.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh

from shardlab.config import DistributedConfig

DIM_NAMES = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
"""The mesh's dimensions, outermost first."""


@dataclass(frozen=True)
class ParallelDims:
    """The degree of each mesh dimension; their product is the world size."""

    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1
    ep: int = 1
    """Expert parallelism: not a factor of the world but a split of dp_shard (torchtitan's "ep borrows from
    dp_shard"): each run of ``ep`` consecutive dp_shard ranks holds the experts between them (expert_mesh)."""

    @classmethod
    def from_config(cls, cfg: DistributedConfig, world_size: int) -> ParallelDims:
        """The degrees a config asks for at ``world_size``: the data axes take what TP, PP and CP leave. DDP replicates
        over all of them; fully_sharded shards over ``sharding_degree`` (-1: all) and replicates across the groups
        (hybrid). A config whose degrees do not fit the world gives a value whose ``errors`` say why."""
        tp, pp, cp = cfg.tensor_parallel_degree, cfg.pipeline_parallel_degree, cfg.context_parallel_degree
        model_ranks = max(tp, 1) * max(pp, 1) * max(cp, 1)
        dp = max(world_size // model_ranks, 1)
        if cfg.backend == "fully_sharded":
            shard = dp if cfg.sharding_degree == -1 else cfg.sharding_degree
            replicate = max(dp // max(shard, 1), 1)
        else:
            shard, replicate = 1, dp
        return cls(pp=pp, dp_replicate=replicate, dp_shard=shard, cp=cp, tp=tp, ep=cfg.expert_parallel_degree)

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(getattr(self, name) for name in DIM_NAMES)

    @property
    def world_size(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp

    @property
    def dp(self) -> int:
        """Ranks that read different samples (the data axes): batch_size is split over these."""
        return self.dp_replicate * self.dp_shard

    @property
    def multi_axis(self) -> bool:
        """Whether any axis beyond the data ones is in use."""
        return self.tp > 1 or self.pp > 1 or self.cp > 1

    def errors(self, world_size: int) -> list[str]:
        """One line per degree that cannot hold at ``world_size``, naming the key."""
        problems = []
        for key, value in (("tensor_parallel_degree", self.tp), ("pipeline_parallel_degree", self.pp),
                           ("context_parallel_degree", self.cp)):  # fmt: skip
            if value < 1:
                problems.append(f"distributed.{key} ({value}) must be at least 1 (1 = off)")
        if self.ep < 1:
            problems.append(f"distributed.expert_parallel_degree ({self.ep}) must be at least 1 (1 = off)")
        if problems:
            return problems
        if self.dp_shard % self.ep:
            problems.append(
                f"distributed.expert_parallel_degree ({self.ep}) must divide the data-sharding ranks ({self.dp_shard}:"
                " distributed.sharding_degree, or the data-parallel ranks when it is -1) it borrows from"
            )
        if self.world_size != world_size:
            problems.append(
                f"the mesh's degrees multiply to {self.describe()} = {self.world_size} ranks, but the world size is "
                f"{world_size}: distributed.tensor_parallel_degree x pipeline_parallel_degree x context_parallel_degree"
                " must divide distributed.world_size, and distributed.sharding_degree the ranks left"
            )
        return problems

    def coordinates(self, rank: int) -> dict[str, int]:
        """This rank's index along each dimension (row-major over DIM_NAMES, the innermost varying fastest)."""
        coords = {}
        for name, size in reversed(list(zip(DIM_NAMES, self.sizes, strict=True))):
            coords[name] = rank % size
            rank //= size
        return {name: coords[name] for name in DIM_NAMES}

    def dp_rank(self, rank: int) -> int:
        """``rank``'s index among the data-parallel ranks: which slice of each batch it reads."""
        c = self.coordinates(rank)
        return c["dp_replicate"] * self.dp_shard + c["dp_shard"]

    def rank_grid(self) -> torch.Tensor:
        """The world's ranks laid out along the dimensions (the mesh's ``mesh`` tensor)."""
        return torch.arange(self.world_size).reshape(self.sizes)

    def describe(self) -> str:
        """E.g. 'pp 2 x dp_shard 2 x tp 2' (dimensions of size 1 left out; 'dp_shard 1' when all are)."""
        parts = [f"{name} {size}" for name, size in zip(DIM_NAMES, self.sizes, strict=True) if size > 1]
        return " x ".join(parts) or "dp_shard 1"

    def enabled(self, keep: tuple[str, ...] = ()) -> tuple[str, ...]:
        """The dimensions of size above 1 and those in ``keep``, outermost first ('dp_shard' alone when every degree
        is 1)."""
        names = tuple(name for name, size in zip(DIM_NAMES, self.sizes, strict=True) if size > 1 or name in keep)
        return names or ("dp_shard",)

    def data_dims(self) -> tuple[str, ...]:
        """The data axes in use ('dp_replicate', 'dp_shard', each only when above 1): the ranks FSDP shards and
        replicates over, and which read different samples."""
        return tuple(name for name in ("dp_replicate", "dp_shard") if getattr(self, name) > 1)

    def loss_dims(self) -> tuple[str, ...]:
        """The axes whose ranks hold different terms of a step's loss and counts (the data axes, and context
        parallelism's sequence chunks): summed metrics are all-reduced over these, not over tensor-parallel ranks,
        which each hold the same values. And the pipeline axis: only the last stage computes the loss, the other
        stages add zeros (shardlab.distributed.pipeline), so the sum over it counts each term once."""
        return tuple(name for name in ("pp", "dp_replicate", "dp_shard", "cp") if getattr(self, name) > 1)

    def groups_across_hosts(self, hosts: Sequence[str]) -> list[tuple[int, ...]]:
        """The tensor-parallel groups (consecutive runs of ``tp`` ranks) whose ranks are not all on one host;
        ``hosts``: the host of each rank, in rank order."""
        groups = self.rank_grid().reshape(-1, self.tp).tolist() if self.tp > 1 else []
        return [tuple(group) for group in groups if len({hosts[rank] for rank in group}) > 1]

    def build(self, device_type: str, keep: tuple[str, ...] = ()) -> DeviceMesh:
        """The mesh over every rank with a named dimension for each degree above 1 (as torchtitan's: a dimension of
        size 1 would only cost process groups of one rank) and for each of ``keep`` (fully_sharded keeps 'dp_shard',
        the mesh its FSDP2 shards over, even at size 1 under tensor parallelism); slice it by name. Every rank must
        call it: it makes each dimension's process groups."""
        names = self.enabled(keep)
        grid = self.rank_grid().reshape([getattr(self, name) for name in names])
        return DeviceMesh(device_type, grid, mesh_dim_names=names)

    def expert_mesh(self, device_type: str) -> DeviceMesh:
        """The mesh expert parallelism places experts on: dp_shard split into ('dp_shard_mod_ep', 'ep'), the expert
        group innermost (``ep`` consecutive ranks, within a host where the data axes allow), 'dp_replicate' kept
        when above 1, and 'tp' innermost when above 1: the ranks of an expert group share their tensor-parallel
        index (each routes its own slice of the sequence, shardlab_tasks/lm/models/tensor_parallel.py), and the experts
        are whole on every rank of a tensor-parallel group. A root of its own beside ``build``'s (so the data axes stay
        whole there): FSDP2 needs an expert's EP and FSDP placements on one root, and the other parameters shard over
        ``build``'s 'dp_shard'. Not with pp or cp (the pre-flight refuses them with ep: not composed yet)."""
        sizes = {"dp_replicate": self.dp_replicate, "dp_shard_mod_ep": self.dp_shard // self.ep, "ep": self.ep}
        sizes["tp"] = self.tp
        names = tuple(name for name, size in sizes.items() if size > 1 or name not in ("dp_replicate", "tp"))
        grid = torch.arange(self.world_size).reshape([sizes[name] for name in names])
        return DeviceMesh(device_type, grid, mesh_dim_names=names)


def placement_warning(dims: ParallelDims, hosts: Sequence[str]) -> str | None:
    """One line when a tensor-parallel group spans hosts (None when each lies within one): which group, on which
    hosts, and the fix. A warning: the run is right, each layer's collectives only cross the network."""
    split = dims.groups_across_hosts(hosts)
    if not split:
        return None
    first = split[0]
    on = ", ".join(dict.fromkeys(hosts[rank] for rank in first))
    return (
        f"warning: {len(split)} of {dims.world_size // dims.tp} tensor-parallel groups span hosts (ranks "
        f"{first[0]}-{first[-1]} on {on}), so every layer's collectives cross the network: start each host's ranks "
        f"consecutively (Slurm's block distribution, one task per host starting its ranks, torchrun) with a multiple "
        f"of distributed.tensor_parallel_degree={dims.tp} ranks per host"
    )
