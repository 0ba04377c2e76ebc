"""Reading DCP step folders without running their code.

DCP keeps a checkpoint's index in ``.metadata``, a pickle, and torch's FileSystemReader reads it with ``pickle.load``:
a step folder someone shared could run anything on resume, ``init_from`` or in the tools. Here it is unpickled by an
``Unpickler`` whose ``find_class`` admits only the classes DCP writes into that file (its metadata dataclasses,
``torch.Size``, dtypes, layouts, paths); anything else is refused before it is called. The file keeps torch's own
format, so torch's tools (``dcp_to_torch_save``) still read our checkpoints; the shard files themselves are read by
torch with ``weights_only=True``.

The index is then checked against what DCP writes, since the rest of the reading trusts it: every entry lies in a
regular file of the step folder itself and inside that file (not ``/dev/zero``, not 8 GiB past its end), and every
tensor's chunks cover its shape with stored bytes (so no reader allocates a tensor larger than the files hold). The
small pickled values DCP keeps beside the tensors (the optimizer's hyper-parameters) are read with torch's
``weights_only`` unpickler: DCP's own planner would unpickle them with ``weights_only=False``.

``SafeReader`` is DCP's FileSystemReader with that ``read_metadata`` (the public StorageReader method),
``SafeLoadPlanner`` its DefaultLoadPlanner with that ``load_bytes``, and ``load`` checks the folder first, so a
refusal is one line rather than DCP's wrapped collective error. Every path that opens a step folder comes through
here: resume (checkpoint.manager), ``init_from`` and the tools (checkpoint.weights).
"""

from __future__ import annotations

import io
import json
import math
import pickle
import re
import stat
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorStorageMetadata,
)

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


def read_metadata(path: Path, *, values: bool = True) -> Metadata:
    """The DCP index of step folder ``path``, read through the allow-list and checked against the folder's files;
    ``values``: also unpickle the small values it holds, through ``weights_only`` (``SafeLoadPlanner`` does that
    inside a load). CheckpointError if it is missing, not DCP metadata or its files are cut short (a torn write);
    UnsafeCheckpointError if it names anything DCP never writes."""
    path = Path(path)
    source = path / METADATA_FILE
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
    check_index(path, metadata)
    if values:
        for index, info in metadata.storage_data.items():
            if isinstance(metadata.state_dict_metadata.get(index.fqn), BytesStorageMetadata):
                with open(path / info.relative_path, "rb") as f:
                    f.seek(info.offset)
                    load_value(f.read(info.length), path, index.fqn)
    return metadata


def _unsafe(source: Path, what: str) -> UnsafeCheckpointError:
    return UnsafeCheckpointError(
        f"{source} {what}, which DCP never writes: refused before reading it (a crafted or foreign file); load "
        "checkpoints only from sources you trust"
    )


def check_index(path: Path, metadata: Metadata) -> None:
    """That ``metadata``'s entries lie inside the regular files of ``path`` and its tensors' chunks cover them."""
    source = path / METADATA_FILE
    storage, entries = metadata.storage_data, metadata.state_dict_metadata
    if not isinstance(storage, dict) or not isinstance(entries, dict):
        raise _unsafe(source, "has no table of entries")
    sizes: dict[str, int] = {}
    for index, info in storage.items():
        if not isinstance(index, MetadataIndex) or not isinstance(info, _StorageInfo):
            raise _unsafe(source, f"holds a {type(info).__name__} where an entry's place belongs")
        name = info.relative_path
        if not isinstance(name, str) or name in ("", ".", "..") or "/" in name or "\\" in name:
            raise _unsafe(source, f"places {index.fqn} in {name!r}, outside the step folder")
        if info.transform_descriptors:  # DCP's stream extensions (compression): shardlab writes none
            raise _unsafe(source, f"asks for stream transforms {list(info.transform_descriptors)} on {index.fqn}")
        if not all(isinstance(n, int) and n >= 0 for n in (info.offset, info.length)):
            raise _unsafe(source, f"gives {index.fqn} the extent ({info.offset!r}, {info.length!r})")
        if name not in sizes:
            try:
                st = (path / name).stat()
            except FileNotFoundError:
                raise CheckpointError(f"{path / name} is missing (its index places {index.fqn} there)") from None
            if not stat.S_ISREG(st.st_mode):
                raise _unsafe(source, f"places {index.fqn} in {path / name}, which is not a regular file")
            sizes[name] = st.st_size
        if info.offset + info.length > sizes[name]:
            raise CheckpointError(
                f"{path / name} holds {sizes[name]} bytes but its index needs {info.offset + info.length} "
                "(a write cut short)"
            )
    for fqn, entry in entries.items():
        if isinstance(entry, TensorStorageMetadata):
            _check_chunks(source, fqn, entry, storage)
        elif not isinstance(entry, BytesStorageMetadata):
            raise _unsafe(source, f"describes {fqn} as a {type(entry).__name__}")


