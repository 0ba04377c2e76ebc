"""The private torch APIs that have a public fallback, each behind a version check.

Private names change without notice between torch releases. Each one here is used only when the installed torch is
in TESTED_TORCH (the minor versions tests/unit/test_torch_internals.py passed on) and the name still exists; else the
caller takes the public path it would take without it. tests/unit/test_torch_internals.py checks each name's
behaviour on the installed torch and fails loudly, naming what moved, when a torch upgrade changes one. Nothing on
the default path needs them: they back opt-in CPU (gloo) speed-ups and the opt-in async tensor parallelism on CUDA.

Other private names are used where they are, because there is no public path to fall back to and each is what torch's
own public code calls (an upgrade that moved one fails at import or in that module's tests, not silently):
- checkpoint/async_save.py: ``torch.distributed._state_dict_utils`` (the staging copy BlockingAsyncStager makes);
- checkpoint/hf_folder.py: ``HuggingFaceStorageReader._process_read_request`` (the reader's own read of one slice,
  which ``folder_reader``'s read_data calls for the files it checked);
- checkpoint/readers/dcp_reader.py admits, by name, the private classes DCP pickles into ``.metadata``
  (``_StorageInfo``, ``_MEM_FORMAT_ENCODING``, ``torch.serialization._get_layout``); a torch that renamed one would
  have its own checkpoints refused in one line, which tests/unit/test_dcp_reader.py shows at once;
- distributed/activation_checkpointing.py: ``checkpoint_wrapper`` from ``torch.distributed.algorithms._checkpoint``
  (torchtitan's wrapper too; DCP's state-dict helpers strip its prefix);
- shardlab_tasks/self_supervised/comm.py: ``torch.distributed._functional_collectives`` too (SimCLR's differentiable
  all-gather; both run on the meta device, where the memory plan traces the loss);
- distributed/sync_bn.py: ``torch.distributed._functional_collectives`` (the differentiable all-reduce) and
  ``torch.nn.modules.batchnorm._BatchNorm`` (the base class every BatchNorm shares; the vision task uses it too);
- distributed/grad_scaler.py: ``torch._amp_foreach_non_finite_check_and_unscale_`` (the kernel torch's GradScaler
  runs);
- optim/cpu_adam.py: ``torch._fused_adamw_`` and ``torch._foreach_add_`` (the kernels torch.optim.AdamW runs).
"""

from __future__ import annotations

import functools

import torch

TESTED_TORCH = ((2, 14), (2, 14))
"""Inclusive (major, minor) range whose private APIs below were checked (pyproject's torch range is the public one)."""


def torch_minor() -> tuple[int, int]:
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return int(major), int(minor)


def tested() -> bool:
    """Whether the installed torch is one whose private APIs below were checked."""
    low, high = TESTED_TORCH
    return low <= torch_minor() <= high


@functools.cache
def reduce_scatter_base() -> type | None:
    """FSDP2's custom reduce-scatter interface (``set_custom_reduce_scatter`` takes an instance), or None: the class
    lives in the private module ``torch.distributed.fsdp._fully_shard._fsdp_api``."""
    if not tested():
        return None
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter
    except ImportError:
        return None
    return ReduceScatter


def set_unshard_async_op(model: torch.nn.Module) -> bool:
    """Issue FSDP2's unshard all-gathers asynchronously (``FSDPModule._set_unshard_async_op``); whether it was set.

    On CPU, FSDP2 otherwise runs an explicitly prefetched all-gather as a blocking op, so nothing overlaps. On CUDA
    its own docstring says copy-in and casts then stop overlapping, so callers use it on CPU only."""
    setter = getattr(model, "_set_unshard_async_op", None)
    if not tested() or setter is None:
        return False
    setter(True)
    return True


def in_backward() -> bool | None:
    """Whether autograd's engine is running a backward on this thread (``torch._C._current_graph_task_id``), or None
    where that cannot be told."""
    probe = getattr(torch._C, "_current_graph_task_id", None)
    if not tested() or probe is None:
        return None
    return probe() != -1


def has_post_accumulate_grad_hooks(param: torch.Tensor) -> bool | None:
    """Whether ``param`` has hooks from ``register_post_accumulate_grad_hook`` (the tensor's private
    ``_post_accumulate_grad_hooks``), or None where that cannot be told."""
    if not tested() or not hasattr(param, "_post_accumulate_grad_hooks"):
        return None
    return bool(param._post_accumulate_grad_hooks)


def local_shard(tensor: torch.Tensor) -> torch.Tensor:
    """The part of ``tensor`` this rank holds: a DTensor's local shard (its private ``_local_tensor``, ``to_local()``
    without autograd's bookkeeping, for optimizers stepping every parameter), any other tensor itself."""
    from torch.distributed.tensor import DTensor

    if not isinstance(tensor, DTensor):
        return tensor
    if tested() and hasattr(tensor, "_local_tensor"):
        return tensor._local_tensor
    return tensor.to_local()


def micro_pipeline_tp_switches():
    """torch's async tensor parallelism, as torchtitan turns it on: inductor's private ``_micro_pipeline_tp`` pass flag
    and ``torch.distributed._symmetric_memory.enable_symm_mem_for_group``; (the inductor config, the enabler), or None
    where either moved: tensor parallelism then runs its collectives synchronously (the public path)."""
    if not tested():
        return None
    try:
        import torch._inductor.config as inductor_config
        from torch.distributed._symmetric_memory import enable_symm_mem_for_group
    except ImportError:
        return None
    if not hasattr(inductor_config, "_micro_pipeline_tp"):
        return None
    return inductor_config, enable_symm_mem_for_group


def flatten_mesh(mesh, name: str):
    """``mesh`` (a slice of the world's mesh) flattened into one dimension called ``name``, sliceable from the root
    by that name as torchtitan's dp_shard_cp is (DeviceMesh's private ``_flatten``), or None where it moved: the caller
    then builds a mesh of its own over the same ranks (public, but not sharing the root mesh)."""
    flatten = getattr(mesh, "_flatten", None)
    if not tested() or flatten is None:
        return None
    return flatten(name)


def set_context_parallel_rotate_method(method: str) -> bool:
    """How torch's ring attention passes key/value chunks between context-parallel ranks ("allgather" or
    "alltoall"; ``set_rotate_method``, exported only from the private ``torch.distributed.tensor.experimental.
    _attention``, as torchtitan imports it); whether it was set: where it moved, torch's default (allgather) runs."""
    if not tested():
        return False
    try:
        from torch.distributed.tensor.experimental._attention import set_rotate_method
    except ImportError:
        return False
    set_rotate_method(method)
    return True


TRACKED_KINDS = ("Sharded Param", "Sharded Grad", "OptState")
"""The FSDPMemTracker categories (``_FSDPRefType`` values) distributed.verify_plan's second check reads."""


def fsdp_mem_tracker() -> type | None:
    """torch's FSDPMemTracker (the private ``torch.distributed._tools.fsdp2_mem_tracker``: a dispatch mode that
    counts each storage FSDP2 and the optimizer allocate, by kind, as torchtitan's memory estimation uses it under fake
    tensors), or None where it moved or no longer names the kinds in TRACKED_KINDS: distributed.verify_plan then runs
    its first check only and says so."""
    if not tested():
        return None
    try:
        from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker, _FSDPRefType
    except ImportError:
        return None
    if not set(TRACKED_KINDS) <= {kind.value for kind in _FSDPRefType}:
        return None
    return FSDPMemTracker
