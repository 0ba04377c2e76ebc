"""Read a sharded DCP checkpoint's model weights into one full CPU state dict, for tools that convert or inspect them.

Public torch.distributed.checkpoint APIs only: the checkpoint's own metadata gives every tensor's full shape and
dtype, so empty CPU tensors of those shapes are allocated for the ``model.*`` entries alone and DCP fills them,
whatever world size wrote the shards. Optimizer state is never read, and nothing is unpickled.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from shardlab.errors import CheckpointError

warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")


def load_model_state_dict(checkpoint: Path, prefix: str = "model") -> dict[str, torch.Tensor]:
    """{parameter name: full tensor} of the checkpoint's ``prefix`` entries (names without the prefix)."""
    if not (checkpoint / ".metadata").is_file():
        raise CheckpointError(f"{checkpoint} has no .metadata; give a step_N directory written by shardlab.train")
    reader = dcp.FileSystemReader(str(checkpoint))
    try:
        metadata = reader.read_metadata()
    except Exception as e:  # a torn or foreign .metadata file
        raise CheckpointError(f"{checkpoint}/.metadata could not be read ({type(e).__name__}: {e})") from e
    start = prefix + "."
    state = {
        name[len(start) :]: torch.empty(md.size, dtype=md.properties.dtype)
        for name, md in metadata.state_dict_metadata.items()
        if name.startswith(start) and isinstance(md, TensorStorageMetadata)
    }
    if not state:
        raise CheckpointError(f"{checkpoint} holds no '{prefix}.*' tensors; is it a shardlab training checkpoint?")
    try:
        dcp.load({prefix: state}, storage_reader=reader)
    except Exception as e:
        raise CheckpointError(f"{checkpoint} could not be read ({type(e).__name__}: {str(e)[:200]})") from e
    return state
