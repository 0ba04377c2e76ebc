"""ParallelDims: the degrees a config asks for, their errors, and each rank's place on the mesh."""

from __future__ import annotations

import pytest

from shardlab.config import DistributedConfig
from shardlab.distributed.mesh import ParallelDims


def dims(world: int, **keys) -> ParallelDims:
    return ParallelDims.from_config(DistributedConfig(**keys), world)


def test_the_data_axes_take_the_ranks_tensor_and_pipeline_parallelism_leave():
    d = dims(8, backend="fully_sharded", tensor_parallel_degree=2, pipeline_parallel_degree=2)
    assert (d.pp, d.dp_replicate, d.dp_shard, d.cp, d.tp) == (2, 1, 2, 1, 2)
    assert d.dp == 2 and d.world_size == 8 and d.errors(8) == []
    hybrid = dims(8, backend="fully_sharded", tensor_parallel_degree=2, sharding_degree=2)
    assert (hybrid.dp_replicate, hybrid.dp_shard) == (2, 2)
    ddp = dims(4, backend="ddp", tensor_parallel_degree=2)
    assert (ddp.dp_replicate, ddp.dp_shard) == (2, 1)


def test_tensor_parallel_ranks_are_consecutive_and_the_data_rank_skips_them():
    d = dims(8, backend="fully_sharded", tensor_parallel_degree=2, pipeline_parallel_degree=2)
    assert [d.coordinates(r)["tp"] for r in range(4)] == [0, 1, 0, 1]
    assert [d.dp_rank(r) for r in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]
    assert [d.coordinates(r)["pp"] for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert d.rank_grid()[1, 0, 1, 0, 1].item() == 7
    assert d.enabled() == ("pp", "dp_shard", "tp") and d.describe() == "pp 2 x dp_shard 2 x tp 2"


@pytest.mark.parametrize(
    ("world", "keys", "fragment"),
    [
        (6, {"tensor_parallel_degree": 4}, "multiply to tp 4 = 4 ranks, but the world size is 6"),
        (8, {"pipeline_parallel_degree": 0}, "distributed.pipeline_parallel_degree (0) must be at least 1"),
        (8, {"tensor_parallel_degree": 2, "sharding_degree": 3}, "the world size is 8"),
    ],
)
def test_degrees_that_do_not_fit_the_world_are_named(world, keys, fragment):
    errors = dims(world, backend="fully_sharded", **keys).errors(world)
    assert len(errors) == 1 and fragment in errors[0]
