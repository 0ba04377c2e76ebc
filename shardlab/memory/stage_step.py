"""Pipeline rank 0's training step at the job's scale, on fake tensors: the live bytes at its peak, beside the plan.

distributed.verify_plan holds the plan's *state* of a multi-axis layout to the real mesh and fully_shard
(verify.verify_axes); this holds its *peak* to the real step. Pipeline rank 0 (the first stage, which keeps the most
micro-batches in flight under 1F1B) is built as training builds it: the task's model, the fully_sharded backend's
parallelize (tensor parallelism, activation checkpointing, FSDP2 over the data axes), torch's PipelineStage and the
configured schedule (shardlab.distributed.pipeline.build_pipeline), on torch's fake process group at the job's world
size, its parameters given fake storage (FakeTensorMode: shapes and dtypes, no bytes). Two optimizer steps of the
plan's micro-batches run through it: the first creates the optimizer's state, the second is measured. LiveBytes
counts each tensor storage an op creates until Python frees it, the parameters and optimizer state included: the
step's peak of live bytes, what the device's allocator must hold in eager mode (its rounding and fragmentation
aside, which the plan adds separately).

Not measured: kernel workspaces (cuBLAS's, flash attention's) and anything outside torch's tensors; the CPU attention
kernel stands in for CUDA's flash attention (both keep the output and the log-sum-exp). A fake process group cannot
learn the stages' shapes at the first step (torch refuses), so they are given (stage_metadata): the first stage's
token ids, and the residual stream crossing each stage boundary, split by sequence under TP. Values are fake too: a
step's losses and norms mean nothing, so the trainer's checks on them are not run, only the schedule and the
optimizer. The same step runs on a device's real tensors too (``storage``: "cpu", "cuda"), where CUDA's caching
allocator gives its own peak beside LiveBytes' (shardlab_bench/stage_step.py, tools/gpu_check.sh memory); on CPU the
real count equals the fake one to the byte.

Private torch names, as verify.py uses them (torch_internals.TESTED_TORCH): FakeStore (fake_group.fake_process_group),
FakeTensorMode, and TorchDispatchMode (torch.utils._python_dispatch, what torch's own memory trackers subclass);
tests/unit/test_stage_step.py fails when they stop measuring.
"""

from __future__ import annotations

import contextlib
import time
import weakref
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from shardlab.memory.fake_group import fake_process_group


class LiveBytes(TorchDispatchMode):
    """Bytes of the tensor storages alive now and at their peak: each storage an op's output holds is counted once
    (views share it) from the op that made it until Python frees it."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, int] = {}
        self._refs: dict[int, weakref.ref] = {}
        self.now = self.peak = self.ops = 0

    def track(self, tensor) -> None:
        """Count ``tensor``'s storage (its local shard for a DTensor) from now until it is freed."""
        if not isinstance(tensor, torch.Tensor):
            return
        local = getattr(tensor, "_local_tensor", tensor)
        storage = local.untyped_storage()
        key = id(storage)
        if key in self.live:
            return
        self.live[key] = storage.nbytes()
        self.now += self.live[key]
        self.peak = max(self.peak, self.now)
        self._refs[key] = weakref.ref(storage, lambda _ref, key=key: self._freed(key))

    def _freed(self, key: int) -> None:
        self.now -= self.live.pop(key, 0)
        self._refs.pop(key, None)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops += 1
        for tensor in tree_flatten(out)[0]:
            self.track(tensor)
        return out


@dataclass(frozen=True)
class StageStep:
    """What pipeline rank 0's measured step held."""

    peak: int
    """Live bytes at the step's peak, parameters and optimizer state included."""
    state: int
    """Live bytes before it: the sharded parameters and the optimizer state."""
    stages: tuple[int, ...]
    """The global stages rank 0 holds."""
    planned: int
    """The memory plan's peak of pipeline rank 0 for the same layout (AxesDetail.rank_peaks[0]: without the CPU
    runtime or allocator terms), from the profile the step's shapes came from."""
    ops: int
    seconds: float
    device_peak: int | None = None
    """On CUDA (``storage="cuda"``): the caching allocator's peak of allocated bytes over the measured step
    (torch.cuda.max_memory_allocated), what ``peak`` stands for on fake tensors; None elsewhere."""


