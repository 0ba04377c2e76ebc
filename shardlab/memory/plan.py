"""The memory plan: what one rank will hold at its peak, predicted before anything is allocated, for the configured
layout and for the alternatives (ddp, fully_sharded with or without resharding, hybrid degrees, activation
checkpointing, CPU offload). ``plan_run`` is a run's planning step (the units and bytes per rank of the model its
caller built on meta, the lines printed before it allocates); what distributed.backend=auto chooses from the plan is
shardlab.memory.budget's.

Parameters, gradients and optimizer state follow from parameter counts. Gathered units follow from the FSDP unit
sizes and the reshard/prefetch settings. Activations come from one forward of the model on the meta device under a
saved-tensor hook: what autograd keeps for backward, per unit, with nothing computed or allocated. Everything is in
bytes per rank above an idle rank (torch imported, process group joined).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from shardlab.distributed.activation_checkpointing import SAVE_OP_GROUPS, checkpointed_units
from shardlab.distributed.units import count_params, describe_units, model_on_meta, wrapped_units
from shardlab.memory import devices

GiB = 2**30
OPTIMIZER_STATE_BYTES = {"adamw": 8, "cpu_adam": 8}
"""fp32 bytes of optimizer state per parameter (two Adam moments); sgd and lars: their momentum buffer, when on."""


# ---- what the model is made of (one meta forward) --------------------------------------------------------------------
@dataclass
class ModelProfile:
    params: int
    """All parameters (tied ones once)."""
    unit_params: list[int]
    """Parameters of each FSDP unit, in forward order; the rest belong to the root unit."""
    activations: int | None
    """Bytes autograd saves for backward in one micro-batch on one rank; None when the task gives no example batch."""
    unit_activations: list[int]
    """Of those, the bytes first saved inside each unit (what checkpointing recomputes)."""
    unit_inputs: list[int]
    """Bytes of each unit's input (what checkpointing keeps instead)."""
    largest_outside: int
    """The largest tensor saved outside the units (the logits' softmax): backward starts with gradients its size."""
    local_batch: int
    activation_error: str | None = None
    """Why activations could not be counted (the model does not run on the meta device), if so."""
    autocast_copies: int = 0
    """Of the activations, the low-precision copies of weights autocast makes (it caches one per weight for the
    forward, and backward keeps those the matmuls saved): counted only in an autocast profile."""
    autocast: ModelProfile | None = None
    """The same model profiled under autocast (fp32 weights, ops casting as autocast does), for the layouts that
    compute in low precision through autocast (single, ddp); None when parameters are fp32."""
    unit_shapes: list[list[tuple[int, int]]] | None = None
    """Each unit's parameters as (rows, elements per row): FSDP2 shards every parameter by rows, padding the row
    count to a multiple of the shard group, so a rank's bytes follow the shapes, not the count."""
    root_shapes: list[tuple[int, int]] | None = None
    """The root unit's parameters, likewise."""
    activation_slack: int = 0
    """What the CUDA caching allocator adds to the saved tensors by rounding each one (devices.allocator_bytes)."""
    unit_op_outputs: list[dict[str, int]] | None = None
    """Per unit, bytes of the outputs of each op group of activation_checkpointing.SAVE_OP_GROUPS (what
    selective_op keeps beside the unit's input)."""
    unit_op_overlap: list[dict[str, int]] | None = None
    """Per unit and op group, the bytes of the unit's saved tensors that are such outputs (selective_op's
    recomputation reuses them instead of saving them again)."""
    unit_matmuls: list[list[tuple[int, int]]] | None = None
    """Per unit, each matmul it runs, in forward order: (bytes of its output, bytes of the unit's saved tensors that
    are that output), for selective_op keeping only every n-th matmul (distributed.ac_matmul_save_every)."""
    trainable_shapes: list[list[tuple[int, int]]] | None = None
    """groups() of the parameters that train (requires_grad), when some are frozen (LoRA's base): only they have
    gradients and optimizer state; None: all train."""

    @property
    def root_params(self) -> int:
        return self.params - sum(self.unit_params)

    def trainable(self) -> list[list[tuple[int, int]]]:
        """groups() of the parameters that get gradients and optimizer state."""
        return self.groups() if self.trainable_shapes is None else self.trainable_shapes

    @property
    def trainable_params(self) -> int:
        return sum(rows * width for g in self.trainable() for rows, width in g)

    def groups(self) -> list[list[tuple[int, int]]]:
        """The parameter shapes of each FSDP unit, then the root's (the order fully_shard is applied in)."""
        if self.unit_shapes is None or self.root_shapes is None:  # a profile made by hand: one row per element
            return [[(n, 1)] for n in [*self.unit_params, self.root_params]]
        return [*self.unit_shapes, self.root_shapes]


