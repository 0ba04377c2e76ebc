"""Reading DCP step folders without running their code.

DCP keeps a checkpoint's index in ``.metadata``, a pickle, and torch's FileSystemReader reads it with ``pickle.load``:
a step folder someone shared could run anything on resume, ``init_from`` or in the tools. Here it is unpickled by an
``Unpickler`` whose ``find_class`` admits only the classes DCP writes into that file (its metadata dataclasses,
``torch.Size``, dtypes, layouts, paths); anything else is refused before it is called. The file keeps torch's own
format, so torch's tools (``dcp_to_torch_save``) still read our checkpoints; the shard files themselves are read by
torch with ``weights_only=True``.

``SafeReader`` is DCP's FileSystemReader with that ``read_metadata`` (the public StorageReader method), and ``load``
checks the metadata first, so a refusal is one line rather than DCP's wrapped collective error. Every path that opens
a step folder comes through here: resume (checkpoint.manager), ``init_from`` and the tools (checkpoint.weights).
"""

from __future__ import annotations

import io
import json
import pickle
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from shardlab.errors import CheckpointError, UnsafeCheckpointError

METADATA_FILE = ".metadata"
"""The name DCP's FileSystemWriter gives the index (tests/unit/test_dcp_reader.py checks torch still writes it)."""

ALLOWED: dict[str, frozenset[str]] = {
    "torch.distributed.checkpoint.metadata": frozenset(
        {
            "Metadata",
            "MetadataIndex",
            "StorageMeta",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "TensorProperties",
            "_MEM_FORMAT_ENCODING",  # an Enum TensorProperties pickles its memory format as
        }
    ),
    "torch.distributed.checkpoint.filesystem": frozenset({"_StorageInfo"}),  # where each entry lies in a shard file
    "torch.serialization": frozenset({"_get_layout"}),  # how torch.layout pickles: a lookup by name
    "torch": frozenset({"Size"}),
    "pathlib": frozenset({"PosixPath", "PurePosixPath"}),  # StorageMeta.checkpoint_id
    "pathlib._local": frozenset({"PosixPath", "PurePosixPath"}),  # the same classes' module from Python 3.13
    "collections": frozenset({"OrderedDict"}),
}
"""What a DCP .metadata file is made of (plus torch dtypes, admitted by type below). Each is a plain data holder or a
lookup by name, so constructing it runs no code an attacker chose."""


class MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP metadata; any global outside ALLOWED (os.system, builtins.eval, ...) is refused by name."""

    def __init__(self, file, source: Path) -> None:
        super().__init__(file)
        self.source = source

    def find_class(self, module: str, name: str) -> Any:
        if name in ALLOWED.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise UnsafeCheckpointError(
            f"{self.source} refers to {module}.{name}, which DCP checkpoint metadata never holds: refused without "
            "running it (a crafted or foreign file); load checkpoints only from sources you trust"
        )


def read_metadata(path: Path) -> Metadata:
    """The DCP index of step folder ``path``, read through the allow-list; CheckpointError if it is missing or not
    DCP metadata, UnsafeCheckpointError if it names anything else."""
    source = Path(path) / METADATA_FILE
    try:
        with open(source, "rb") as f:
            metadata = MetadataUnpickler(f, source).load()
    except UnsafeCheckpointError:
        raise
    except FileNotFoundError:
        raise CheckpointError(f"{path} has no DCP {METADATA_FILE}; is it a step_N checkpoint folder?") from None
    except Exception as e:  # truncated, empty or garbled: pickle raises many kinds
        raise CheckpointError(f"{source} is unreadable ({type(e).__name__}: {str(e)[:200]})") from e
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"{source} holds a {type(metadata).__name__}, not DCP metadata")
    return metadata


class SafeReader(FileSystemReader):
    """torch's FileSystemReader, whose metadata goes through ``read_metadata`` above. Its signature takes no rank,
    so DCP never falls back to per-rank metadata files (shardlab writes one global index)."""

    def read_metadata(self, *args: Any) -> Metadata:
        metadata = read_metadata(Path(self.path))
        if metadata.storage_meta is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id  # as FileSystemReader does
        return metadata


def load(state: dict[str, Any], path: Path, **kwargs: Any) -> None:
    """``dcp.load`` of ``state`` from step folder ``path`` (kwargs: no_dist, process_group, ...), its metadata checked
    first so a refusal or a missing index is one line on every rank."""
    read_metadata(path)
    dcp.load(state, storage_reader=SafeReader(str(path)), **kwargs)


def integrity_defect(path: Path) -> str | None:
    """What is wrong with step folder ``path``'s files, found by reading them again; None if they look intact.

    Checks what a torn or truncated write leaves: a shardlab.json that does not parse, a .metadata that does not
    unpickle, a shard file that is missing or shorter than the entries the index places in it. It reads sizes, not
    every shard byte, so it is quick on any model size. An I/O error is no clear defect (it may pass): a load that
    failed although nothing here is wrong is not an unreadable checkpoint."""
    from shardlab.checkpoint.layout import META_FILE

    path = Path(path)
    raw: dict[str, bytes] = {}
    for name in (META_FILE, METADATA_FILE):
        try:
            raw[name] = (path / name).read_bytes()
        except FileNotFoundError:
            return f"{path} has no {name}"
        except OSError:
            return None
    try:
        json.loads(raw[META_FILE])
    except ValueError as e:
        return f"{path / META_FILE} does not parse ({e})"
    try:
        metadata = MetadataUnpickler(io.BytesIO(raw[METADATA_FILE]), path / METADATA_FILE).load()
    except UnsafeCheckpointError:
        raise
    except Exception as e:
        return f"{path / METADATA_FILE} does not unpickle ({type(e).__name__}: {str(e)[:200]})"
    ends: dict[str, int] = {}
    for info in (getattr(metadata, "storage_data", None) or {}).values():
        relative = getattr(info, "relative_path", None)
        if relative is None:
            return f"{path / METADATA_FILE} has an entry without a file"
        ends[relative] = max(ends.get(relative, 0), info.offset + info.length)
    for relative, end in sorted(ends.items()):
        try:
            size = (path / relative).stat().st_size
        except FileNotFoundError:
            return f"{path / relative} is missing"
        except OSError:
            return None
        if size < end:
            return f"{path / relative} holds {size} bytes but its index needs {end} (a write cut short)"
    return None
