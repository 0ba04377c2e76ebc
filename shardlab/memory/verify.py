"""distributed.verify_plan: the plan held against the real fully_shard, at the job's world size, in one process.

The model is built on meta and sharded by the fully_sharded backend's own parallelize on torch's fake process group
(a process group that answers every collective without communicating: rank r of any world size, in one process, as
torchtitan's dry runs use it), once as rank 0 and once as the last rank, whose shards are the shortest when a
dimension does not divide evenly. Nothing is allocated: the parameters stay on meta. Then:

- per rank, the bytes of the sharded parameters' storage (FSDP2 pads every shard to the first one's size), of their
  DTensor local shards, of the gradients FSDP2 will write (views of its padded reduce-scatter output when that is in
  the parameters' dtype, else cast copies of the local shards) and of the optimizer state (one fp32 tensor shaped like
  the local shard per Adam moment, as torch.optim creates it) must equal shardlab.memory.estimate.rank_state's;
- the collectives one step issues, read from FSDP2's parameter groups (all-gather input per rank, reduce-scatter
  output, the hybrid mesh's all-reduce; how often each runs from the group's reshard setting) must equal
  shardlab.memory.estimate.collectives', and so the plan's bytes sent per step.

Under distributed.expert_parallel_degree > 1 the backend's own expert split (shardlab.distributed.expert_parallel, on
ParallelDims.expert_mesh built on the fake group) runs first, as in training: each expert module is its own FSDP2 unit
over the ranks outside its expert group, and the plan's side is shardlab.memory.experts' expert_rank_state and
expert_collectives. The tokens' all-to-all is the task's forward, not FSDP2's: not counted here.

FSDP2 refuses to run forward on meta parameters (it checks they were materialized), so the step's collectives are
counted from its parameter groups rather than recorded as they run. A mismatch raises PlanMismatch: one line.

A second check, which reads no FSDP2 internals (``tracked_state``): rank 0's sharded model is given fake storage
(torch's FakeTensorMode: shapes, dtypes and devices, no bytes) and runs one real step - the task's loss on its example
batch, backward through FSDP2's all-gathers and reduce-scatters on the fake group, an optimizer step with the plan's
number of fp32 moments - under torch's FSDPMemTracker (torchtitan's memory estimation does the same), whose sharded
parameters, sharded gradients and optimizer state must equal the plan's too. It runs where a fake step can: not under
expert parallelism (the tokens' all-to-all sizes depend on the routing, which fake tensors do not hold), nor for a task
without an example batch or an optimizer the plan does not count in fp32 moments, nor where the step needs values (an
MoE's routing counts tokens per expert with bincount); the line says when it did not run and why. FSDPMemTracker is
private torch API: shardlab.distributed.torch_internals.fsdp_mem_tracker gives it on a tested torch only, and
tests/unit/test_torch_internals.py fails loudly when torch changes it.

A layout with a pipeline axis gets a third check, of its peak rather than its state: pipeline rank 0's step as
training builds and runs it, on fake tensors (shardlab.memory.stage_step), whose peak of live bytes the plan of that
rank must not be below (PlanMismatch); the line gives both. Where that step cannot run (context or expert
parallelism, a task plan whose stage boundary is not the sequence-split residual stream) the line says why.

Private torch names, used on a tested torch only (shardlab.distributed.torch_internals.TESTED_TORCH), checked by
tests/unit/test_memory_plan.py::test_verify_plan_private_torch_names_still_behave: the fake backend's FakeStore
(torch.testing._internal.distributed.fake_pg), FSDPModule._get_fsdp_state(), its _fsdp_param_group (fsdp_params,
mesh_info, post_forward_mesh_info, mp_policy) and FSDPParam._sharded_param_data.
"""

from __future__ import annotations

import copy
import dataclasses
import time

import torch
from torch import nn

