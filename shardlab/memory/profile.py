"""The model as the memory plan sees it: one forward on the meta device under a saved-tensor hook counts what autograd
keeps for backward, per FSDP unit, with nothing computed or allocated (``profile_model``), beside the parameters'
counts and shapes. The bytes each layout holds are shardlab.memory.estimate's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from shardlab.distributed.activation_checkpointing import SAVE_OP_GROUPS
from shardlab.distributed.units import count_params
from shardlab.memory import devices


# ---- what the model is made of (one meta forward) --------------------------------------------------------------------
@dataclass
class ExpertProfile:
    """A mixture-of-experts model's routed experts, as the plan places them (shardlab.memory.experts)."""

    spec: Any
    """What the task says of its MoE layers: a shardlab.task.ExpertLayers."""
    group_shapes: list[list[tuple[int, int, int]]]
    """The expert parameters of each FSDP unit, then the root's, as (experts, rows, width)."""
    block_shapes: list[list[tuple[int, int]]] | None = None
    """Every parameter of the MoE blocks (the modules holding the experts: router, experts, shared expert) of each
    unit, then the root's, as (rows, elements per row): what tensor parallelism leaves whole on each rank (the
    blocks run on each rank's slice of the sequence: shardlab_tasks/lm/models/tensor_parallel.py's
    SequenceShardedMoE)."""


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
    backward_workspace: int = 0
    """Bytes a layer's backward holds beyond what was saved, where the plan counts them: under tensor parallelism,
    the gradients of the gathered (full-sequence) tensors before their reduce-scatter (shardlab.memory.axes)."""
    trainable_shapes: list[list[tuple[int, int]]] | None = None
    """groups() of the parameters that train (requires_grad), when some are frozen (LoRA's base): only they have
    gradients and optimizer state; None: all train."""
    experts: ExpertProfile | None = None
    """A mixture-of-experts model's routed experts (shardlab.memory.experts); None: a dense model."""
    output: int = 0
    """Bytes of the model's output in one micro-batch (an LM's logits): what a pipeline's last stage returns, which
    torch keeps past the micro-batch's backward (shardlab.memory.axes); 0: not traced (a profile made by hand)."""

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


class _SavedTensors:
    """What autograd saves for backward during one forward (a saved-tensor hook's pack), each base tensor once, with
    the unit it was saved in (-1: outside the units), and each unit's input bytes (what checkpointing keeps)."""

    def __init__(self, model: nn.Module, units: list[nn.Module]) -> None:
        self.model = model
        self.output = 0
        self.units = units
        self.param_ids = {id(p) for p in model.parameters()}
        self.saved: dict[int, torch.Tensor] = {}  # by id of the base tensor: views of one tensor are kept once
        self.owner: dict[int, int] = {}  # base id -> unit index (-1: outside the units)
        self.inputs = [0] * len(units)
        self.current = [-1]  # the unit running now; shared with _OpOutputs

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        base = t._base if t._base is not None else t
        if id(base) not in self.param_ids and id(t) not in self.param_ids and id(base) not in self.saved:
            self.saved[id(base)] = base
            self.owner[id(base)] = self.current[0]
        return t

    def _enter(self, i: int):
        def hook(module, args):
            self.current[0] = i
            first = args[0] if args else None
            self.inputs[i] = _nbytes(first) if isinstance(first, torch.Tensor) else 0

        return hook

    def _leave(self, module, args, output) -> None:
        self.current[0] = -1

    def _returned(self, module, args, output) -> None:
        self.output = _nbytes(output) if isinstance(output, torch.Tensor) else 0

    @contextlib.contextmanager
    def tracing(self) -> Iterator[None]:
        """Unit hooks that say which unit runs, and the saved-tensor hook, for the block."""
        handles = [self.model.register_forward_hook(self._returned)]
        for i, unit in enumerate(self.units):
            handles.append(unit.register_forward_pre_hook(self._enter(i)))
            handles.append(unit.register_forward_hook(self._leave))
        try:
            with torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t):
                yield
        finally:
            for h in handles:
                h.remove()


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
    params, unit_params = count_params(model), [count_params(u) for u in units]
    in_units = {id(p) for u in units for p in u.parameters()}
    shapes = {
        "unit_shapes": [param_shapes(u.parameters()) for u in units],
        "root_shapes": param_shapes(p for p in model.parameters() if id(p) not in in_units),
    }
    if not all(p.requires_grad for p in model.parameters()):  # frozen weights: no gradients, no optimizer state
        trained = [[p for p in u.parameters() if p.requires_grad] for u in units]
        root = [p for p in model.parameters() if id(p) not in in_units and p.requires_grad]
        shapes["trainable_shapes"] = [param_shapes(g) for g in [*trained, root]]
    empty = [0] * len(units)
    batch = task.example_batch(local_batch) if local_batch > 0 else None
    if batch is None:
        return ModelProfile(params, unit_params, None, empty, empty, 0, local_batch, **shapes)
    restore = _cast_floating(model, dtype) if autocast_device is None else (lambda: None)
    autocast = _MetaAutocast(dtype, autocast_device) if autocast_device is not None else contextlib.nullcontext()
    saved = _SavedTensors(model, units)
    ops = _OpOutputs(saved.current)
    try:
        with _MetaAttention(), autocast, saved.tracing(), ops:
            model.train()
            task.loss(model, batch if autocast_device else _cast_inputs(batch, dtype), torch.device("meta"))
    except Exception as e:  # a model that cannot run on meta still trains; only its activations go unplanned
        reason = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
        return ModelProfile(params, unit_params, None, empty, empty, 0, local_batch, reason, **shapes)
    finally:
        restore()
    copies = list(autocast.weight_copies.values()) if autocast_device is not None else []
    fields = _activation_fields(saved, ops, copies)
    return ModelProfile(params, unit_params, local_batch=local_batch, output=saved.output, **shapes, **fields)


def _activation_fields(saved: _SavedTensors, ops: _OpOutputs, copies: list[torch.Tensor]) -> dict:
    """The ModelProfile fields of one traced forward: the saved bytes in all, per unit and outside the units, and
    what selective_op and autocast change of them. ``copies``: autocast's low-precision weight copies (an autocast
    profile's)."""
    copy_ids = {id(c) for c in copies}
    num_units = len(saved.units)
    per_unit = [0] * num_units
    outside: list[int] = [0]
    for key, base in saved.saved.items():
        if key in copy_ids:
            continue  # autocast's cache holds every copy to the end of forward: no unit's recomputation drops one
        if saved.owner[key] >= 0:
            per_unit[saved.owner[key]] += _nbytes(base)
        else:
            outside.append(_nbytes(base))
    total = sum(_nbytes(b) for b in saved.saved.values())
    # Every copy lives until the forward ends (autocast's cache), those the matmuls saved until backward.
    total += sum(_nbytes(c) for c in copies if id(c) not in saved.saved)
    op_outputs, op_overlap = ops.per_unit(num_units, saved.saved, saved.owner)
    return {
        "activations": total,
        "unit_activations": per_unit,
        "unit_inputs": saved.inputs,
        "largest_outside": max(outside),
        "autocast_copies": sum(_nbytes(c) for c in copies),
        "activation_slack": sum(devices.allocator_bytes(_nbytes(b)) - _nbytes(b) for b in saved.saved.values()),
        "unit_op_outputs": op_outputs,
        "unit_op_overlap": op_overlap,
        "unit_matmuls": ops.matmuls_per_unit(num_units, saved.saved, saved.owner),
    }


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
