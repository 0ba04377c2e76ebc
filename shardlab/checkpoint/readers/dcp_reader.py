"""Reading DCP step folders without running their code or changing the process.

DCP keeps a checkpoint's index in ``.metadata``, a pickle, and torch's FileSystemReader reads it with ``pickle.load``:
a step folder someone shared could run anything on resume, ``init_from`` or in the tools. Filtering the globals a
pickle names is not enough either: its BUILD opcode sets attributes on whatever it is given, an allowed class or
function included (``pathlib.PurePosixPath``'s ``_str``, ``torch.serialization._get_layout``'s cache), so a file could
rewire every ``Path`` of the process without running any code. Here the file is read by ``MetadataUnpickler``, which
follows the opcodes DCP writes one by one: it calls only constructors of plain values, creates only DCP's metadata
dataclasses, and changes only objects it created itself (why not torch's own weights_only unpickler: its
docstring). The result is then checked field by field against the types DCP writes. The file keeps torch's own
format, so torch's tools (``dcp_to_torch_save``) still read our checkpoints; the shard files themselves are read by
torch with ``weights_only=True``.

The index is then checked against what DCP writes, since the rest of the reading trusts it: every entry lies in a
regular file of the step folder itself and inside that file (not ``/dev/zero``, not 8 GiB past its end), and every
tensor's chunks tile its shape exactly, each stored in its own bytes (so no reader allocates a tensor larger than the
files hold, and no element of one is left unwritten). The small pickled values DCP keeps beside the tensors (the
optimizer's hyper-parameters) are read with torch's ``weights_only`` unpickler: DCP's own planner would unpickle them
with ``weights_only=False``.

``SafeReader`` is DCP's FileSystemReader with that ``read_metadata`` (the public StorageReader method),
``SafeLoadPlanner`` its DefaultLoadPlanner with that ``load_bytes``, and ``load`` checks the folder first, so a
refusal is one line rather than DCP's wrapped collective error. Every path that opens a step folder comes through
here: resume (checkpoint.resume, through checkpoint.manager), ``init_from`` and the tools (checkpoint.weights: generate,
consolidate, export_hf, evaluate).
"""

from __future__ import annotations

import io
import json
import math
import os
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

from shardlab.checkpoint.readers.metadata_pickle import (  # noqa: F401  (re-exported: dcp_reader is the reader's face)
    ARGUMENTS,
    CALLABLES,
    FIELD_TYPES,
    GLOBALS,
    METADATA_CLASSES,
    MetadataUnpickler,
    _shown,
    _unsafe,
    unpickle_metadata,
)
from shardlab.errors import CheckpointError, UnsafeCheckpointError
from shardlab.files.regular_file import (
    NotAFile,
    describe_os_error,
    open_regular,
    read_at,
    read_into,
    read_regular,
    stat_file,
)
from shardlab.train_state import nonfinite

METADATA_FILE = ".metadata"
"""The name DCP's FileSystemWriter gives the index (tests/unit/test_dcp_reader.py checks torch still writes it)."""

METADATA_MAX_BYTES = 1 << 30
"""A .metadata file larger than this is refused unread: about 5 million chunks' worth, more than any checkpoint of a
model that fits a cluster writes (its unpickled objects take several times the file's size in memory)."""


def read_metadata(path: Path, *, values: bool = True) -> Metadata:
    """The DCP index of step folder ``path``, read through MetadataUnpickler and checked against the folder's files;
    ``values``: also read the small values it holds, through saved_values' ValueUnpickler (``SafeReader`` does that
    inside a load). CheckpointError if it is missing, not DCP metadata or its files are cut short (a torn write);
    UnsafeCheckpointError if it names anything DCP never writes, or is no regular file of the folder."""
    path = Path(path)
    source = path / METADATA_FILE
    try:
        data = read_regular(source, max_bytes=METADATA_MAX_BYTES)
    except FileNotFoundError:
        raise CheckpointError(f"{path} has no DCP {METADATA_FILE}; is it a step_N checkpoint folder?") from None
    metadata = unpickle_metadata(data, source)
    check_index(path, metadata)
    if values:
        from shardlab.checkpoint.readers.saved_values import read_value

        for index, info in metadata.storage_data.items():
            if isinstance(metadata.state_dict_metadata.get(index.fqn), BytesStorageMetadata):
                read_value(_read_extent(path, info), f"{path}: its entry {index.fqn}")
    return metadata


def _read_extent(path: Path, info: _StorageInfo) -> bytes:
    """The bytes of one entry of step folder ``path``, its file opened as a regular file of the folder."""
    fd, _ = _open_shard(path, info.relative_path)
    try:
        return read_at(fd, path / info.relative_path, info.offset, info.length)
    finally:
        os.close(fd)