from shardlab.distributed import torch_internals
from shardlab.distributed.units import model_on_meta
from shardlab.errors import ConfigError, ShardlabError
from shardlab.memory.devices import GiB, size_text
from shardlab.memory.estimate import Collective
from shardlab.memory.experts import expert_collectives, expert_rank_state
from shardlab.memory.fake_group import fake_process_group
from shardlab.memory.layout import layout_of
from shardlab.memory.plan import profile_config


class PlanMismatch(ShardlabError):
    """The memory plan disagrees with what fully_shard did: a bug in the plan, not a user mistake (exit code 1)."""

    exit_code = 1


def shard_on_fake_group(cfg, task, world_size: int, rank: int):
    """The task's model on meta, sharded as the fully_sharded backend shards it, seen from ``rank``; returns the
    model and its FSDP modules in the plan's order: per unit, the expert modules in it (under
    distributed.expert_parallel_degree > 1 each its own FSDP2 unit on the expert mesh), then the unit; the root's
    last."""
    from shardlab.distributed.env import DistEnv
    from shardlab.distributed.fully_sharded import FullyShardedBackend

    model = model_on_meta(task)
    units = task.fsdp_units(model)
    backend = FullyShardedBackend(cfg.distributed, DistEnv(rank, world_size, rank, "127.0.0.1", 0, "none"))
    backend.device = torch.device("cpu")  # the fake backend serves any device; nothing is placed on it
    # The mesh FullyShardedBackend.setup makes (setup itself would join a real process group first).
    backend.mesh = backend.dims.build("cpu", keep=("dp_shard",))
    backend.sharding_degree = backend.dims.dp_shard
    experts = task.expert_modules(model) if backend.dims.ep > 1 else []  # as the trainer asks for them
    model = backend.parallelize(model, units, materialize=lambda m: None, expert_modules=experts)
    ordered = []
    for unit in backend.units or []:
        inside = {id(m) for m in unit.modules()}
        ordered += [m for m in experts if id(m) in inside and m not in ordered] + [unit]
    ordered += [m for m in experts if m not in ordered]
    return model, [*ordered, model]


def _group(module: nn.Module):
    return module._get_fsdp_state()._fsdp_param_group  # None for a module without parameters of its own


