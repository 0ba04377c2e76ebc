"""model.pretrained for the vision tasks: torchvision's RegNet weights as the trunk a run starts from, its head new.

The file is what torchvision saves and publishes, ``torch.save(model.state_dict())`` (regnet_y_400mf-*.pth). shardlab's
RegNet is torchvision's own class (model.py), so the file names the trunk's tensors as they are: the supervised
model's ``<name>``, the self-supervised model's ``trunk.<name>`` (shardlab_tasks/self_supervised/model.py). The file's
classifier (``fc.*``, ImageNet's 1000 classes) is not read: the task's head (classifier, projection head, prototypes)
keeps the init the run's seed gave it. A file whose tensors do not fit the configured trunk is refused in one line
naming the first key or shape that differs (and the torchvision flavor it does fit, if one does), before any rank
starts (``pretrained_errors``, from the task's config_errors) and again on every rank before a tensor is copied.

Reading it: the file is opened as a file (a regular one, not a FIFO or a device, at most MAX_BYTES) and unpickled by
torch's restricted unpickler (``weights_only=True``: tensors and plain containers only, nothing called). It is mapped
(``mmap=True``), not read: each rank copies from it only the slice of each tensor that its own FSDP2 shard holds, after
the model was built on meta, sharded and materialized, as every other source of weights in shardlab does.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from shardlab.checkpoint import agreement
from shardlab.distributed.materialize import clean_name
from shardlab.errors import CheckpointError, first_cause
from shardlab.files.regular_file import NotAFile, open_file

MAX_BYTES = 4 * 2**30
"""The largest file read: torchvision's largest RegNet (regnet_y_128gf, 645M parameters) is 2.6 GB in fp32."""
HEAD_PREFIX = "fc."
"""The file's classifier: never read (each task's head is its own, freshly initialised)."""
ZIP_MAGIC = b"PK\x03\x04"
"""torch.save's format since torch 1.6 (a zip archive), the one torch can map."""


def read_state_dict(path: Path) -> dict[str, Tensor]:
    """The tensors of the state-dict file ``path`` by name, mapped from the file (on the CPU, nothing copied yet); a
    CheckpointError naming the file if it is not a regular file of at most MAX_BYTES holding a flat state dict."""
    try:  # the user named it: a link is theirs to give; a FIFO opens at once and is refused
        fd, _ = open_file(path, max_bytes=MAX_BYTES, follow_links=True)
    except NotAFile as e:
        if e.size is not None:
            raise CheckpointError(
                f"model.pretrained: {path} holds {e.size} bytes, more than the {MAX_BYTES} of any torchvision "
                "RegNet's weights; give the trunk's state dict"
            ) from None
        what = f"is not a regular file ({e.kind})"
        raise CheckpointError(f"model.pretrained: {path} {what}; give a .pth state dict") from None
    except OSError as e:
        raise CheckpointError(f"model.pretrained: {path} cannot be opened ({e.strerror}); give a .pth file") from None
    try:
        return _load(fd, path)
    finally:
        os.close(fd)


def _load(fd: int, path: Path) -> dict[str, Tensor]:
    """torch.load of the open file ``fd``: through /proc/self/fd, so the file mapped is the one checked (the name could
    point elsewhere by now); a pre-1.6 file (not a zip) cannot be mapped and is read whole (it is at most MAX_BYTES)."""
    mapped = os.pread(fd, 4, 0) == ZIP_MAGIC
    opened = f"/proc/self/fd/{fd}" if os.path.exists(f"/proc/self/fd/{fd}") else str(path)
    try:
        if mapped:
            state = torch.load(opened, map_location="cpu", weights_only=True, mmap=True)
        else:
            with open(opened, "rb") as f:
                state = torch.load(f, map_location="cpu", weights_only=True)
    except Exception as e:  # torch's unpickler raises UnpicklingError, RuntimeError or zip errors
        cause = first_cause(e).split(". ")[0]  # torch's advice after it (weights_only=False) is not ours to give
        raise CheckpointError(
            f"model.pretrained: {path} is not a state dict that torch.load(weights_only=True) reads ({cause}); save "
            "the trunk with torch.save(model.state_dict())"
        ) from None
    flat = isinstance(state, Mapping) and all(isinstance(k, str) and isinstance(v, Tensor) for k, v in state.items())
    if not flat:
        held = f"a dict with keys {list(state)[:3]}" if isinstance(state, Mapping) else type(state).__name__
        raise CheckpointError(
            f"model.pretrained: {path} holds {held}, not a state dict of tensors by name; save the trunk with "
            "torch.save(model.state_dict())"
        )
    return dict(state)