def _open_shard(path: Path, name: str) -> tuple[int, int]:
    try:
        return open_regular(path / name)
    except FileNotFoundError:
        raise CheckpointError(f"{path / name} is missing (its index places entries there)") from None


def check_index(path: Path, metadata: Metadata) -> None:
    """That ``metadata``'s entries lie inside the regular files of ``path``, each in bytes of its own, and its
    tensors' chunks tile them exactly."""
    source = path / METADATA_FILE
    storage, entries = metadata.storage_data, metadata.state_dict_metadata  # their types: _structure_defect
    sizes: dict[str, int] = {}
    extents: dict[str, list[tuple[int, int, str]]] = {}
    for index, info in storage.items():
        name = info.relative_path
        if name in ("", ".", "..") or "/" in name or "\\" in name:
            raise _unsafe(source, f"places {index.fqn} in {_shown(name)}, outside the step folder")
        if info.transform_descriptors:  # DCP's stream extensions (compression): shardlab writes none
            raise _unsafe(source, f"asks for stream transforms {list(info.transform_descriptors)} on {index.fqn}")
        if info.offset < 0 or info.length < 0:
            raise _unsafe(source, f"gives {index.fqn} the extent ({info.offset!r}, {info.length!r})")
        if name not in sizes:
            sizes[name] = _file_size(path, name, index.fqn)
        if info.offset + info.length > sizes[name]:
            raise CheckpointError(
                f"{path / name} holds {sizes[name]} bytes but its index needs {info.offset + info.length} "
                "(a write cut short)"
            )
        if info.length:
            extents.setdefault(name, []).append((info.offset, info.length, index.fqn))
    _check_disjoint(source, extents)
    for fqn, entry in entries.items():
        if isinstance(entry, TensorStorageMetadata):
            _check_chunks(source, fqn, entry, storage)
        elif MetadataIndex(fqn) not in storage:  # DCP's reader would fail on it inside the collective load
            raise _unsafe(source, f"lists the value {fqn} but stores it nowhere")


def _file_size(path: Path, name: str, fqn: str) -> int:
    """The size of ``name`` in step folder ``path``: a regular file of the folder itself (a link is not followed)."""
    try:
        return stat_file(path / name).st_size
    except FileNotFoundError:
        raise CheckpointError(f"{path / name} is missing (its index places {fqn} there)") from None
    except NotAFile as e:
        where = f"places {fqn} in {path / name}, which is not a regular file ({e.kind})"
        raise _unsafe(path / METADATA_FILE, where) from None
    except OSError as e:
        raise CheckpointError(f"{_shown(str(path / name))} {describe_os_error(path / name, e)}") from None


def _check_disjoint(source: Path, extents: dict[str, list[tuple[int, int, str]]]) -> None:
    """No two entries share a byte of a file: each chunk is stored once, so a reader never writes out more than the
    folder holds (16 tensors over the same 16 MiB made an 18 MB folder a 269 MB safetensors file)."""
    for name, spans in extents.items():
        spans.sort()
        for (start, length, fqn), (after, _, other) in zip(spans, spans[1:], strict=False):
            if start + length > after:
                raise _unsafe(source, f"stores {fqn} and {other} in the same bytes of {name} (from byte {after})")


def _check_chunks(source: Path, fqn: str, entry: TensorStorageMetadata, storage: dict) -> None:
    """The chunks tile the tensor exactly: each inside its shape and stored in at least its own bytes, no two
    overlapping, and together as many elements as the shape. A gap would leave memory the reader allocated
    (``torch.empty``) unwritten, heap bytes that ``consolidate`` would then write out; sizes that add up do not rule
    that out when two chunks overlap ([0, 2048) and [1024, 3072) of 4096)."""
    shape = list(entry.size)
    if any(d < 0 for d in shape):  # before anything is allocated: torch.empty([-2, 0]) fails in twenty lines
        raise _unsafe(source, f"gives {fqn} the shape {shape}")
    itemsize = entry.properties.dtype.itemsize
    covered, boxes = 0, []
    for chunk in entry.chunks:
        offsets, sizes = list(chunk.offsets), list(chunk.sizes)
        inside = len(offsets) == len(sizes) == len(shape) and all(
            0 <= o and 0 <= n and o + n <= d for o, n, d in zip(offsets, sizes, shape, strict=True)
        )
        if not inside:
            raise _unsafe(source, f"gives {fqn} {shape} a chunk at {offsets} of {sizes}")
        numel = math.prod(sizes)
        info = storage.get(MetadataIndex(fqn, chunk.offsets))
        if info is None or info.length < numel * itemsize:
            raise _unsafe(source, f"stores the chunk of {fqn} at {offsets} in fewer bytes than its {numel} elements")
        covered += numel
        if numel:
            boxes.append((offsets, sizes))
    if covered != math.prod(shape):
        raise _unsafe(source, f"gives {fqn} the shape {shape} but chunks holding {covered} of its elements")
    try:
        pair = _overlapping(boxes, shape)
    except _TooFragmented:
        raise _unsafe(
            source, f"splits {fqn} {shape} into {len(boxes)} chunks along 3 or more dimensions, too many to check"
        ) from None
    if pair:
        raise _unsafe(source, f"gives {fqn} {shape} overlapping chunks at {pair[0]} and {pair[1]}")