def measured_state(fsdp_modules: list[nn.Module], optimizer_state_bytes: int) -> dict[str, int]:
    """This rank's bytes as fully_shard laid them out (see the module docstring)."""
    out = dict(params=0, local_params=0, grads=0, optimizer=0)
    for module in fsdp_modules:
        group = _group(module)
        if group is None:
            continue
        reduce_dtype = group.mp_policy.reduce_dtype
        for fp in group.fsdp_params:
            storage = fp._sharded_param_data
            local = fp.sharded_param.to_local()
            out["params"] += storage.numel() * storage.element_size()
            out["local_params"] += local.numel() * local.element_size()
            if not fp.sharded_param.requires_grad:  # frozen (a LoRA base): no gradient, not in the optimizer
                continue
            same_dtype = reduce_dtype in (None, local.dtype)
            out["grads"] += (storage.numel() if same_dtype else local.numel()) * local.element_size()
            for _ in range(optimizer_state_bytes // 4):  # torch.optim: zeros_like(param) per moment
                moment = torch.zeros_like(fp.sharded_param, memory_format=torch.preserve_format)
                out["optimizer"] += moment.to_local().numel() * moment.to_local().element_size()
    return out


def measured_collectives(fsdp_modules: list[nn.Module], update_freq: int, reductions: int) -> list[Collective]:
    """The collectives one step issues, from FSDP2's parameter groups, in the plan's order."""
    out = []
    for module in fsdp_modules:
        group = _group(module)
        if group is None:
            continue
        info = group.mesh_info
        shard = sum(fp._sharded_param_data.numel() for fp in group.fsdp_params)
        # FSDP2 reduces the gradients it has: those of the trainable parameters (a LoRA run's adapters)
        reduced = sum(fp._sharded_param_data.numel() for fp in group.fsdp_params if fp.sharded_param.requires_grad)
        orig = group.fsdp_params[0].sharded_param.dtype
        param_dtype = group.mp_policy.param_dtype or orig
        reduce_dtype = group.mp_policy.reduce_dtype or param_dtype
        gathers = update_freq * (2 if group.post_forward_mesh_info is not None else 1)
        if info.shard_mesh_size > 1:
            out.append(Collective("all_gather", info.shard_mesh_size, shard * param_dtype.itemsize, gathers))
        if info.shard_mesh_size > 1 and reduced:
            out.append(Collective("reduce_scatter", info.shard_mesh_size, reduced * reduce_dtype.itemsize, reductions))
        replicas = getattr(info, "replicate_mesh_size", 1)
        if replicas > 1 and reduced:
            out.append(Collective("all_reduce", replicas, reduced * reduce_dtype.itemsize, reductions))
    return out


def verify_plan(cfg, task, world_size: int) -> list[str]:
    """Check the plan of ``cfg`` against fully_shard at ``world_size`` ranks; lines saying what was checked, or
    PlanMismatch in one line."""
    started = time.perf_counter()
    layout = layout_of(cfg.distributed, world_size)
    if layout.multi_axis and layout.backend == "fully_sharded":
        return verify_axes(cfg, task, world_size)
    if layout.backend != "fully_sharded" or world_size == 1:
        return [f"verify_plan: nothing to check for {layout.label(world_size)} at world size {world_size} (it checks "
                "fully_sharded across ranks)"]  # fmt: skip
    cfg_plan = copy.deepcopy(cfg)
    cfg_plan.optimization.batch_size = 0  # the state and the collectives need no activations: no meta forward
    profile, ctx = profile_config(cfg_plan, task, world_size, model_on_meta(task))
    f = layout.sharding_degree
    reductions = ctx.update_freq if ctx.reduce_every_microbatch else 1
    planned_collectives = expert_collectives(profile, layout, ctx)  # collectives' own at expert-parallel degree 1
    for rank in sorted({0, world_size - 1}):
        with fake_process_group(world_size, rank):
            model, fsdp_modules = shard_on_fake_group(cfg, task, world_size, rank)
            state = measured_state(fsdp_modules, ctx.optimizer_state_bytes)
            if rank == 0:
                measured = measured_collectives(fsdp_modules, ctx.update_freq, reductions)
                tracked = tracked_state(task, model, ctx.optimizer_state_bytes, layout.ep)
        planned = expert_rank_state(profile, layout, ctx, rank % f).__dict__
        for key, value in planned.items():
            if state[key] != value:
                raise PlanMismatch(
                    f"verify_plan: rank {rank} of {world_size}: fully_shard gives {state[key]:,} bytes of {key}, the "
                    f"memory plan {value:,} ({layout.label(world_size)})"
                )
        if rank == 0 and isinstance(tracked, dict):  # the second check, once the first agrees
            _compare_tracked(tracked, planned, world_size, layout.label(world_size))
    if measured != planned_collectives:
        first = next((i for i, (m, p) in enumerate(zip(measured, planned_collectives, strict=False)) if m != p), None)
        where = (
            f"collective {first}: fully_shard {measured[first]}, the plan {planned_collectives[first]}"
            if first is not None
            else f"fully_shard issues {len(measured)} collectives, the plan {len(planned_collectives)}"
        )
        raise PlanMismatch(f"verify_plan: one step's collectives differ at {where}")
    sent = sum(c.sent for c in measured)
    last = expert_rank_state(profile, layout, ctx, (world_size - 1) % f)
    first_rank = expert_rank_state(profile, layout, ctx, 0)
    return [
        f"verify_plan: the real fully_shard at world size {world_size} ({layout.label(world_size)}) on a fake "
        f"process group matches the plan: params {first_rank.params / GiB:.3f} GiB per rank (local shards: rank 0 "
        f"{first_rank.local_params / GiB:.3f}, rank {world_size - 1} {last.local_params / GiB:.3f}), grads "
        f"{first_rank.grads / GiB:.3f}, optimizer rank 0 {first_rank.optimizer / GiB:.3f} / rank {world_size - 1} "
        f"{last.optimizer / GiB:.3f}; {len(measured)} collectives sending {sent / GiB:.2f} GiB per step; checked in "
        f"{time.perf_counter() - started:.1f} s, nothing allocated; "
        + (
            "torch's FSDPMemTracker over one fake step on rank 0 counts the same params, grads and optimizer state"
            if isinstance(tracked, dict)
            else f"the FSDPMemTracker check did not run: {tracked}"
        )
    ]


def tracked_state(task, model: nn.Module, optimizer_state_bytes: int, expert_degree: int) -> dict[str, int] | str:
    """The second check's side: this rank's bytes of sharded params, sharded grads and optimizer state (less the
    optimizer's step counters, which the plan leaves out) as torch's FSDPMemTracker counts them over one step of
    ``model`` (sharded on meta by shard_on_fake_group, given fake storage here); or why it cannot run."""
    from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException, FakeTensorMode
    from torch.utils._pytree import tree_map

    tracker_class = torch_internals.fsdp_mem_tracker()
    if tracker_class is None:
        return f"torch {torch.__version__} has no FSDPMemTracker as tested (shardlab.distributed.torch_internals)"
    if expert_degree > 1:
        return "under expert parallelism the tokens' all-to-all sizes depend on routing, which fake tensors lack"
    moments = {0: 0, 4: 1, 8: 2}.get(optimizer_state_bytes)
    example = task.example_batch(1)
    if example is None or moments is None:
        why = "no example batch" if example is None else f"{optimizer_state_bytes} bytes of optimizer state"
        return f"the plan counts {why}, so one step cannot be run as planned"
    with FakeTensorMode(allow_non_fake_inputs=True):
        model.to_empty(device="cpu")
        trainable = [p for p in model.parameters() if p.requires_grad]
        # as many fp32 moments per parameter as the plan counts: SGD (0), SGD with momentum (1), AdamW (2)
        optimizer = torch.optim.AdamW(trainable) if moments == 2 else torch.optim.SGD(trainable, momentum=moments)
        batch = tree_map(lambda t: torch.zeros(t.shape, dtype=t.dtype) if isinstance(t, torch.Tensor) else t, example)
        tracker = tracker_class(model, optimizer)
        try:
            with tracker:
                loss, _ = task.loss(model, batch, torch.device("cpu"))
                loss.backward()
                optimizer.step()
        except (DataDependentOutputException, DynamicOutputShapeException) as e:
            return f"the task's step needs values fake tensors do not hold ({type(e).__name__}: {e})"
        except Exception as e:  # a second check that cannot run says so; the first one runs either way
            return f"the task's step failed under fake tensors ({type(e).__name__}: {e})"
        counts = {
            getattr(kind, "value", kind): n for kind, n in tracker.get_tracker_snapshot()[torch.device("cpu")].items()
        }
        steps = sum(s["step"].numel() * s["step"].element_size() for s in optimizer.state.values() if "step" in s)
    params, grads, state = (counts.get(kind, 0) for kind in torch_internals.TRACKED_KINDS)
    return {"params": params, "grads": grads, "optimizer": state - steps}


def _compare_tracked(tracked: dict[str, int], planned: dict[str, int], world_size: int, label: str) -> None:
    for key, value in tracked.items():
        if value != planned[key]:
            raise PlanMismatch(
                f"verify_plan: rank 0 of {world_size}: torch's FSDPMemTracker counts {value:,} bytes of {key} over "
                f"one step, the memory plan {planned[key]:,} ({label})"
            )


# ---- layouts with tensor, pipeline or context axes ------------------------------------------------------------------
def verify_axes(cfg, task, world_size: int) -> list[str]:
    """The plan of a multi-axis layout held against the real mesh and fully_shard, seen from the first and the last
    rank (the first and the last pipeline stage): ParallelDims.build makes the mesh on the fake process group, the
    task's tensor-parallel plan (Task.tensor_parallel_plan, where the task has one) is applied over its "tp" axis
    with torch's parallelize_module, and each of the rank's stages' units is fully_shard-ed over the data-shard axis
    (replicated over dp_replicate); their bytes must equal the plan's for that stage (shardlab.memory.axes). The
    root's own parameters (a final norm) are left out of both sides: under PP they belong to the last stage's module,
    which the pipeline backend, not the plan, builds."""
    from shardlab.distributed.mesh import ParallelDims
    from shardlab.memory.axes import _sub_profile, model_rank_profile, stage_units
    from shardlab.memory.pipeline import rank_stages

    started = time.perf_counter()
    dims = ParallelDims.from_config(cfg.distributed, world_size)
    layout = layout_of(cfg.distributed, world_size)
    cfg_plan = copy.deepcopy(cfg)
    cfg_plan.optimization.batch_size = 0  # the state needs no activations: no meta forward
    profile, ctx = profile_config(cfg_plan, task, world_size, model_on_meta(task))
    stages = stage_units(profile, dims.pp * layout.stages_per_rank, layout.stage_split)
    # FSDP over dp_shard x cp (torchtitan's dp_shard_cp): a context rank's shard index runs fastest within it
    data_layout = dataclasses.replace(layout, sharding_degree=layout.sharding_degree * dims.cp, tp=1, pp=1, cp=1)
    checked = []
    for rank in sorted({0, world_size - 1}):
        coords = dims.coordinates(rank)
        mine = rank_stages(coords["pp"], dims.pp, layout.stages_per_rank, layout.schedule)
        units = [u for s in mine for u in stages[s]]
        with fake_process_group(world_size, rank):
            mesh = dims.build("cpu")
            state, tp_applied = _sharded_stage_state(cfg, task, mesh, dims, units, ctx.optimizer_state_bytes)
        rank_profile = model_rank_profile(profile, dims.tp if tp_applied else 1, 1)
        shard_index = coords["dp_shard"] * dims.cp + coords["cp"]
        # expert_rank_state: rank_state with the experts as expert parallelism places them (rank_state's without)
        planned = expert_rank_state(_sub_profile(rank_profile, units, False), data_layout, ctx, shard_index).__dict__
        for key, value in planned.items():
            if state[key] != value:
                raise PlanMismatch(
                    f"verify_plan: rank {rank} of {world_size} ({dims.describe()}): the real mesh and fully_shard "
                    f"give {state[key]:,} bytes of {key}, the memory plan {value:,} ({layout.label(world_size)})"
                )
        checked.append(
            f"rank {rank} (pipeline rank {coords['pp']}, {len(units)} units): params "
            f"{planned['params'] / GiB:.3f} GiB, optimizer {planned['optimizer'] / GiB:.3f} GiB"
        )
    tp_note = "the task's tensor-parallel plan applied" if tp_applied else (
        "tensor parallelism NOT applied: the task gives no tensor-parallel plan, so the FSDP part was checked on "
        "whole layers" if dims.tp > 1 else "no tensor axis")  # fmt: skip
    lines = [
        f"verify_plan: the real mesh ({dims.describe()}) and fully_shard at world size {world_size} on a fake process "
        f"group match the plan ({tp_note}): {'; '.join(checked)}; checked in {time.perf_counter() - started:.1f} s, "
        "nothing allocated"
    ]
    return lines + ([_stage_step_line(cfg, task, world_size)] if dims.pp > 1 else [])


def _stage_step_line(cfg, task, world_size: int) -> str:
    """Pipeline rank 0's step on fake tensors (shardlab.memory.stage_step) against the plan's peak of that rank: the
    plan must not count less than the step held."""
    from shardlab.memory.stage_step import measure_stage_step

    step = measure_stage_step(cfg, task, world_size)
    if isinstance(step, str):
        return f"verify_plan: pipeline rank 0's step on fake tensors not run: {step}"
    layout, planned = layout_of(cfg.distributed, world_size), step.planned
    if planned < step.peak:
        raise PlanMismatch(
            f"verify_plan: pipeline rank 0's step on fake tensors held {size_text(step.peak)} at its peak, the "
            f"memory plan {size_text(planned)} for that rank ({layout.label(world_size)})"
        )
    return (
        f"verify_plan: pipeline rank 0's step (stages {', '.join(map(str, step.stages))}) through torch's schedule on "
        f"fake tensors held {size_text(step.peak)} at its peak ({size_text(step.state)} of it parameters and "
        f"optimizer state); the plan's rank 0: {size_text(planned)} ({planned / step.peak - 1:+.1%}); measured in "
        f"{step.seconds:.1f} s"
    )


def _sharded_stage_state(cfg, task, mesh, dims, units: list[int], state_bytes: int) -> tuple[dict, bool]:
    """The bytes this rank's units hold once tensor-parallelized (if the task gives a plan) and fully_shard-ed over
    the mesh's data axes, as the backend applies them: TP first, then FSDP with the run's mixed precision; and
    whether TP was applied."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    from shardlab.distributed.base import resolve_dtypes

    model = model_on_meta(task)
    task_units = task.fsdp_units(model)
    ask = getattr(task, "tensor_parallel_plan", None)  # a task method (None: the task cannot use TP)
    tp_plan = ask(model) if ask is not None and dims.tp > 1 else None
    if tp_plan is not None:
        parallelize_module(model, mesh["tp"], tp_plan)
    sharded = _shard_experts(task, model, dims, cfg)
    data_dims = tuple(name for name in ("dp_replicate", "dp_shard", "cp") if getattr(dims, name) > 1)
    data_mesh = None
    if "cp" in data_dims:  # FSDP over dp_shard x cp flattened, as the fully_sharded backend shards
        from shardlab.distributed.context_parallel import data_mesh_with_context

        data_mesh = data_mesh_with_context(mesh, "cpu")
    elif data_dims:
        data_mesh = mesh[data_dims]
    param_dtype, reduce_dtype = resolve_dtypes(cfg.distributed)
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    for i in units:
        if data_mesh is not None:
            fully_shard(task_units[i], mesh=data_mesh, mp_policy=policy, reshard_after_forward=False)
            sharded.append(task_units[i])
    if not sharded:
        raise ConfigError("distributed.verify_plan checks fully_shard over the data ranks; this layout has one")
    return measured_state(sharded, state_bytes), tp_plan is not None


def _shard_experts(task, model, dims, cfg) -> list:
    """Under distributed.expert_parallel_degree > 1 (with tensor parallelism: ep is refused with pp and cp), the
    backend's expert split on the expert mesh and each expert module's own fully_shard over the ranks outside its
    group (FullyShardedBackend.parallelize's order: before the units that hold them); the modules sharded."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from shardlab.distributed.base import resolve_dtypes
    from shardlab.distributed.expert_parallel import expert_fsdp_mesh, expert_shard_placement, split_experts

    if dims.ep == 1:
        return []
    experts = task.expert_modules(model)
    expert_mesh = dims.expert_mesh("cpu")
    split_experts(experts, expert_mesh["ep"])
    param_dtype, reduce_dtype = resolve_dtypes(cfg.distributed)
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    mesh = expert_fsdp_mesh(expert_mesh)
    for module in experts:
        fully_shard(module, mesh=mesh, mp_policy=policy, reshard_after_forward=False,
                    shard_placement_fn=lambda p: expert_shard_placement(p, mesh.size(mesh.ndim - 1)))  # fmt: skip
    return experts
