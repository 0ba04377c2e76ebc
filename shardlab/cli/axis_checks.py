"""The pre-flight's checks of the mesh's axes beyond data parallelism (distributed.tensor_parallel_degree,
pipeline_parallel_degree, context_parallel_degree and context_parallel_rotate_method, expert_parallel_degree,
async_tensor_parallel): each refusal one line naming the key, before any process starts (asked by
shardlab.cli.checks.check)."""

from __future__ import annotations

from omegaconf import DictConfig

from shardlab.distributed.mesh import ParallelDims

AXIS_KEYS = {"tp": "tensor_parallel_degree", "pp": "pipeline_parallel_degree", "cp": "context_parallel_degree"}
"""Each axis beyond the data ones, by its mesh name, and the key that sizes it."""


def axis_errors(cfg: DictConfig, task, world: int, num_cuda_devices: int) -> list[str]:
    """The degrees against the world size, the backend, the task's models and this machine's devices."""
    d = cfg.distributed
    dims = ParallelDims.from_config(d, world)
    asked = {axis: getattr(dims, axis) for axis in AXIS_KEYS if getattr(dims, axis) != 1}
    if dims.ep != 1 and (refusal := expert_parallel_refusal(cfg, dims, asked)):
        return [refusal]
    errors = dims.errors(world) if asked or dims.ep != 1 else []
    if errors:
        return errors
    if dims.ep != 1:
        errors += task.expert_parallel_errors(dims.ep)
    for axis, degree in asked.items():
        if axis not in task.model_parallel_axes:
            errors.append(
                f"distributed.{AXIS_KEYS[axis]} ({degree}): task {cfg.task.name}'s models do not split that way; they "
                "stay data-parallel (set it to 1 and scale with distributed.world_size)"
            )
    if errors:
        return errors
    if dims.tp > 1:
        errors += tensor_parallel_errors(cfg, task, dims.tp)
    if dims.cp > 1:
        errors += context_parallel_errors(cfg, task, dims, num_cuda_devices)
    if d.async_tensor_parallel:
        errors += async_tensor_parallel_errors(cfg, dims.tp, num_cuda_devices)
    return errors


def expert_parallel_refusal(cfg: DictConfig, dims: ParallelDims, other_axes: dict[str, int]) -> str | None:
    """Expert parallelism borrows from FSDP2's data-sharding ranks; it composes with the data axes and tensor
    parallelism (attention split, the MoE blocks on each rank's tokens), not yet with pipeline or context parallelism
    (the stages do not carry the routing statistics; the ring would need the experts' exchange per sequence chunk)."""
    d = cfg.distributed
    if d.backend != "fully_sharded":
        return (
            f"distributed.expert_parallel_degree ({dims.ep}) needs distributed.backend=fully_sharded (the expert "
            f"groups are split from its data-sharding ranks; backend is {d.backend})"
        )
    uncomposed = {axis: degree for axis, degree in other_axes.items() if axis != "tp"}
    if uncomposed:
        keys = " or ".join(f"distributed.{AXIS_KEYS[axis]} ({degree})" for axis, degree in uncomposed.items())
        return (
            f"distributed.expert_parallel_degree ({dims.ep}) is not composed yet with {keys} (it composes with the "
            "data axes and distributed.tensor_parallel_degree): set one of them to 1"
        )
    return None


def tensor_parallel_errors(cfg: DictConfig, task, degree: int) -> list[str]:
    """Tensor parallelism composes with FSDP2 over one mesh (fully_sharded); the model must split evenly."""
    backend = cfg.distributed.backend
    if backend != "fully_sharded":
        return [
            f"distributed.tensor_parallel_degree ({degree}) needs distributed.backend=fully_sharded (FSDP2 shards the "
            f"data axes of the mesh tensor parallelism splits; backend is {backend})"
        ]
    return task.tensor_parallel_errors(degree)


def context_parallel_errors(cfg: DictConfig, task, dims: ParallelDims, num_cuda_devices: int) -> list[str]:
    """Context parallelism runs torch's ring attention on CUDA (torch 2.14 has no sharding rule for a CPU attention
    kernel; a dry run only plans, so it passes anywhere), under fully_sharded, without pipeline stages; the task says
    what of its model and data cannot split."""
    d, key = cfg.distributed, f"distributed.context_parallel_degree ({dims.cp})"
    if not num_cuda_devices and not cfg.get("dry_run"):  # a dry run only plans: on any machine
        return [
            f"{key} needs CUDA: torch's context_parallel has no sharding rule for CPU attention; set it to 1 here "
            "(dry_run=true plans it on any machine)"
        ]
    refusals = (
        (d.backend != "fully_sharded", f"{key} needs distributed.backend=fully_sharded (FSDP2 shards over the "
         f"data-shard x context ranks; backend is {d.backend})"),
        (dims.pp > 1, f"{key} with distributed.pipeline_parallel_degree ({dims.pp}): context parallelism is not "
         "composed with pipeline stages yet; set one of them to 1"),
        (d.compile, f"{key} with distributed.compile=true: torch's context_parallel swaps scaled_dot_product_attention "
         "per micro-batch, which graphs compiled from the units do not follow (not checked together); set "
         "distributed.compile=false"),
    )  # fmt: skip
    return [message for refused, message in refusals if refused] + task.context_parallel_errors(dims.cp)


def async_tensor_parallel_errors(cfg: DictConfig, tp: int, num_cuda_devices: int) -> list[str]:
    d = cfg.distributed
    if not num_cuda_devices:
        return ["distributed.async_tensor_parallel is a CUDA feature (symmetric memory between GPUs); drop it on CPU"]
    if tp < 2 or not d.compile:
        return [
            "distributed.async_tensor_parallel overlaps tensor parallelism's collectives inside compiled graphs: it "
            "needs distributed.tensor_parallel_degree > 1 and distributed.compile=true"
        ]
    return []