Box = tuple[list[int], list[int]]


class _TooFragmented(Exception):
    """More pairs of chunks to compare than MAX_PAIRS."""


MAX_PAIRS = 2_000_000
"""Pairs of chunks compared for a tensor split along three or more dimensions (no FSDP or TP layout is): past this,
the layout is refused rather than checked for minutes."""


def _overlapping(boxes: list[Box], shape: list[int]) -> tuple[list[int], list[int]] | None:
    """The offsets of two non-empty boxes (offsets, sizes) that share an element, or None, in O(n log n) for n boxes
    split along at most two dimensions (every FSDP and TP layout: rows, or rows and columns). Dimensions every box
    spans whole are set aside first: FSDP's row shards are then intervals, and a [1, n] tensor in n one-element chunks
    is n intervals of a line, sorted once (it was a quadratic sweep: 75 s for n = 8,000)."""
    split = [d for d in range(len(shape)) if any(s[d] != shape[d] for _, s in boxes)]
    if not split:  # every box is the whole tensor
        return (boxes[0][0], boxes[1][0]) if len(boxes) > 1 else None
    if len(split) == 1:
        (d,) = split
        ordered = sorted(boxes, key=lambda b: b[0][d])
        for a, b in zip(ordered, ordered[1:], strict=False):
            if a[0][d] + a[1][d] > b[0][d]:
                return a[0], b[0]
        return None
    return _sweep(boxes, split[0], split[1], split[2:])


def _sweep(boxes: list[Box], x: int, y: int, rest: list[int]) -> tuple[list[int], list[int]] | None:
    """A sweep along dimension ``x``: the boxes that meet the sweep line are kept sorted by their start along ``y``,
    where, with no ``rest``, they are disjoint, so a new box is compared with its two neighbours only (bisect)."""
    import bisect
    import heapq

    starts: list[tuple[int, int]] = []  # (y start, box number) of the boxes the line meets, sorted
    ending: list[tuple[int, int, int]] = []  # heap of (x end, y start, box number)
    pairs = 0
    for k in sorted(range(len(boxes)), key=lambda i: boxes[i][0][x]):
        offsets, sizes = boxes[k]
        while ending and ending[0][0] <= offsets[x]:
            _, y0, gone = heapq.heappop(ending)
            del starts[bisect.bisect_left(starts, (y0, gone))]
        lo, hi = offsets[y], offsets[y] + sizes[y]
        i = bisect.bisect_left(starts, (lo, -1))
        if rest:  # boxes may overlap along y and still be apart along another dimension: compare, within a budget
            i = 0
            near = [j for _, j in starts if boxes[j][0][y] < hi and lo < boxes[j][0][y] + boxes[j][1][y]]
        else:
            near = [j for _, j in starts[max(i - 1, 0) : i + 1]]
        pairs += len(near)
        if pairs > MAX_PAIRS:
            raise _TooFragmented
        for j in near:
            other = boxes[j]
            if all(o < b + n and b < o + m for o, m, b, n in zip(other[0], other[1], offsets, sizes, strict=True)):
                return other[0], offsets
        starts.insert(bisect.bisect_left(starts, (lo, k)), (lo, k))
        heapq.heappush(ending, (offsets[x] + sizes[x], lo, k))
    return None


def values_load_back(values: Any) -> str | None:
    """Why ``values`` (an optimizer's hyper-parameters, a task's state) would not read back from a checkpoint through
    ``load_value``, or None: a plug-in whose param groups hold, say, a numpy scalar would save, then be refused at
    its resume as a crafted file. Checked before training (Trainer.setup)."""
    from shardlab.checkpoint.readers.saved_values import read_value

    buffer = io.BytesIO()
    torch.save(values, buffer)  # as DCP's planner writes each value
    try:
        read_value(buffer.getvalue(), "it")
    except CheckpointError as e:
        return str(e).removeprefix("it ").split(", which DCP never writes")[0]
    return None


def load_value(data: bytes, path: Path, fqn: str) -> Any:
    """A small value DCP pickled beside the tensors (a learning rate, betas, a list of names), read by
    saved_values.ValueUnpickler: plain values and tensors only, dict keys strings or ints, bounded depth and size."""
    from shardlab.checkpoint.readers.saved_values import read_value

    return read_value(data, f"{path}: its entry {fqn}")