def _check_chunks(source: Path, fqn: str, entry: TensorStorageMetadata, storage: dict) -> None:
    """Each chunk inside the tensor's shape and stored in at least its own bytes; the chunks cover the shape."""
    shape = list(entry.size)
    itemsize = entry.properties.dtype.itemsize
    covered, seen = 0, set()
    for chunk in entry.chunks:
        offsets, sizes = list(chunk.offsets), list(chunk.sizes)
        inside = len(offsets) == len(sizes) == len(shape) and all(
            0 <= o and 0 <= n and o + n <= d for o, n, d in zip(offsets, sizes, shape, strict=True)
        )
        if not inside:
            raise _unsafe(source, f"gives {fqn} {shape} a chunk at {offsets} of {sizes}")
        if (tuple(offsets), tuple(sizes)) in seen:
            continue
        seen.add((tuple(offsets), tuple(sizes)))
        numel = math.prod(sizes)
        info = storage.get(MetadataIndex(fqn, chunk.offsets))
        if info is None or info.length < numel * itemsize:
            raise _unsafe(source, f"stores the chunk of {fqn} at {offsets} in fewer bytes than its {numel} elements")
        covered += numel
    if covered != math.prod(shape):
        raise _unsafe(source, f"gives {fqn} the shape {shape} but chunks holding {covered} of its elements")


def _refusal(error: pickle.UnpicklingError) -> str:
    """The gist of torch's many-line weights_only refusal: the global it names, else the unpickler's own reason."""
    text = str(error)
    named = re.search(r"GLOBAL (\S+)", text)
    if named:
        return f"it names {named.group(1)}"
    reason = re.search(r"WeightsUnpickler error:\s*(.+)", text)
    return reason.group(1).strip() if reason else text.strip().splitlines()[0][:200]


def values_load_back(values: Any) -> str | None:
    """Why ``values`` (an optimizer's hyper-parameters, a task's state) would not read back from a checkpoint through
    ``load_value``, or None: a plug-in whose param groups hold, say, a numpy scalar would save, then be refused at
    its resume as a crafted file. Checked before training (Trainer.setup)."""
    buffer = io.BytesIO()
    torch.save(values, buffer)
    buffer.seek(0)
    try:
        torch.load(buffer, weights_only=True)
    except pickle.UnpicklingError as e:
        return _refusal(e)
    return None


def load_value(data: bytes, path: Path, fqn: str) -> Any:
    """A small value DCP pickled beside the tensors (a learning rate, betas, a list of names), unpickled by torch's
    ``weights_only`` unpickler: tensors, containers and numbers only."""
    try:
        return torch.load(io.BytesIO(data), weights_only=True)
    except pickle.UnpicklingError as e:
        raise UnsafeCheckpointError(
            f"{path}: its entry {fqn} is a pickle that torch's weights_only unpickler refuses ({_refusal(e)}), which "
            "DCP never writes: refused without running it (a crafted or foreign file); load checkpoints only from "
            "sources you trust"
        ) from None
    except Exception as e:
        raise CheckpointError(f"{path}: its entry {fqn} is unreadable ({type(e).__name__}: {str(e)[:200]})") from e


class SafeReader(FileSystemReader):
    """torch's FileSystemReader, whose metadata goes through ``read_metadata`` above. Its signature takes no rank,
    so DCP never falls back to per-rank metadata files (shardlab writes one global index)."""

    def read_metadata(self, *args: Any) -> Metadata:
        metadata = read_metadata(Path(self.path), values=False)  # SafeLoadPlanner reads the values
        if metadata.storage_meta is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id  # as FileSystemReader does
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's DefaultLoadPlanner, whose ``load_bytes`` unpickles with ``weights_only`` (``load_value``). The parent
    then stores the value as it does everything: it is handed a pickle of it that torch.save just wrote."""

    def __init__(self, path: Path) -> None:
        super().__init__()
        self.path = path

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        safe = io.BytesIO()
        torch.save(load_value(value.getvalue(), self.path, read_item.dest_index.fqn), safe)
        safe.seek(0)
        super().load_bytes(read_item, safe)


def load(state: dict[str, Any], path: Path, *, checked: bool = False, **kwargs: Any) -> None:
    """``dcp.load`` of ``state`` from step folder ``path`` (kwargs: no_dist, process_group, ...); unless ``checked``
    (the caller ran ``read_metadata``), the folder is checked first, so a refusal or a missing index is one line on
    every rank."""
    path = Path(path)
    if not checked:
        read_metadata(path)
    dcp.load(state, storage_reader=SafeReader(str(path)), planner=SafeLoadPlanner(path), **kwargs)


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
    if not isinstance(metadata, Metadata):
        return f"{path / METADATA_FILE} holds a {type(metadata).__name__}, not DCP metadata"
    try:
        check_index(path, metadata)
    except UnsafeCheckpointError:
        raise
    except CheckpointError as e:
        return str(e)
    except OSError:
        return None
    return None