def param_shapes(params) -> list[tuple[int, int]]:
    return [(p.shape[0], p.numel() // p.shape[0]) if p.dim() else (1, 1) for p in params]


def shard_rows(rows: int, degree: int, rank: int | None = None) -> int:
    """Rows of a ``rows``-row parameter a rank of a ``degree``-rank shard group holds, as FSDP2 chunks it
    (torch.chunk: ceil(rows / degree) per rank, the last ranks fewer or none). ``rank=None``: the padded shard every
    rank allocates (FSDP2 pads each shard to the first one's size)."""
    chunk = -(-rows // degree)
    if rank is None:
        return chunk
    return max(0, min(chunk, rows - rank * chunk))


def shard_numel(shapes: list[tuple[int, int]], degree: int, rank: int | None = None) -> int:
    return sum(shard_rows(rows, degree, rank) * width for rows, width in shapes)


class _FusedAttentionShapes(torch.autograd.Function):
    """Stands in for scaled_dot_product_attention on meta tensors with what a fused kernel (flash on CUDA, the flash
    kernel torch uses on CPU) saves: q, k, v as given (with fewer key/value heads under enable_gqa), the output and
    one float per query row. The meta device's own attention decomposes into the math path, which would count a
    (length x length) matrix no real run keeps. The output is laid out as the kernels write it, (..., length, heads,
    width) seen through a transpose, so the usual ``transpose(1, 2).reshape`` after attention is a view, not a copy
    the plan would count again."""

    @staticmethod
    def forward(ctx, q, k, v):
        *batch, heads, length, _ = q.shape
        out = q.new_empty((*batch, length, heads, v.shape[-1])).transpose(-3, -2)
        row_stats = q.new_empty(q.shape[:-1], dtype=torch.float32)
        ctx.save_for_backward(q, k, v, out, row_stats)
        for recorder in _OpOutputs.active:  # what the fused kernel returns, as the attention op's outputs
            recorder.note("attention", (out, row_stats))
        return out

    @staticmethod
    def backward(ctx, grad):  # never run: the plan only counts what forward saves
        raise NotImplementedError


GROUP_OF_OP = {op: group for group, ops in SAVE_OP_GROUPS.items() for op in ops}


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata  # a view, or _unsafe_view after a matmul, shares its base's storage


class _OpOutputs(TorchDispatchMode):
    """Below autograd, where F.linear has become mm/addmm: the outputs of the op groups selective_op can keep, by
    storage, with the unit they were made in (``current[0]``; -1 outside the units). Kept alive until the profile is
    read, so no storage key is reused."""

    active: list[_OpOutputs] = []

    def __init__(self, current: list[int]) -> None:
        super().__init__()
        self.current = current
        self.outputs: dict[int, tuple[int, str, torch.Tensor]] = {}
        self.matmuls: dict[int, list[torch.Tensor]] = {}
        """Per unit, the output of each matmul call in order (ac_matmul_save_every's policy counts calls)."""

    def note(self, group: str, out) -> None:
        if self.current[0] < 0:
            return
        if group == "matmul":
            self.matmuls.setdefault(self.current[0], []).append(out)
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and _storage_key(t) not in self.outputs:
                self.outputs[_storage_key(t)] = (self.current[0], group, t)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in GROUP_OF_OP:
            self.note(GROUP_OF_OP[func], out)
        return out

    def __enter__(self):
        _OpOutputs.active.append(self)
        return super().__enter__()

    def __exit__(self, *exc):
        _OpOutputs.active.remove(self)
        return super().__exit__(*exc)

    def per_unit(self, num_units: int, saved: dict[int, torch.Tensor], owner: dict[int, int]):
        """(bytes of each unit's outputs per group, bytes of its saved tensors that are such outputs, per group)."""
        outputs: list[dict[str, int]] = [dict.fromkeys(SAVE_OP_GROUPS, 0) for _ in range(num_units)]
        overlap: list[dict[str, int]] = [dict.fromkeys(SAVE_OP_GROUPS, 0) for _ in range(num_units)]
        for unit, group, t in self.outputs.values():
            outputs[unit][group] += _nbytes(t)
        for key, base in saved.items():
            made = self.outputs.get(_storage_key(base))
            if made is not None and made[0] == owner[key]:
                overlap[made[0]][made[1]] += _nbytes(base)
        return outputs, overlap

    def matmuls_per_unit(self, num_units: int, saved: dict[int, torch.Tensor], owner: dict[int, int]):
        """Per unit, (bytes of the output, bytes of the unit's saved tensors that are it) of each matmul in order."""
        saved_bytes: dict[tuple[int, int], int] = {}
        for key, base in saved.items():
            where = (owner[key], _storage_key(base))
            saved_bytes[where] = saved_bytes.get(where, 0) + _nbytes(base)
        return [
            [(_nbytes(t), saved_bytes.get((unit, _storage_key(t)), 0)) for t in self.matmuls.get(unit, [])]
            for unit in range(num_units)
        ]


class _MetaAttention(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention and kwargs.get("attn_mask") is None and args[0].is_meta:
            return _FusedAttentionShapes.apply(*args[:3])
        return func(*args, **kwargs)


# What torch.autocast does to the inputs of an op, per device type (the ops these models call from Python; autocast
# itself works in the dispatcher, below anything a meta forward can see, and ignores meta tensors).
AUTOCAST_LOW_PRECISION = (
    F.linear, F.conv1d, F.conv2d, F.conv3d, F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d,
    torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.mm, torch.bmm, torch.addmm, torch.baddbmm,
    F.scaled_dot_product_attention,
)  # fmt: skip
"""Ops autocast runs in the low-precision dtype, on CPU and CUDA alike: their floating inputs are cast."""
AUTOCAST_FP32 = {
    "cpu": (F.cross_entropy, F.nll_loss, F.mse_loss, F.binary_cross_entropy_with_logits),
    "cuda": (
        F.cross_entropy, F.nll_loss, F.mse_loss, F.binary_cross_entropy_with_logits, F.layer_norm, F.group_norm,
        F.softmax, F.log_softmax, torch.softmax, torch.log_softmax, torch.Tensor.softmax, torch.Tensor.log_softmax,
    ),
}  # fmt: skip
"""Ops autocast runs in fp32 (CUDA's list also holds the norms and softmax; CPU's does not)."""


class _MetaAutocast(TorchFunctionMode):
    """torch.autocast's casts, done on meta tensors: inputs of low-precision ops cast to ``dtype`` (a weight once per
    forward, as autocast's cache does), inputs of fp32 ops to fp32; every other op follows type promotion."""

    def __init__(self, dtype: torch.dtype, device: str) -> None:
        super().__init__()
        self.dtype, self.fp32_ops = dtype, AUTOCAST_FP32[device]
        self.weight_copies: dict[int, torch.Tensor] = {}

    def _cast(self, t, dtype: torch.dtype):
        if not (isinstance(t, torch.Tensor) and t.is_floating_point()) or t.dtype == dtype:
            return t
        if isinstance(t, nn.Parameter) and t.requires_grad and dtype == self.dtype:
            if id(t) not in self.weight_copies:
                self.weight_copies[id(t)] = t.to(dtype)
            return self.weight_copies[id(t)]
        return t.to(dtype)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        dtype = self.dtype if func in AUTOCAST_LOW_PRECISION else torch.float32 if func in self.fp32_ops else None
        if dtype is not None:
            args = tuple(self._cast(a, dtype) for a in args)
            kwargs = {k: self._cast(v, dtype) for k, v in kwargs.items()}
        return func(*args, **kwargs)


def profile_model(
    model: nn.Module,
    units: list[nn.Module],
    task,
    local_batch: int,
    dtype: torch.dtype,
    autocast_device: str | None = None,
) -> ModelProfile:
    """Count ``model``'s parameters and, when the task can make an example batch, the bytes one micro-batch of
    ``local_batch`` samples saves for backward with parameters in ``dtype``. ``model`` is on meta and is cast.
    ``autocast_device`` (cpu or cuda): instead keep the parameters in fp32 and cast as torch.autocast to ``dtype``
    does on that device, counting its weight copies."""
    params = count_params(model)
    unit_params = [count_params(u) for u in units]
    in_units = {id(p) for u in units for p in u.parameters()}
    shapes = {
        "unit_shapes": [param_shapes(u.parameters()) for u in units],
        "root_shapes": param_shapes(p for p in model.parameters() if id(p) not in in_units),
    }
    if not all(p.requires_grad for p in model.parameters()):  # frozen weights: no gradients, no optimizer state
        trained = [[p for p in u.parameters() if p.requires_grad] for u in units]
        root = [p for p in model.parameters() if id(p) not in in_units and p.requires_grad]
        shapes["trainable_shapes"] = [param_shapes(g) for g in [*trained, root]]
    batch = task.example_batch(local_batch) if local_batch > 0 else None
    if batch is None:
        return ModelProfile(params, unit_params, None, [0] * len(units), [0] * len(units), 0, local_batch, **shapes)
    restore = _cast_floating(model, dtype) if autocast_device is None else (lambda: None)
    autocast = _MetaAutocast(dtype, autocast_device) if autocast_device is not None else contextlib.nullcontext()
    param_ids = {id(p) for p in model.parameters()}
    saved: dict[int, torch.Tensor] = {}  # by id of the base tensor: views of one tensor are kept once
    owner: dict[int, int] = {}  # base id -> unit index (-1: outside the units)
    inputs = [0] * len(units)
    current = [-1]

    def pack(t: torch.Tensor) -> torch.Tensor:
        base = t._base if t._base is not None else t
        if id(base) not in param_ids and id(t) not in param_ids and id(base) not in saved:
            saved[id(base)] = base
            owner[id(base)] = current[0]
        return t

    def enter(i: int):
        def hook(module, args):
            current[0] = i
            first = args[0] if args else None
            inputs[i] = _nbytes(first) if isinstance(first, torch.Tensor) else 0

        return hook

    def leave(module, args, output):
        current[0] = -1

    handles = []
    for i, unit in enumerate(units):
        handles.append(unit.register_forward_pre_hook(enter(i)))
        handles.append(unit.register_forward_hook(leave))
    ops = _OpOutputs(current)
    try:
        with _MetaAttention(), autocast, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), ops:
            model.train()
            task.loss(model, batch if autocast_device else _cast_inputs(batch, dtype), torch.device("meta"))
    except Exception as e:  # a model that cannot run on meta still trains; only its activations go unplanned
        reason = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
        empty = [0] * len(units)
        return ModelProfile(params, unit_params, None, empty, empty, 0, local_batch, reason, **shapes)
    finally:
        for h in handles:
            h.remove()
        restore()
    copy_ids = {id(c) for c in autocast.weight_copies.values()} if autocast_device is not None else set()
    per_unit = [0] * len(units)
    outside: list[int] = [0]
    for key, base in saved.items():
        n = _nbytes(base)
        if key in copy_ids:
            continue  # autocast's cache holds every copy to the end of forward: no unit's recomputation drops one
        if owner[key] >= 0:
            per_unit[owner[key]] += n
        else:
            outside.append(n)
    total = sum(_nbytes(b) for b in saved.values())
    slack = sum(devices.allocator_bytes(_nbytes(b)) - _nbytes(b) for b in saved.values())
    copies = 0
    if autocast_device is not None:
        # Every copy lives until the forward ends (autocast's cache), those the matmuls saved until backward.
        copies = sum(_nbytes(c) for c in autocast.weight_copies.values())
        total += sum(_nbytes(c) for c in autocast.weight_copies.values() if id(c) not in saved)
    op_outputs, op_overlap = ops.per_unit(len(units), saved, owner)
    return ModelProfile(
        params,
        unit_params,
        total,
        per_unit,
        inputs,
        max(outside),
        local_batch,
        None,
        copies,
        None,
        **shapes,
        activation_slack=slack,
        unit_op_outputs=op_outputs,
        unit_op_overlap=op_overlap,
        unit_matmuls=ops.matmuls_per_unit(len(units), saved, owner),
    )


def _cast_floating(model: nn.Module, dtype: torch.dtype):
    """Cast ``model``'s floating tensors to ``dtype`` in place (meta: free); returns a function undoing it, so the
    trainer can go on to materialize the same model in its own dtypes."""
    tensors = [t for t in [*model.parameters(), *model.buffers()] if t.is_floating_point()]
    originals = [t.dtype for t in tensors]
    for t in tensors:
        t.data = t.data.to(dtype)

    def restore() -> None:
        for t, original in zip(tensors, originals, strict=True):
            t.data = t.data.to(original)

    return restore


def _cast_inputs(batch, dtype: torch.dtype):
    """Floating inputs in the compute dtype, as FSDP's mixed precision (and autocast) feed them to the model."""
    if isinstance(batch, torch.Tensor):
        return batch.to(dtype) if batch.is_floating_point() else batch
    if isinstance(batch, (tuple, list)):
        return type(batch)(_cast_inputs(b, dtype) for b in batch)
    return batch


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


# ---- layouts and what each holds -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Layout:
    """One way to place the model: the distributed.* keys the plan compares."""

    backend: str
    sharding_degree: int = 1
    """Ranks a parameter is sharded over (1 = not sharded)."""
    reshard_after_forward: bool = True
    activation_checkpointing: bool = False
    """Whether any unit recomputes in backward (every unit, unless one of the two keys below narrows it)."""
    cpu_offload: bool = False
    ac_every_k_units: int = 1
    """> 1: only every k-th unit recomputes (activation_checkpointing=selective_layer)."""
    ac_save_ops: tuple[str, ...] = ()
    """Non-empty: every unit keeps these op groups' outputs and recomputes the rest (selective_op)."""
    ac_matmul_save_every: int = 1
    """selective_op: of the matmul outputs, only the 1st, (n+1)-th, ... of each unit are kept."""
    ac_skip_units: tuple[int, ...] = ()
    """Units that never recompute (distributed.ac_skip_units)."""

    @property
    def checkpointing(self) -> str:
        """The distributed.activation_checkpointing value of this layout."""
        if not self.activation_checkpointing:
            return "none"
        if self.ac_save_ops:
            return "selective_op"
        return "selective_layer" if self.ac_every_k_units > 1 else "full"

    def label(self, world_size: int) -> str:
        text = self.backend
        if self.backend == "fully_sharded":
            if self.sharding_degree < world_size:
                text = f"hybrid, shards of {self.sharding_degree}"
            if not self.reshard_after_forward:
                text += ", no reshard"
        if self.checkpointing == "full":
            text += " + act. ckpt"
        elif self.checkpointing == "selective_layer":
            text += f" + act. ckpt 1/{self.ac_every_k_units} units"
        elif self.checkpointing == "selective_op":
            text += " + op-selective ckpt"
            if self.ac_matmul_save_every > 1:
                text += f" (1/{self.ac_matmul_save_every} matmuls)"
        if self.ac_skip_units:
            text += f" except units {', '.join(map(str, self.ac_skip_units))}"
        if self.cpu_offload:
            text += " + cpu_offload"
        return text

    def overrides(self, world_size: int) -> dict:
        """The distributed.* values that select this layout."""
        values: dict = {"backend": self.backend, "activation_checkpointing": self.checkpointing}
        if self.checkpointing == "selective_layer":
            values["ac_every_k_units"] = self.ac_every_k_units
        elif self.checkpointing == "selective_op":
            values["ac_save_ops"] = list(self.ac_save_ops)
            values["ac_matmul_save_every"] = self.ac_matmul_save_every
        if self.checkpointing != "none":
            values["ac_skip_units"] = list(self.ac_skip_units)
        if self.backend == "fully_sharded":
            values.update(
                sharding_degree=-1 if self.sharding_degree == world_size else self.sharding_degree,
                reshard_after_forward=self.reshard_after_forward,
                cpu_offload=self.cpu_offload,
            )
        return values


def layout_of(d, world_size: int) -> Layout:
    """The layout a composed distributed section asks for."""
    mode = d.activation_checkpointing
    checkpointing = {
        "activation_checkpointing": mode != "none",
        "ac_every_k_units": d.ac_every_k_units if mode == "selective_layer" else 1,
        "ac_save_ops": tuple(d.ac_save_ops) if mode == "selective_op" else (),
        # getattr: configs recorded before these keys existed lack them
        "ac_matmul_save_every": getattr(d, "ac_matmul_save_every", 1) if mode == "selective_op" else 1,
        "ac_skip_units": tuple(getattr(d, "ac_skip_units", ())) if mode != "none" else (),
    }
    if d.backend != "fully_sharded":
        return Layout(d.backend, 1, True, cpu_offload=False, **checkpointing)
    degree = world_size if d.sharding_degree == -1 else min(d.sharding_degree, world_size)
    return Layout("fully_sharded", degree, d.reshard_after_forward, cpu_offload=d.cpu_offload, **checkpointing)


@dataclass(frozen=True)
class PlanContext:
    """Everything besides the layout that the bytes depend on."""

    world_size: int
    ranks_per_node: int
    device: str
    """cpu or cuda: the kind of device planned for (on CPU, offloaded state shares the memory it was moved from)."""
    param_bytes: int
    """Bytes per gathered parameter and activation element (distributed.param_dtype)."""
    reduce_bytes: int
    optimizer_state_bytes: int
    update_freq: int = 1
    reduce_every_microbatch: bool = True
    prefetch_units: int = 0
    offload_activations: bool = False
    target: str = "cpu"
    """distributed.plan_device as resolved: cpu, cuda (this machine's GPU) or a name of devices.DEVICES."""
    capacity: int = 0
    """The target's memory per rank, bytes (0: unknown)."""
    local: bool = True
    """Whether the target is this machine's own device (else no trial can run on it: backend=auto plans only)."""

    @classmethod
    def from_config(
        cls, cfg, world_size: int, ranks_per_node: int, device: str, target: str | None = None, capacity: int = 0
    ) -> PlanContext:
        """``device``: cpu or cuda; ``target``: the plan_device it stands for (default: ``device`` itself, here)."""
        from shardlab.distributed.base import resolve_dtypes

        d, opt = cfg.distributed, cfg.optimizer
        param, reduce = resolve_dtypes(d)
        if opt.name in ("sgd", "lars"):  # one momentum buffer
            state = 4 if opt.momentum > 0 else 0
        else:
            state = OPTIMIZER_STATE_BYTES.get(opt.name, 8)
        ema = cfg.optimization.get("ema")
        if ema is not None and ema.enabled:  # optimization.ema: an fp32 average beside each local parameter shard
            state += 4
        return cls(
            world_size=world_size,
            ranks_per_node=max(1, min(ranks_per_node, world_size)),
            device=device,
            param_bytes=param.itemsize,
            reduce_bytes=reduce.itemsize,
            optimizer_state_bytes=state,
            update_freq=cfg.optimization.update_freq,
            reduce_every_microbatch=d.reduce_every_microbatch,
            prefetch_units=d.prefetch_units,
            offload_activations=d.offload_activations,
            target=target or device,
            capacity=capacity,
            local=target is None or target in devices.LOCAL,
        )


@dataclass
class MemoryEstimate:
    layout: Layout
    params: int
    optimizer: int
    grad_buffers: int
    """Gradient memory kept between steps (DDP's buckets)."""
    grads: int
    """Gradients allocated during backward and freed by zero_grad (param.grad, or the local gradient shards)."""
    gathered: int
    """Unsharded parameters and unsharded gradients of the units in flight (fully_sharded)."""
    activations: int | None
    runtime: int
    """What a CPU rank keeps after its first step besides the model: kernels' workspaces, thread pools, library
    caches (0 on CUDA, where the allocator's peak, which the meter reads, leaves them out: see ``outside``)."""
    host: int
    """Bytes moved to host memory (cpu_offload, offload_activations) on CUDA; on CPU they stay counted above."""
    comm_bytes: int
    """Bytes each rank sends per optimizer step (ring collectives)."""
    accumulating: bool = False
    """update_freq > 1: an earlier micro-batch's gradients are held while the next one's activations build up."""
    allocator: int = 0
    """CUDA: what the caching allocator reserves beyond the tensors (block rounding and the fragmentation allowance)."""
    outside: int = 0
    """CUDA: device memory outside the allocator: the CUDA context and NCCL's buffers."""

    @property
    def state(self) -> int:
        return self.params + self.optimizer + self.grad_buffers + self.grads

    @property
    def between_steps(self) -> int:
        """What stays allocated between steps: parameters, optimizer state, gradient buffers and the runtime."""
        return self.params + self.optimizer + self.grad_buffers + self.runtime

    @property
    def peak(self) -> int:
        """The step's peak of live tensors (and a CPU rank's runtime): what the meter reads, the allocator's peak on
        CUDA. Gradients fill in as backward frees activations, so it holds the larger of the two (both when gradients
        accumulate over micro-batches)."""
        activations = self.activations or 0
        work = activations + self.grads if self.accumulating else max(activations, self.grads)
        return self.between_steps + self.gathered + work

    @property
    def device_peak(self) -> int:
        """What the device must have free for the step: the peak, the allocator's rounding and fragmentation, and
        (CUDA) the context and NCCL's buffers. Equal to ``peak`` on CPU."""
        return self.peak + self.allocator + self.outside


CPU_RUNTIME_BYTES = 13 * 2**20
"""A CPU rank's private resident growth over its first step that is neither model nor activations (kernel and
thread-pool set-up; not traced further): measured on 13M-28M-parameter LMs at world sizes 2 and 4, every layout
(tests/distributed/test_memory_plan.py; docs/memory-plan.md). The meter leaves out file-backed pages (library code
mapped in as it first runs, 15 MiB more here, and dropped again under memory pressure), so neither counts them. On
CUDA such memory lives outside the allocator, whose peak the plan predicts there; MemoryEstimate.outside counts the
context and NCCL's buffers beside it."""


@dataclass(frozen=True)
class RankState:
    """Bytes of one rank's parameters, gradients and optimizer state, as FSDP2 allocates them."""

    params: int
    """The sharded parameters' storage: every rank allocates the padded shard (FSDP2 pads to the first shard)."""
    local_params: int
    """Of those, the DTensor local shards (unpadded): what this rank's optimizer state is shaped like."""
    grads: int
    """The sharded gradients: views of the padded reduce-scatter output when it is already in the parameters' dtype
    (fp32), else a cast copy of the local shards."""
    optimizer: int


def rank_state(profile: ModelProfile, layout: Layout, ctx: PlanContext, rank: int = 0) -> RankState:
    """What rank ``rank`` of the shard group holds (rank 0 holds the most: the first chunks are the full ones)."""
    if layout.backend != "fully_sharded":
        P, T = profile.params, profile.trainable_params
        return RankState(4 * P, 4 * P, 4 * T, ctx.optimizer_state_bytes * T)
    f = layout.sharding_degree
    groups, trained = profile.groups(), profile.trainable()
    padded = sum(shard_numel(g, f) for g in groups)
    local = sum(shard_numel(g, f, rank) for g in groups)
    # Gradients and optimizer state: of the trainable parameters only (a LoRA run's adapters).
    grads_padded, grads_local = sum(shard_numel(g, f) for g in trained), sum(shard_numel(g, f, rank) for g in trained)
    grads = 4 * grads_padded if ctx.reduce_bytes == 4 else 4 * grads_local
    return RankState(4 * padded, 4 * local, grads, ctx.optimizer_state_bytes * grads_local)


def communicators(layout: Layout, ctx: PlanContext) -> int:
    """NCCL communicators a rank of ``layout`` holds: the default group, and each mesh dimension's."""
    if ctx.world_size == 1 or layout.backend == "single":
        return 0
    hybrid = layout.backend == "fully_sharded" and layout.sharding_degree < ctx.world_size
    return 1 + (2 if hybrid else 1 if layout.backend == "fully_sharded" else 0)


def estimate(profile: ModelProfile, layout: Layout, ctx: PlanContext) -> MemoryEstimate:
    """Per-rank bytes of a training step of ``layout`` on the fullest rank: what is held between steps and what the
    step adds."""
    if layout.backend != "fully_sharded" and profile.autocast is not None:
        profile = profile.autocast  # low precision through autocast, with its weight copies
    sharded = layout.backend == "fully_sharded"
    ranked = rank_state(profile, layout, ctx)
    params, optimizer, grads = ranked.params, ranked.optimizer, ranked.grads
    # DDP copies gradients into bucket buffers of the same size that survive zero_grad (gradient_as_bucket_view off).
    grad_buffers = 4 * profile.trainable_params if layout.backend == "ddp" else 0
    gathered = 0
    if sharded:
        f = layout.sharding_degree
        groups = profile.groups()
        # A unit's all-gather output is one flat buffer of f padded shards; its parameters are views of it.
        unit_gathered = [f * shard_numel(g, f) for g in groups[:-1]]
        biggest = max(unit_gathered, default=0)
        biggest_grad = max((sum(r * w for r, w in g) for g in profile.trainable()[:-1]), default=0)
        root = f * shard_numel(groups[-1], f) if profile.root_params else 0
        if layout.reshard_after_forward:
            # Backward of the last unit: the root (never resharded) and that unit still gathered, the previous unit
            # prefetched, plus the unit's unsharded gradient and its reduce-scatter buffer.
            in_flight = 2 + max(ctx.prefetch_units - 1, 0)
            gathered = ctx.param_bytes * (root + in_flight * biggest)
        else:  # every unit stays gathered from its forward to its backward
            gathered = ctx.param_bytes * (root + sum(unit_gathered) + biggest)
        gathered += ctx.param_bytes * biggest_grad + ctx.reduce_bytes * biggest
        if ctx.update_freq > 1 and not ctx.reduce_every_microbatch:
            T = profile.trainable_params  # unsharded gradients kept across micro-batches (a trap the plan warns of)
            gathered += 4 * (T - -(-T // f))
    activations = _activations(profile, layout)
    host = 0
    if ctx.device == "cuda":
        if layout.cpu_offload:
            host += params + grads + optimizer
            params = grads = optimizer = 0
        if ctx.offload_activations and activations is not None:
            host += activations
            activations = _transient(profile)
    runtime = CPU_RUNTIME_BYTES if ctx.device == "cpu" else 0
    comm = _comm_bytes(profile, layout, ctx)
    est = MemoryEstimate(
        layout, params, optimizer, grad_buffers, grads, gathered, activations, runtime, host, comm, ctx.update_freq > 1
    )
    if ctx.device == "cuda":
        est.outside = devices.CUDA_CONTEXT + communicators(layout, ctx) * devices.NCCL_PER_COMMUNICATOR
        est.allocator = _allocator_overhead(profile, layout, ctx, est)
    return est


def _allocator_overhead(profile: ModelProfile, layout: Layout, ctx: PlanContext, est: MemoryEstimate) -> int:
    """CUDA: the caching allocator's block rounding of the state tensors (one per parameter and Adam moment; one flat
    gradient buffer per unit) and of the saved activations, plus the fragmentation allowance on the whole peak."""
    rounding = 0
    if not layout.cpu_offload or ctx.device != "cuda":
        f = layout.sharding_degree if layout.backend == "fully_sharded" else 1
        tensors = [4 * shard_rows(rows, f) * width for g in profile.groups() for rows, width in g]
        moments = ctx.optimizer_state_bytes // 4
        rounding = (1 + moments) * sum(devices.allocator_bytes(n) - n for n in tensors)
    if est.activations and profile.activations:
        rounding += int(profile.activation_slack * est.activations / profile.activations)
    return rounding + int(devices.FRAGMENTATION * (est.peak + rounding))


def _transient(profile: ModelProfile) -> int:
    # Backward starts with the loss gradient of the largest saved output (the logits) and its input's gradient.
    return 2 * profile.largest_outside


def _activations(profile: ModelProfile, layout: Layout) -> int | None:
    if profile.activations is None:
        return None
    total = profile.activations
    n = len(profile.unit_activations)
    picked = checkpointed_units(n, layout.checkpointing, layout.ac_every_k_units, layout.ac_skip_units)
    if picked:
        # A checkpointed unit keeps its input (and under selective_op its kept ops' outputs) instead of what it saved;
        # backward recomputes one unit at a time, saving again all but the kept outputs.
        kept, reused = _kept_op_bytes(profile, layout)
        acts, inputs = profile.unit_activations, profile.unit_inputs
        total -= sum(acts[i] - inputs[i] - kept[i] for i in picked)
        total += max(acts[i] - reused[i] for i in picked)
    return total + _transient(profile)


def _kept_op_bytes(profile: ModelProfile, layout: Layout) -> tuple[list[int], list[int]]:
    """Per unit: the bytes selective_op keeps (its op groups' outputs), and the part of them the unit saved anyway."""
    n = len(profile.unit_activations)
    if not layout.ac_save_ops or profile.unit_op_outputs is None or profile.unit_op_overlap is None:
        return [0] * n, [0] * n
    groups = layout.ac_save_ops
    kept = [sum(unit[g] for g in groups) for unit in profile.unit_op_outputs]
    reused = [sum(unit[g] for g in groups) for unit in profile.unit_op_overlap]
    every = layout.ac_matmul_save_every
    if every > 1 and "matmul" in groups and profile.unit_matmuls is not None:
        # Only the 1st, (every+1)-th, ... matmul of a unit is kept: the others' outputs leave what it keeps (and
        # its recomputation saves them again where the unit saved them).
        for i, matmuls in enumerate(profile.unit_matmuls):
            dropped = [m for j, m in enumerate(matmuls) if j % every]
            kept[i] -= sum(out for out, _ in dropped)
            reused[i] -= sum(overlap for _, overlap in dropped)
    return kept, reused


@dataclass(frozen=True)
class Collective:
    """One collective of a step as a rank issues it: what FSDP2 (or DDP) calls, on how many ranks, how many times."""

    op: str
    """all_gather, reduce_scatter or all_reduce."""
    group_size: int
    bytes: int
    """The per-rank buffer: an all-gather's input, a reduce-scatter's output, an all-reduce's tensor."""
    count: int

    @property
    def sent(self) -> int:
        """Bytes one rank sends for all ``count`` of them in a ring: (n-1) buffers for a gather or scatter, 2(n-1)/n
        of the buffer for an all-reduce."""
        n = self.group_size
        per_call = 2 * (n - 1) * self.bytes // n if self.op == "all_reduce" else (n - 1) * self.bytes
        return per_call * self.count


def collectives(profile: ModelProfile, layout: Layout, ctx: PlanContext) -> list[Collective]:
    """The collectives of one optimizer step, per FSDP unit (then the root), as fully_sharded issues them: an
    all-gather per micro-batch in forward and again in backward for each resharded unit (all but the last unit and
    the root), a reduce-scatter per reduction, and on a hybrid mesh an all-reduce of each reduced shard across the
    replicas. ddp: one all-reduce of the gradients per reduction."""
    n, micro = ctx.world_size, ctx.update_freq
    if n == 1 or layout.backend == "single":
        return []
    reductions = micro if ctx.reduce_every_microbatch else 1
    if layout.backend == "ddp":
        return [Collective("all_reduce", n, profile.params * ctx.reduce_bytes, reductions)]
    f = layout.sharding_degree
    r = n // f
    groups = profile.groups()
    out = []
    for i, shapes in enumerate(groups):
        shard = shard_numel(shapes, f)
        if shard == 0:
            continue  # no parameters: fully_shard makes no group
        resharded = layout.reshard_after_forward and i < len(groups) - 2  # not the last unit, not the root
        if f > 1:
            out.append(Collective("all_gather", f, shard * ctx.param_bytes, micro * (2 if resharded else 1)))
            out.append(Collective("reduce_scatter", f, shard * ctx.reduce_bytes, reductions))
        if r > 1:
            out.append(Collective("all_reduce", r, shard * ctx.reduce_bytes, reductions))
    return out


def _comm_bytes(profile: ModelProfile, layout: Layout, ctx: PlanContext) -> int:
    return sum(c.sent for c in collectives(profile, layout, ctx))


# ---- alternatives and the automatic choice ---------------------------------------------------------------------------
def alternatives(world_size: int, ranks_per_node: int) -> list[Layout]:
    """The layouts dry_run compares, roughly from fastest to smallest."""
    if world_size == 1:
        return [
            Layout("single"),
            Layout("single", activation_checkpointing=True),
            Layout("fully_sharded", 1, cpu_offload=True),
            Layout("fully_sharded", 1, activation_checkpointing=True, cpu_offload=True),
        ]
    layouts = [Layout("ddp")]
    hybrid = [f for f in range(2, world_size) if world_size % f == 0]
    # Across machines, sharding within one and replicating across them keeps the all-gathers on the fast links.
    node = ranks_per_node if ranks_per_node in hybrid else None
    if node:
        layouts += [Layout("fully_sharded", node, reshard_after_forward=False), Layout("fully_sharded", node)]
    layouts += [Layout("fully_sharded", world_size, reshard_after_forward=False), Layout("fully_sharded", world_size)]
    layouts += [Layout("fully_sharded", f) for f in hybrid if f != node]
    layouts += [
        Layout("fully_sharded", world_size, activation_checkpointing=True),
        Layout("fully_sharded", world_size, cpu_offload=True),
        Layout("fully_sharded", world_size, activation_checkpointing=True, cpu_offload=True),
    ]
    return layouts


# ---- text for the console --------------------------------------------------------------------------------------------
def warnings(profile: ModelProfile, layout: Layout, ctx: PlanContext) -> Iterator[str]:
    sharded = layout.backend == "fully_sharded"
    P = profile.params
    if sharded and not profile.unit_params:
        yield (
            "warning: fully_sharded without units gathers the whole model at once: no saving while it computes "
            "(set distributed.wrap_min_num_params or give the task fsdp_units)"
        )
    elif sharded and max(profile.unit_params) > P / 3:
        yield (
            f"warning: one FSDP unit holds {max(profile.unit_params) / P:.0%} of the parameters: its gathered copy "
            "is what every rank must fit; split it into smaller units"
        )
    if sharded and profile.root_params > P / 3 and ctx.world_size > 1:
        yield (
            f"warning: the root unit holds {profile.root_params / P:.0%} of the parameters (e.g. tied embeddings) "
            "and stays gathered for the whole step"
        )
    if sharded and ctx.update_freq > 1 and not ctx.reduce_every_microbatch:
        yield (
            "warning: distributed.reduce_every_microbatch=false keeps unsharded gradients of the whole model between "
            f"micro-batches (+{4 * P * (1 - 1 / layout.sharding_degree) / GiB:.2f} GiB per rank)"
        )


def _gib(n: int | None) -> str:
    return "?" if n is None else f"{n / GiB:.2f}"


def describe(profile: ModelProfile, chosen: Layout, ctx: PlanContext, compare: bool) -> list[str]:
    """Lines for the console: the chosen layout's breakdown, then (``compare``) a table of the alternatives."""
    est = estimate(profile, chosen, ctx)
    autocast = chosen.backend != "fully_sharded" and profile.autocast is not None
    copies = profile.autocast.autocast_copies if autocast else 0
    lines = [
        f"memory plan per rank ({chosen.label(ctx.world_size)}, {profile.local_batch} samples per micro-batch): "
        f"peak ~{_gib(est.peak)} GiB = params {_gib(est.params)} + optimizer {_gib(est.optimizer)}"
        + (f" + grad buckets {_gib(est.grad_buffers)}" if est.grad_buffers else "")
        + f" + runtime {_gib(est.runtime)} + gathered {_gib(est.gathered)} + "
        + ("" if est.accumulating else "max of ")
        + f"activations {_gib(est.activations)}"
        + (f" (autocast's weight copies {_gib(copies)})" if copies else "")
        + f", grads {_gib(est.grads)}"
        + (f"; host {_gib(est.host)} GiB" if est.host else "")
        + f"; sends {est.comm_bytes / GiB:.2f} GiB per step"
    ]
    if profile.activation_error:
        lines.append(f"activations not planned: the model's forward fails on meta ({profile.activation_error})")
    lines += list(warnings(profile, chosen, ctx))
    if ctx.device == "cuda":
        lines.append(
            f"  on {ctx.target}: + allocator rounding and fragmentation {_gib(est.allocator)} + CUDA context and "
            f"NCCL buffers {_gib(est.outside)} = {_gib(est.device_peak)} GiB of {_gib(ctx.capacity)}"
            f"{'' if est.device_peak <= ctx.capacity else ' (does not fit)'}"
        )
    if not compare:
        return lines
    lines.append(f"  attention: {attention_kernel(ctx)}")
    layouts = alternatives(ctx.world_size, ctx.ranks_per_node)
    if chosen not in layouts:
        layouts.insert(0, chosen)
    cap = f"of {ctx.capacity / GiB:.0f}" if ctx.capacity else "of ?"
    lines.append(
        f"  {'layout':<40} {'peak GiB':>9} {'state':>7} {'gathered':>9} {'activ.':>7} {'host':>6} {'sent/step':>10} "
        f"{'device':>7} {cap:>7}"
    )
    for layout in layouts:
        e = estimate(profile, layout, ctx)
        mark = "*" if layout == chosen else " "
        share = f"{e.device_peak / ctx.capacity:.0%}" if ctx.capacity else "?"
        lines.append(
            f"{mark} {layout.label(ctx.world_size):<40} {_gib(e.peak):>9} {_gib(e.state):>7} {_gib(e.gathered):>9} "
            f"{_gib(e.activations):>7} {_gib(e.host):>6} {e.comm_bytes / GiB:>9.2f}G {_gib(e.device_peak):>7} "
            f"{share:>7}"
        )
    if ctx.device == "cpu":
        lines.append("  (planned for a CPU, where cpu_offload moves nothing; on GPUs it frees device memory)")
    else:
        lines.append(
            f"  (planned for {ctx.target}, {ctx.ranks_per_node} ranks per machine; peak: the allocator's peak of "
            "live tensors; device: what the GPU must have, with rounding, fragmentation, context and NCCL; host: "
            "what cpu_offload keeps in each rank's host memory)"
        )
    return lines


def attention_kernel(ctx: PlanContext) -> str:
    """Which fused attention the planned device runs and what it keeps: the plan counts q, k, v, the output and one
    float per query row (no length x length scores) on every device (_FusedAttentionShapes)."""
    if ctx.device == "cuda":
        kernel = "flash" if ctx.param_bytes == 2 else "memory-efficient (fp32: flash needs bf16/fp16)"
        return f"{kernel} SDPA on {ctx.target}: q, k, v, output and a logsumexp per row kept; no length x length scores"
    return "torch's CPU flash SDPA kernel: q, k, v, output and a logsumexp per row kept; no length x length scores"


# ---- the plan of one run ---------------------------------------------------------------------------------------------
def profile_config(cfg, task, world_size: int, model=None, units=None) -> tuple[ModelProfile, PlanContext]:
    """Profile the task's model (built on meta here unless given) for ``cfg`` at ``world_size`` ranks."""
    from shardlab.distributed.base import resolve_dtypes

    if model is None:  # a plan-only caller (the budget, the tools); a run's plan is given its model (plan_run)
        model = model_on_meta(task)
        units = task.fsdp_units(model)
    device, target, capacity, per_node = plan_target(cfg, world_size)
    ctx = PlanContext.from_config(cfg, world_size, per_node, device, target, capacity)
    local_batch = cfg.optimization.batch_size // world_size
    units = wrapped_units(model, units, cfg.distributed)
    param_dtype = resolve_dtypes(cfg.distributed)[0]
    profile = profile_model(model, units, task, local_batch, param_dtype)
    if param_dtype != torch.float32:  # single and ddp reach it through autocast: profiled as they run
        profile.autocast = profile_model(model, units, task, local_batch, param_dtype, autocast_device=device)
    return profile, ctx


def plan_target(cfg, world_size: int) -> tuple[str, str, int, int]:
    """distributed.plan_device resolved: (cpu or cuda, the device's name, its memory per rank, ranks per machine)."""
    import os

    from shardlab.distributed import env as dist_env
    from shardlab.errors import ConfigError

    name = cfg.distributed.get("plan_device", "auto")  # configs recorded before the key existed lack it
    per_node = dist_env.ranks_per_node(world_size)
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cpu":
        return "cpu", "cpu", devices.machine_ram() // max(1, min(per_node, world_size)), per_node
    if name == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(
                "distributed.plan_device=cuda plans for this machine's GPU, but it has none; name the GPU to plan "
                f"for: {', '.join(devices.DEVICES)}"
            )
        props = torch.cuda.get_device_properties(0)
        return "cuda", props.name, props.total_memory, per_node
    if name not in devices.DEVICES:
        raise ConfigError(devices.unknown_device_message(name))
    target = devices.DEVICES[name]
    launched = os.environ.get("LOCAL_WORLD_SIZE") or "SLURM_PROCID" in os.environ
    # Planned from elsewhere (a laptop), a job on this device has the machines its table entry says.
    per_node = per_node if launched else min(target.ranks_per_node, world_size)
    return target.kind, name, target.memory_bytes, per_node


@dataclass
class RunPlan:
    """What a rank knows before it allocates: the model on meta, its FSDP units, and what the rank will hold."""

    model: nn.Module
    """The task's model on the meta device, as the caller built it (parallelized and materialized by the trainer)."""
    units: list[nn.Module]
    """The task's FSDP units, in forward order (empty: the backend's generic policy decides)."""
    estimate: MemoryEstimate
    """The configured layout's predicted bytes per rank."""
    lines: list[str]
    """The unit plan and the memory plan, for the console (``compare``: with the alternatives' table)."""


def plan_run(cfg, task, world_size: int, model: nn.Module, compare: bool = False) -> RunPlan:
    """List the units of ``model`` (the task's, on meta: built by the caller, shardlab.distributed.units.model_on_meta)
    and predict what each of ``world_size`` ranks will hold. Planning builds nothing: the run's assembly
    (shardlab.trainer.assemble) owns the model from meta to materialized."""
    units = task.fsdp_units(model)
    profile, ctx = profile_config(cfg, task, world_size, model, units)
    layout = layout_of(cfg.distributed, world_size)
    lines = describe_units(model, units, cfg.distributed) + describe(profile, layout, ctx, compare)
    return RunPlan(model, units, estimate(profile, layout, ctx), lines)