def fit_errors(stored: Mapping[str, Tensor], wanted: Mapping[str, tuple[int, ...]]) -> list[str]:
    """Why the file's tensors (``stored``) cannot fill the trunk tensors ``wanted`` (file key -> shape the model has):
    one line per key that is missing, of another shape or has no place in the trunk; the file's classifier is ignored.
    """
    errors = []
    for key, shape in wanted.items():
        if key not in stored:
            errors.append(f"the file has no {key}, which the trunk has (shape {list(shape)})")
        elif tuple(stored[key].shape) != tuple(shape):
            errors.append(f"{key} is {list(stored[key].shape)} in the file, {list(shape)} in the trunk")
    unused = [key for key in stored if key not in wanted and not key.startswith(HEAD_PREFIX)]
    if unused:
        errors.append(f"the file's {unused[0]} has no place in the trunk ({len(unused)} such)")
    return errors


def trunk_shapes(model: nn.Module, prefix: str = "") -> dict[str, tuple[int, ...]]:
    """The file key and the (global) shape of every trunk tensor of ``model``: its parameters and buffers under
    ``prefix`` (the self-supervised model's ``trunk.``), the prefix dropped, the classifier left out."""
    return {key: tuple(tensor.shape) for key, (_, tensor) in trunk_entries(model, prefix).items()}


def trunk_entries(model: nn.Module, prefix: str = "") -> dict[str, tuple[str, Tensor]]:
    """file key -> (the model's name, its tensor) for every trunk parameter and buffer (names unwrapped of DDP's and
    activation checkpointing's prefixes)."""
    entries = {}
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        name = clean_name(name)
        if is_trunk(name, prefix):
            entries[name[len(prefix) :]] = (name, tensor)
    return entries


def is_trunk(name: str, prefix: str = "") -> bool:
    """Whether the model's (unwrapped) tensor ``name`` is one the file fills: under ``prefix``, not the classifier. The
    one rule for what load_trunk copies and what the trainer therefore need not draw (Task.pretrained_keys)."""
    return name.startswith(prefix) and not name[len(prefix) :].startswith(HEAD_PREFIX)


def fitting_flavor(stored: Mapping[str, Tensor]) -> str | None:
    """The torchvision RegNet flavor whose trunk the file fits, if one does (each built on meta: no memory)."""
    from shardlab_tasks.image_classification import model as regnet

    for flavor in regnet.FLAVORS:
        with torch.device("meta"), regnet.block_params_on_cpu():
            candidate = getattr(regnet.tv_regnet, flavor)(weights=None)
        if not fit_errors(stored, trunk_shapes(candidate)):
            return flavor
    return None


def refusal(path: Path, stored: Mapping[str, Tensor], errors: list[str]) -> str:
    """The one line that refuses ``path``: its first misfit, and the flavor it fits if it is another one."""
    flavor = fitting_flavor(stored)
    fix = f"it is torchvision's {flavor}: use model.arch=regnet model.flavor={flavor}" if flavor else ""
    fix = fix or "give the state dict of a RegNet of this model section's shape"
    more = f" ({len(errors)} misfits)" if len(errors) > 1 else ""
    return f"model.pretrained: {path} does not fit the trunk: {errors[0]}{more}; {fix}"


@torch.no_grad()
def load_trunk(model: nn.Module, path: Path, prefix: str, device: torch.device) -> Path:
    """Copy the file's trunk tensors into ``model`` (plain, DDP or FSDP2-sharded, materialized; any world size; call on
    every rank): each rank copies the slices its shards hold. Refused in one line, the same on every rank, before any
    tensor is copied if the file does not fit the trunk."""
    error: BaseException | None = None
    stored: dict[str, Tensor] = {}
    try:
        stored = read_state_dict(path)
        if errors := fit_errors(stored, trunk_shapes(model, prefix)):
            raise CheckpointError(refusal(path, stored, errors))
    except CheckpointError as e:
        error = e
    agreement.agree(error, f"model.pretrained: reading {path}", device)
    try:
        for key, (_, tensor) in trunk_entries(model, prefix).items():
            copy_local(tensor, stored[key])
    except Exception as e:  # a file cut short under the mapping raises on the page's first touch
        error = CheckpointError(f"model.pretrained: {path} could not be read ({first_cause(e)})")
    agreement.agree(error, f"model.pretrained: loading {path}", device)
    return path


def copy_local(target: Tensor, source: Tensor) -> None:
    """``source`` (the full tensor) into ``target``: a plain tensor whole, a DTensor's local shard its own slice only,
    so a rank touches only the pages of the file that its shard holds."""
    if not isinstance(target, DTensor):
        target.copy_(source)
        return
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(target.shape, target.device_mesh, target.placements)
    piece = source
    for dim, (size, start) in enumerate(zip(shape, offset, strict=True)):
        piece = piece.narrow(dim, start, size)
    target.to_local().copy_(piece)