class SafeReader(FileSystemReader):
    """torch's FileSystemReader, whose metadata goes through ``read_metadata`` above and whose ``read_data`` opens
    each shard file as a regular file of the step folder and reads every chunk and value through saved_values (no
    ``torch.load``). Its signature takes no rank, so DCP never falls back to per-rank metadata files (shardlab
    writes one global index)."""

    def read_metadata(self, *args: Any) -> Metadata:
        metadata = read_metadata(Path(self.path), values=False)  # read_data reads the values
        if metadata.storage_meta is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id  # as FileSystemReader does
        return metadata

    def read_data(self, plan: Any, planner: Any) -> Any:
        from torch.distributed.checkpoint.planner import LoadItemType
        from torch.futures import Future

        folder = Path(self.path)
        per_file: dict[str, list[Any]] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        for name, items in per_file.items():
            fd, _ = _open_shard(folder, name)
            try:
                for item in items:
                    info = self.storage_data[item.storage_index]
                    if item.type == LoadItemType.BYTE_IO:
                        planner.load_bytes(item, io.BytesIO(read_at(fd, folder / name, info.offset, info.length)))
                    else:
                        self._read_chunk(fd, folder / name, info, item, planner)
            finally:
                os.close(fd)
        future: Future = Future()
        future.set_result(None)
        return future

    @staticmethod
    def _read_chunk(fd: int, file: Path, info: _StorageInfo, item: Any, planner: Any) -> None:
        """One stored chunk into the part of its destination ``item`` asks for: read into a buffer of its own
        length, a view of it checked against its bytes (saved_values), narrowed, copied."""
        from shardlab.checkpoint.readers.saved_values import read_tensor

        buffer = bytearray(info.length)
        read_into(fd, file, info.offset, buffer)
        label = f"{file.parent}: its entry {item.storage_index.fqn}"
        tensor = read_tensor(buffer, label)
        offsets, lengths = list(item.storage_offsets), list(item.lengths)
        shape = list(tensor.shape)
        if not len(offsets) == len(lengths) == len(shape) or any(
            o + n > d for o, n, d in zip(offsets, lengths, shape, strict=True)
        ):
            raise _unsafe(file.parent / METADATA_FILE, f"reads {offsets} of {lengths} from {label} of shape {shape}")
        for dim, (offset, length) in enumerate(zip(offsets, lengths, strict=True)):
            tensor = tensor.narrow(dim, offset, length)
        if item.storage_index.fqn.startswith("optim.") and tensor.is_floating_point():
            if not bool(torch.isfinite(tensor).all()):  # the non-finite guard would stop the run, blaming the lr
                raise CheckpointError(f"{label} holds values that are not finite; a run resumes only from finite state")
        target = planner.resolve_tensor(item).detach()
        if target.size() != tensor.size():
            raise CheckpointError(f"{label} has the shape {list(tensor.shape)} where {list(target.shape)} belongs")
        target.copy_(tensor)
        planner.commit_tensor(item, target)


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's DefaultLoadPlanner, whose ``load_bytes`` reads values through ``load_value`` (the parent's would
    ``torch.load`` them with ``weights_only=False``) and puts them where the parent would."""

    def __init__(self, path: Path) -> None:
        super().__init__()
        self.path = path

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        from torch.distributed.checkpoint._traverse import set_element  # DefaultLoadPlanner's own placement

        fqn = read_item.dest_index.fqn
        loaded = load_value(value.getvalue(), self.path, fqn)
        if fqn.startswith("optim.") and (found := nonfinite(loaded, fqn)) is not None:
            raise CheckpointError(
                f"{self.path}: its entry {found[0]} is {found[1]!r}, not a finite number; a run resumes only from "
                "finite state: resume from another checkpoint"
            )
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], loaded)
        else:
            self.state_dict[fqn] = loaded


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
    from shardlab.checkpoint.layout import META_FILE, META_MAX_BYTES

    path = Path(path)
    raw: dict[str, bytes] = {}
    for name, cap in ((META_FILE, META_MAX_BYTES), (METADATA_FILE, METADATA_MAX_BYTES)):
        try:
            raw[name] = read_regular(path / name, max_bytes=cap)
        except FileNotFoundError:
            return f"{path} has no {name}"
        except UnsafeCheckpointError:
            raise
        except (OSError, CheckpointError):
            return None
    try:
        json.loads(raw[META_FILE])
    except ValueError as e:
        return f"{path / META_FILE} does not parse ({e})"
    try:
        metadata = unpickle_metadata(raw[METADATA_FILE], path / METADATA_FILE)
    except UnsafeCheckpointError:
        raise
    except CheckpointError as e:
        return str(e).replace(" is unreadable (", " does not unpickle (", 1)
    try:
        check_index(path, metadata)
    except UnsafeCheckpointError:
        raise
    except CheckpointError as e:
        return str(e)
    except OSError:
        return None
    return None