def measure_stage_step(cfg, task, world_size: int, storage: str = "fake") -> StageStep | str:
    """Pipeline rank 0's second training step under ``cfg`` (distributed.pipeline_parallel_degree > 1, the
    fully_sharded backend) at ``world_size`` ranks, on fake tensors; or why it cannot run, in a phrase.
    ``storage="cuda"`` (or "cpu") runs it on real, uninitialized tensors of that device instead, still on the fake
    process group (its collectives leave their outputs unwritten, so values mean nothing): what tools/gpu_check.sh
    holds the fake count to, beside the CUDA allocator's own peak."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from shardlab.distributed.units import model_on_meta
    from shardlab.memory.plan import profile_config

    d = cfg.distributed
    if d.pipeline_parallel_degree == 1 or d.context_parallel_degree > 1 or d.expert_parallel_degree > 1:
        return "it measures pipeline layouts without context or expert parallelism"
    width = getattr(cfg.model, "dim", None)  # the residual stream's, which crosses the stage boundaries
    if task.example_batch(1) is None or width is None:
        return "the task gives no example batch or its model no width (model.dim)"
    profile, ctx = profile_config(cfg, task, world_size, model_on_meta(task))
    moments = {0: 0, 4: 1, 8: 2}.get(ctx.optimizer_state_bytes)
    if moments is None:
        return f"the plan counts {ctx.optimizer_state_bytes} bytes of optimizer state, not fp32 moments"
    place = FakeTensorMode(allow_non_fake_inputs=True) if storage == "fake" else storage
    try:
        return _measure(cfg, task, world_size, place, profile, ctx, moments, width)
    except Exception as e:  # a check that cannot run says so (verify_plan's other checks stand)
        return f"the step failed on {storage} tensors ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"


def _measure(cfg, task, world_size: int, storage, profile, ctx, moments: int, width: int) -> StageStep | str:
    from shardlab.memory.estimate import estimate
    from shardlab.memory.layout import layout_of

    started = time.perf_counter()
    shape = (profile.local_batch, cfg.data.seq_len, width)
    cuda = storage == "cuda"
    with fake_rank_pipeline(cfg, task, world_size, 0, storage, shape) as pipeline:
        if pipeline.is_last:
            return "pipeline rank 0 holds the last stage (its loss's shapes are not given)"
        with storage if not isinstance(storage, str) else contextlib.nullcontext():
            trainable = [p for p in pipeline.model.parameters() if p.requires_grad]
            # as many fp32 moments per parameter as the plan counts: SGD (0), SGD with momentum (1), AdamW (2)
            optimizer = torch.optim.AdamW(trainable) if moments == 2 else torch.optim.SGD(trainable, momentum=moments)
            example = task.example_batch(profile.local_batch)
            batches = [torch.zeros(example.shape, dtype=example.dtype) for _ in range(ctx.update_freq)]
            pipeline._keys = []  # the loss's sums are the last stage's; rank 0 learns no names from a fake group
            tracker = LiveBytes()
            for step in range(2):
                if step == 1:  # what the step starts with: the sharded parameters, the optimizer's state
                    moments_held = [t for per_param in optimizer.state.values() for t in per_param.values()]
                    for tensor in [*pipeline.model.parameters(), *moments_held]:
                        tracker.track(tensor)
                    state = tracker.now
                    if cuda:
                        torch.cuda.synchronize()
                        torch.cuda.reset_peak_memory_stats()
                with tracker if step == 1 else contextlib.nullcontext():
                    pipeline.train_step(batches)
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
            device_peak = torch.cuda.max_memory_allocated() if cuda else None
        stages = tuple(s.stage_index for s in pipeline.stages)
    planned = estimate(profile, layout_of(cfg.distributed, world_size), ctx).axes.rank_peaks[0]
    return StageStep(
        peak=tracker.peak, state=state, stages=stages, planned=planned, ops=tracker.ops,
        seconds=time.perf_counter() - started, device_peak=device_peak,
    )  # fmt: skip


@contextlib.contextmanager
def fake_rank_pipeline(cfg, task, world_size: int, rank: int, storage=None, shape: tuple[int, int, int] | None = None):
    """Pipeline rank ``rank``'s stages and schedule, built as training builds them (FullyShardedBackend on the mesh
    its setup makes, shardlab.distributed.pipeline.build_pipeline) on the fake process group, for the block. Its
    parameters are materialized as ``storage`` says: a FakeTensorMode's fake tensors, a device's ("cpu", "cuda":
    uninitialized), or not at all (None: left on meta). With ``shape`` (samples per micro-batch, sequence length,
    width) the stages are given their static shapes, so the schedule can run: the first stage's token ids, and
    between stages the residual stream, split by sequence under TP."""
    from shardlab.distributed.env import DistEnv
    from shardlab.distributed.fully_sharded import FullyShardedBackend
    from shardlab.distributed.pipeline import build_pipeline
    from shardlab.distributed.units import model_on_meta

    on = storage if isinstance(storage, str) else "cpu"
    device = torch.device("cuda", torch.cuda.current_device()) if on == "cuda" else torch.device(on)

    def materialize(module: torch.nn.Module) -> None:
        if storage is not None:
            with storage if not isinstance(storage, str) else contextlib.nullcontext():
                module.to_empty(device=device)

    with fake_process_group(world_size, rank):
        backend = FullyShardedBackend(cfg.distributed, DistEnv(rank, world_size, rank, "127.0.0.1", 0, "none"))
        backend.device = device  # the fake backend serves any device
        backend.mesh = backend.dims.build(device.type, keep=("dp_shard",))  # as FullyShardedBackend.setup makes it
        metadata = None
        if shape is not None:
            samples, length, width = shape
            dtype = backend.param_dtype or torch.float32
            boundary = torch.empty(samples, length // backend.dims.tp, width, dtype=dtype, device="meta")
            tokens = torch.empty(samples, length, dtype=torch.long, device="meta")

            def metadata(index: int) -> dict:
                inputs = tokens if index == 0 else boundary
                return {"input_args": (inputs,), "output_args": (boundary,), "output_grads": (boundary,),
                        "input_grads": (None if index == 0 else boundary,)}  # fmt: skip

        model = model_on_meta(task)
        yield build_pipeline(cfg, task, backend, model, task.fsdp_units(model), materialize, metadata)
