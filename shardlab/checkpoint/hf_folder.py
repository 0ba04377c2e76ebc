"""Weights from a Hugging Face safetensors folder into a model as it is sharded: each rank reads only its own slices.

The model is built on meta, wrapped (``fully_shard``, DDP or nothing) and materialized first; then DCP's
``HuggingFaceStorageReader`` reads, for every parameter, the slice of the checkpoint tensor that this rank's local
shard holds (``safe_open(...).get_slice``), straight into it, converting the dtype on the way (bf16 files into fp32
master weights). No rank builds the full model or reads a whole file; the largest extra buffer is one slice.

The caller names the checkpoint tensor of each parameter (``names``: shardlab name -> (checkpoint key, transposed));
a transposed one (GPT-2's Conv1D weights, stored (in, out)) is read into a transposed view of the local shard, so a
rank holding rows of the parameter reads the matching columns of the file. The family-specific names live with the
task (tasks/lm/hf_models.py); this module knows safetensors and DCP only.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from shardlab.checkpoint import agreement
from shardlab.distributed.materialize import clean_name
from shardlab.errors import CheckpointError, first_cause

INDEX_FILE = "model.safetensors.index.json"

Names = Mapping[str, tuple[str, bool]]
"""shardlab parameter name -> (the checkpoint tensor's key, whether it is stored transposed)."""


def weight_files(folder: Path) -> list[Path]:
    """The folder's safetensors files: those its index names, else every ``*.safetensors`` in it."""
    index = folder / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index} is not a safetensors index ({first_cause(e)})") from None
        files = [folder / name for name in sorted(set(weight_map.values()))]
        if missing := [f.name for f in files if not f.is_file()]:
            raise CheckpointError(f"{index} names {missing[0]}, which is not in {folder}; download the whole folder")
        return files
    return sorted(folder.glob("*.safetensors"))


def tensor_shapes(files: list[Path]) -> dict[str, tuple[tuple[int, ...], str]]:
    """key -> (shape, safetensors dtype) of every tensor in ``files``, from their headers alone (no tensor is read)."""
    from safetensors import safe_open

    shapes = {}
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as f:
                for key in f.keys():
                    piece = f.get_slice(key)
                    shapes[key] = (tuple(piece.get_shape()), piece.get_dtype())
        except Exception as e:  # safetensors' own errors have no common type
            raise CheckpointError(f"{file} is not a readable safetensors file ({first_cause(e)})") from None
    return shapes


def fit_errors(
    model: nn.Module,
    folder: Path,
    names: Names,
    ignored: tuple[str, ...] = (),
    keys: Callable[[str], bool] | None = None,
) -> list[str]:
    """Why the folder's tensors cannot fill ``model`` (missing, of another shape, or unused); [] when they can. Reads
    headers only. ``ignored``: suffixes of checkpoint keys that may be present and unused (buffers); ``keys``: the
    parameters to fill (None: all; a LoRA model's adapters are not in the folder)."""
    files = weight_files(folder)
    if not files:
        return [f"{folder} holds no .safetensors weights (only a config.json plans: add dry_run=true)"]
    shapes = tensor_shapes(files)
    errors = []
    for name, param in _parameters(model, keys).items():
        if name not in names:
            errors.append(f"parameter {name} has no checkpoint name (a mapping that does not match the model)")
            continue
        key, transposed = names[name]
        expected = tuple(param.shape[::-1] if transposed else param.shape)
        if key not in shapes:
            errors.append(f"{folder} lacks tensor {key}")
        elif shapes[key][0] != expected:
            errors.append(f"{folder}: tensor {key} is {list(shapes[key][0])}, the model's is {list(expected)}")
    used = {key for key, _ in names.values()}
    unused = sorted(k for k in shapes if k not in used and not k.endswith(ignored))
    if unused:
        errors.append(f"{folder}: tensor {unused[0]} has no place in the model ({len(unused)} such)")
    return errors


def _parameters(model: nn.Module, keys: Callable[[str], bool] | None = None) -> dict[str, torch.Tensor]:
    """The model's parameters by their unwrapped names, each once (a tied one under its first name); only those
    ``keys`` selects, when given."""
    named = {clean_name(name): param for name, param in model.named_parameters()}
    return named if keys is None else {name: p for name, p in named.items() if keys(name)}


def _target(param: torch.Tensor, transposed: bool) -> torch.Tensor:
    """Where the checkpoint tensor's slice is written: the parameter's local storage, seen in the file's layout."""
    if not transposed:
        return param.detach()
    if not isinstance(param, DTensor):
        return param.detach().t()
    if param.ndim != 2:
        raise CheckpointError(f"a transposed checkpoint tensor needs a 2-D parameter, got shape {list(param.shape)}")
    # Rows of (out, in) sharded on dim 0 are columns of the stored (in, out): the same chunks, on the other dim.
    placements = [Shard(1 - p.dim) if isinstance(p, Shard) else p for p in param.placements]
    shape = torch.Size(param.shape[::-1])
    return DTensor.from_local(
        param.to_local().detach().t(), param.device_mesh, placements, run_check=False, shape=shape, stride=(1, shape[0])
    )


@torch.no_grad()
def load_hf_folder(
    model: nn.Module,
    folder: Path,
    names: Names,
    device: torch.device,
    ignored: tuple[str, ...] = (),
    keys: Callable[[str], bool] | None = None,
) -> None:
    """Fill every parameter of ``model`` (plain, DDP or FSDP2-sharded; any world size; call on every rank) from the
    safetensors of ``folder``; refused in one line, the same on every rank, before any tensor is read if the folder
    does not fit (``fit_errors``), and after if the read fails."""
    from torch.distributed.checkpoint import HuggingFaceStorageReader
    from torch.distributed.checkpoint import load as dcp_load

    error: BaseException | None = None
    try:
        if problems := fit_errors(model, folder, names, ignored, keys):
            raise CheckpointError(f"model.pretrained: {problems[0]}")
    except CheckpointError as e:
        error = e
    agreement.agree(error, f"model.pretrained: reading {folder}", device)
    state = {names[name][0]: _target(p, names[name][1]) for name, p in _parameters(model, keys).items()}
    try:
        dcp_load(state, storage_reader=HuggingFaceStorageReader(str(folder)))
    except Exception as e:  # DCP wraps every rank's failure in its own exception types
        error = CheckpointError(f"model.pretrained: {folder} could not be read ({first_cause(e)})")
    agreement.agree(error, f"model.pretrained: loading {folder}", device)
