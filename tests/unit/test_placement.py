"""Multi-node placement: each tensor-parallel group lies within one host in the layouts users run, because every
launcher numbers a host's ranks consecutively and tensor parallelism is the mesh's innermost axis; a layout that
splits a group is named in one warning line. The hosts of the ranks are worked out here from what each launcher puts
in a rank's environment (shardlab.distributed.env.detect), as each rank reports its host when it joins."""

from __future__ import annotations

import pytest

from shardlab.config import DistributedConfig
from shardlab.distributed import env as dist_env
from shardlab.distributed.mesh import ParallelDims, placement_warning
from tests.unit.test_env import LAUNCHER_VARS, setenv_all

FSDP_TP2 = {"backend": "fully_sharded", "tensor_parallel_degree": 2}


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for var in LAUNCHER_VARS:
        monkeypatch.delenv(var, raising=False)


def slurm_task(monkeypatch, task: int, node: int, tasks: int, nodes: int) -> None:
    """The environment srun gives task ``task`` of a ``tasks``-task step on ``node`` of hosts n1..n``nodes``."""
    setenv_all(
        monkeypatch, SLURM_NTASKS=str(tasks), SLURM_PROCID=str(task), SLURM_LOCALID="0", SLURM_JOB_ID="77",
        SLURM_JOB_NODELIST=f"n[1-{nodes}]", SLURM_JOB_NUM_NODES=str(nodes), SLURM_NODEID=str(node),
    )  # fmt: skip


def hosts_of_local_ranks(monkeypatch, nodes: int, world: int) -> list[str]:
    """One Slurm task per host, each starting world / nodes local ranks: the host of each global rank."""
    hosts: dict[int, str] = {}
    for node in range(nodes):
        slurm_task(monkeypatch, node, node, nodes, nodes)
        task = dist_env.detect()
        for local in range(dist_env.ranks_to_spawn(world, task)):
            rank = dist_env.detect(spawned_rank=local, spawned_world=world)
            assert rank.world_size == world and rank.rank not in hosts
            hosts[rank.rank] = f"n{node + 1}"
    return [hosts[r] for r in range(world)]


def hosts_of_tasks(monkeypatch, nodes: int, world: int, cyclic: bool = False) -> list[str]:
    """One Slurm task per rank, placed on the nodes by srun's block distribution (its default: consecutive task ids
    fill a node) or its cyclic one (task ids dealt round the nodes)."""
    hosts: dict[int, str] = {}
    per_node = world // nodes
    for task in range(world):
        node = task % nodes if cyclic else task // per_node
        slurm_task(monkeypatch, task, node, world, nodes)
        rank = dist_env.detect()
        assert (rank.world_size, dist_env.ranks_to_spawn(world, rank)) == (world, 0)
        hosts[rank.rank] = f"n{node + 1}"
    return [hosts[r] for r in range(world)]


def dims(world: int, **keys) -> ParallelDims:
    return ParallelDims.from_config(DistributedConfig(**{**FSDP_TP2, **keys}), world)


@pytest.mark.parametrize(("nodes", "world", "keys"), [(2, 4, {}), (2, 8, {}), (2, 8, {"tensor_parallel_degree": 4}),
                                                      (2, 8, {"sharding_degree": 2}), (4, 8, {})])  # fmt: skip
def test_one_task_per_host_starting_its_ranks_keeps_each_tensor_parallel_group_on_its_host(
    monkeypatch, nodes, world, keys
):
    hosts = hosts_of_local_ranks(monkeypatch, nodes, world)
    d = dims(world, **keys)
    assert hosts == [f"n{r // (world // nodes) + 1}" for r in range(world)]
    assert d.groups_across_hosts(hosts) == [] and placement_warning(d, hosts) is None
    # ...and the data axes are the ones that cross hosts: the ranks of one host share their data-parallel neighbours.
    assert len({hosts[r] for r in range(0, world, d.tp)}) == nodes


@pytest.mark.parametrize(("nodes", "world", "keys"), [(2, 4, {}), (2, 8, {"tensor_parallel_degree": 4}), (4, 8, {})])
def test_one_task_per_rank_in_srun_block_order_keeps_each_tensor_parallel_group_on_its_host(
    monkeypatch, nodes, world, keys
):
    hosts = hosts_of_tasks(monkeypatch, nodes, world)
    d = dims(world, **keys)
    assert d.groups_across_hosts(hosts) == [] and placement_warning(d, hosts) is None


def test_a_cyclic_distribution_splits_every_group_and_is_warned_in_one_line(monkeypatch):
    hosts = hosts_of_tasks(monkeypatch, 2, 4, cyclic=True)
    assert hosts == ["n1", "n2", "n1", "n2"]
    d = dims(4)
    assert d.groups_across_hosts(hosts) == [(0, 1), (2, 3)]
    line = placement_warning(d, hosts)
    assert line == (
        "warning: 2 of 2 tensor-parallel groups span hosts (ranks 0-1 on n1, n2), so every layer's collectives cross "
        "the network: start each host's ranks consecutively (Slurm's block distribution, one task per host starting "
        "its ranks, torchrun) with a multiple of distributed.tensor_parallel_degree=2 ranks per host"
    )
    assert "\n" not in line


def test_hosts_with_a_rank_count_the_tensor_degree_does_not_divide_are_warned(monkeypatch):
    """Two tasks each starting 3 ranks, TP 2: ranks 2 and 3 form a group across the two hosts."""
    hosts = hosts_of_local_ranks(monkeypatch, 2, 6)
    d = dims(6)
    assert d.groups_across_hosts(hosts) == [(2, 3)]
    line = placement_warning(d, hosts)
    assert line.startswith("warning: 1 of 3 tensor-parallel groups span hosts (ranks 2-3 on n1, n2)")


def test_torchrun_numbers_each_agents_ranks_consecutively(monkeypatch):
    hosts = {}
    for node in range(2):
        for local in range(2):
            setenv_all(monkeypatch, RANK=str(node * 2 + local), WORLD_SIZE="4", LOCAL_RANK=str(local),
                       MASTER_ADDR="n1")  # fmt: skip
            hosts[dist_env.detect().rank] = f"n{node + 1}"
    assert placement_warning(dims(4), [hosts[r] for r in range(4)]) is None


def test_without_tensor_parallelism_nothing_is_warned():
    assert placement_warning(dims(4, tensor_parallel_degree=1), ["n1", "n2", "n1", "n2"]) is None
