"""Weights from a Hugging Face safetensors folder into a model as it is sharded: each rank reads only its own slices.

The model is built on meta, wrapped (``fully_shard``, DDP or nothing) and materialized first; then DCP's
``HuggingFaceStorageReader``, told exactly which files to read (``weight_files``: those the index names, each a
regular file of the folder; ``folder_reader``), reads, for every parameter, the slice of the checkpoint tensor that
this rank's local shard holds (``safe_open(...).get_slice``), straight into it, converting the dtype on the way
(bf16 files into fp32 master weights). No rank builds the full model or reads a whole file; the largest extra buffer
is one slice.

The caller names the checkpoint tensor of each parameter (``names``: shardlab name -> (checkpoint key, transposed));
a transposed one (GPT-2's Conv1D weights, stored (in, out)) is read into a transposed view of the local shard, so a
rank holding rows of the parameter reads the matching columns of the file. The family-specific names live with the
task (shardlab_tasks/lm/hf/hf_models.py); this module knows safetensors and DCP only.

The other direction (``write_shards``): a checkpoint's tensors written as Hugging Face safetensors shards with their
index, streamed in groups of bounded size from a step folder (``step_folder_reader``: DCP reads only the entries
asked for) or a safetensors file, so one process exports a model of any size; into a staging folder that replaces the
output only once complete (shardlab/checkpoint/export_folder.py).
"""

from __future__ import annotations

import errno
import hashlib
import json
import math
import os
import struct
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.distributed import checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem
from torch.distributed.tensor import DTensor, Shard
from torch.futures import Future

from shardlab.checkpoint import agreement
from shardlab.checkpoint.readers import dcp_reader
from shardlab.checkpoint.readers.dcp_reader import SafeLoadPlanner, SafeReader
from shardlab.distributed.materialize import clean_name
from shardlab.errors import CheckpointError, first_cause
from shardlab.files.regular_file import (
    NotAFile,
    describe_os_error,
    open_file,
    read_at,
    read_small_file,
    stat_file,
)

INDEX_FILE = "model.safetensors.index.json"

Names = Mapping[str, tuple[str, bool]]
"""shardlab parameter name -> (the checkpoint tensor's key, whether it is stored transposed)."""
Pieces = Mapping[str, Sequence[tuple[str, tuple]]]
"""shardlab parameter name -> the checkpoint tensors it is made of, each (key, index): it is ``param[index]``, the
index a tuple of ints and slices on the leading dims (an MoE block's grouped experts: one checkpoint tensor per
expert, or per half of an expert's rows)."""


def weight_files(folder: Path) -> list[Path]:
    """The folder's safetensors files: exactly those its index names, else exactly the ``*.safetensors`` in it, each
    checked a regular file (``_as_files``); an index naming a path outside the folder is refused."""
    index = folder / INDEX_FILE
    try:
        text = read_small_file(index)
    except (FileNotFoundError, NotADirectoryError):
        return _as_files(sorted(folder.glob("*.safetensors")), folder)
    except NotAFile as e:  # a FIFO hung the reader, a link to /dev/zero grew it: refused, never read past its cap
        raise CheckpointError(f"{index} {e.reason}; give the safetensors index as the model's folder has it") from None
    except OSError as e:
        raise CheckpointError(f"{index} {describe_os_error(index, e)}") from None
    try:
        weight_map = json.loads(text)["weight_map"]
        names = sorted(set(weight_map.values()))
        if not isinstance(weight_map, dict) or not all(isinstance(n, str) for n in names):
            raise TypeError("its weight_map is not an object of file names")
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as e:
        raise CheckpointError(f"{index} is not a safetensors index ({first_cause(e)})") from None
    for name in names:
        if name in ("", ".", "..") or Path(name).name != name or "\\" in name or not name.endswith(".safetensors"):
            raise CheckpointError(
                f"{index} names {name!r}, not a .safetensors file of {folder}; an index names files of its own folder"
            )
    return _as_files([folder / name for name in names], folder, index)


def link_root(folder: Path) -> Path:
    """How far a link among ``folder``'s weight files may lead: the folder itself, or for a Hugging Face cache's
    snapshot (``models--org--name/snapshots/REV``, links into ``../../blobs``) the model's cache folder."""
    folder = Path(os.path.realpath(folder))
    return folder.parent.parent if folder.parent.name == "snapshots" else folder


def _as_files(files: list[Path], folder: Path, index: Path | None = None) -> list[Path]:
    """``files``, each a regular file, where a link is followed no further than ``link_root``: safetensors opens them
    by name, and a FIFO there would hang its open for ever. One the ``index`` names but the folder lacks is said so."""
    root = link_root(folder)
    for f in files:
        try:
            if index is not None and not os.path.lexists(os.path.realpath(f)):
                raise FileNotFoundError(errno.ENOENT, "not there", str(f))
            stat_file(f, root=root)
        except FileNotFoundError as e:
            if index is not None:  # a file of the index not downloaded (or a cache's link to a blob that is not)
                raise CheckpointError(
                    f"{index} names {f.name}, which is not in {f.parent}; download the whole folder"
                ) from None
            raise CheckpointError(f"{f} {describe_os_error(f, e)}") from None
        except NotAFile as e:
            raise CheckpointError(f"{f} {e.reason}; give the model's safetensors files as files") from None
        except OSError as e:
            raise CheckpointError(f"{f} {describe_os_error(f, e)}") from None
    return files


DIGEST_HEAD_BYTES = 64 << 10
"""What a weights digest reads of a file that is not safetensors (a step folder's .metadata and .distcp shards)."""
SAFETENSORS_HEADER_MAX_BYTES = 100 << 20
"""The largest safetensors header (the library's own limit): a digest reads no more of one."""


def weights_digest(path: Path) -> str:
    """A digest of the weights at ``path`` (a Hugging Face folder, a DCP step folder or a .safetensors file) from
    each weight file's name, size and header bytes (a safetensors file's header, else its first 64 KiB), in name
    order; headers only, never the tensors. A LoRA run records its frozen base's, so a base changed since (replaced by
    an export, another model put at the path) is refused rather than silently used. CheckpointError when unreadable."""
    path = Path(path).expanduser()
    root: Path | None = None  # a file named outright: a link followed (weights.describe's rule), to a file
    if not path.is_dir():
        files = [path]
    elif (path / ".metadata").exists():  # a step folder: its index and shards, each a file of its own (no link)
        root = path
        files = sorted(f for f in path.iterdir() if f.name == ".metadata" or f.suffix == ".distcp")
    else:
        files, root = weight_files(path), path
    digest = hashlib.sha256()
    for file in files:
        try:
            fd, st = open_file(file, follow_links=True, root=None if root is None else link_root(root))
        except (NotAFile, OSError) as e:
            raise CheckpointError(f"{file} {getattr(e, 'reason', None) or describe_os_error(file, e)}") from None
        try:
            head = read_at(fd, file, 0, min(8, st.st_size))
            if file.suffix == ".safetensors" and len(head) == 8:
                length = min(struct.unpack("<Q", head)[0], SAFETENSORS_HEADER_MAX_BYTES, st.st_size - 8)
                head += read_at(fd, file, 8, length)
            else:
                head = read_at(fd, file, 0, min(DIGEST_HEAD_BYTES, st.st_size))
        finally:
            os.close(fd)
        digest.update(f"{file.name}\0{st.st_size}\0{len(head)}\0".encode() + head)
    return digest.hexdigest()[:32]


def tensor_shapes(files: list[Path]) -> dict[str, tuple[tuple[int, ...], str]]:
    """key -> (shape, safetensors dtype) of every tensor in ``files``, from their headers alone (no tensor is read)."""
    return {key: (shape, dtype) for key, (_, shape, dtype) in tensor_files(files).items()}


def tensor_files(files: list[Path]) -> dict[str, tuple[Path, tuple[int, ...], str]]:
    """key -> (its file, shape, safetensors dtype) of every tensor in ``files``, from their headers alone; a key
    stored in two of the files is refused (which one is the model's would be a guess)."""
    from safetensors import safe_open

    found: dict[str, tuple[Path, tuple[int, ...], str]] = {}
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as f:
                for key in f.keys():
                    piece = f.get_slice(key)
                    if key in found:
                        raise ValueError(f"tensor {key} is in {found[key][0].name} too")
                    found[key] = (file, tuple(piece.get_shape()), piece.get_dtype())
        except Exception as e:  # safetensors' own errors have no common type
            raise CheckpointError(f"{file} is not a readable safetensors file ({first_cause(e)})") from None
    return found


def fit_errors(
    model: nn.Module,
    folder: Path,
    names: Names,
    ignored: tuple[str, ...] = (),
    keys: Callable[[str], bool] | None = None,
    pieces: Pieces | None = None,
) -> list[str]:
    """Why the folder's tensors cannot fill ``model`` (missing, of another shape, or unused); [] when they can. Reads
    headers only. ``ignored``: suffixes of checkpoint keys that may be present and unused (buffers); ``keys``: the
    parameters to fill (None: all; a LoRA model's adapters are not in the folder); ``pieces``: the parameters made
    of several checkpoint tensors."""
    files = weight_files(folder)
    if not files:
        return [f"{folder} holds no .safetensors weights (only a config.json plans: add dry_run=true)"]
    shapes = tensor_shapes(files)
    errors, pieces = [], pieces or {}
    for name, param in _parameters(model, keys).items():
        for key, index in pieces.get(name, ()):
            expected = _piece_shape(param.shape, index)
            if key not in shapes:
                errors.append(f"{folder} lacks tensor {key}")
            elif shapes[key][0] != expected:
                errors.append(f"{folder}: tensor {key} is {list(shapes[key][0])}, the model's is {list(expected)}")
        if name in pieces:
            continue
        if name not in names:
            errors.append(f"parameter {name} has no checkpoint name (a mapping that does not match the model)")
            continue
        key, transposed = names[name]
        expected = tuple(param.shape[::-1] if transposed else param.shape)
        if key not in shapes:
            errors.append(f"{folder} lacks tensor {key}")
        elif shapes[key][0] != expected:
            errors.append(f"{folder}: tensor {key} is {list(shapes[key][0])}, the model's is {list(expected)}")
    used = {key for key, _ in names.values()} | {key for parts in pieces.values() for key, _ in parts}
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


def _piece_shape(shape: torch.Size, index: tuple) -> tuple[int, ...]:
    return tuple(torch.empty(shape, device="meta")[index].shape)


def _local_box(param: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...]]:
    """The rank's local tensor of ``param`` and where it starts in the whole one (0s for a plain tensor)."""
    if not isinstance(param, DTensor):
        return param.detach(), (0,) * param.ndim
    (chunk,) = param.__create_chunk_list__()  # DTensor's own account of its local shard, the one DCP plans reads by
    return param.to_local().detach(), tuple(chunk.offsets)


def piece_targets(name: str, param: torch.Tensor, pieces: Sequence[tuple[str, tuple]]) -> dict[str, torch.Tensor]:
    """checkpoint key -> the view of this rank's local shard of ``param`` it is read into, for the pieces the shard
    holds; the others are another rank's, and not read here. A piece the shard holds part of (a placement that cuts
    inside one expert's tensor) is refused: it would need a partial read."""
    local, offset = _local_box(param)
    targets = {}
    for key, index in pieces:
        box = [(i, i + 1) if isinstance(i, int) else i.indices(param.shape[d])[:2] for d, i in enumerate(index)]
        held = [(max(a, o), min(b, o + n)) for (a, b), o, n in zip(box, offset, local.shape, strict=False)]
        if any(a >= b for a, b in held):
            continue
        if held != box or local.shape[len(index) :] != param.shape[len(index) :]:
            raise CheckpointError(f"{name}: this rank's shard holds part of {key} only; its placement cuts inside one")
        starts = offset[: len(index)]  # the dims the index names
        local_index = tuple(
            i - o if isinstance(i, int) else slice(a - o, b - o)
            for i, (a, b), o in zip(index, box, starts, strict=True)
        )
        targets[key] = local[local_index]
    return targets


@torch.no_grad()
def load_hf_folder(
    model: nn.Module,
    folder: Path,
    names: Names,
    device: torch.device,
    ignored: tuple[str, ...] = (),
    keys: Callable[[str], bool] | None = None,
    pieces: Pieces | None = None,
) -> None:
    """Fill every parameter of ``model`` (plain, DDP or FSDP2-sharded; any world size; call on every rank) from the
    safetensors of ``folder``; refused in one line, the same on every rank, before any tensor is read if the folder
    does not fit (``fit_errors``), and after if the read fails. A parameter of ``pieces`` is read piece by piece,
    each rank reading only the pieces its shard holds (``piece_targets``)."""
    from torch.distributed.checkpoint import load as dcp_load

    error: BaseException | None = None
    try:
        if problems := fit_errors(model, folder, names, ignored, keys, pieces):
            raise CheckpointError(f"model.pretrained: {problems[0]}")
    except CheckpointError as e:
        error = e
    agreement.agree(error, f"model.pretrained: reading {folder}", device)
    state, pieces = {}, pieces or {}
    try:
        for name, p in _parameters(model, keys).items():
            if name in pieces:
                state |= piece_targets(name, p, pieces[name])
            else:
                state[names[name][0]] = _target(p, names[name][1])
    except CheckpointError as e:
        error = CheckpointError(f"model.pretrained: {e}")
    agreement.agree(error, f"model.pretrained: placing {folder}", device)
    try:
        dcp_load(state, storage_reader=folder_reader(folder))
    except (Exception, CheckpointException) as e:  # DCP wraps a rank's failure in CheckpointException, a BaseException
        error = CheckpointError(f"model.pretrained: {folder} could not be read ({first_cause(e)})")
    agreement.agree(error, f"model.pretrained: loading {folder}", device)


SAFETENSORS_TO_TORCH = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
}  # fmt: skip
"""The safetensors dtypes a model folder's tensors are read in."""


def folder_reader(folder: Path):
    """DCP's HuggingFaceStorageReader made to read exactly ``weight_files(folder)`` (its own read_metadata lists
    every ``*.safetensors`` of the folder: a stray file beside the index supplied weights, a FIFO of that name hung
    the load), each file checked again as a file right before safetensors opens it by name."""
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    class FolderReader(HuggingFaceStorageReader):
        def read_metadata(self) -> Metadata:
            state, storage = {}, {}
            for key, (file, shape, dtype) in tensor_files(weight_files(folder)).items():
                if dtype not in SAFETENSORS_TO_TORCH:
                    raise CheckpointError(f"{file}: tensor {key} is of dtype {dtype}, which shardlab does not read")
                size, origin = torch.Size(shape), torch.Size([0] * len(shape))
                properties = TensorProperties(dtype=SAFETENSORS_TO_TORCH[dtype])
                state[key] = TensorStorageMetadata(properties, size, [ChunkStorageMetadata(origin, size)])
                storage[MetadataIndex(key, origin)] = file
            metadata = Metadata(state_dict_metadata=state, storage_data=storage, storage_meta=StorageMeta())
            metadata.storage_meta.load_id = self.load_id  # as FileSystemReader does
            return metadata

        def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
            from safetensors import safe_open

            by_file: dict[Path, list[ReadItem]] = {}
            for item in plan.items:
                by_file.setdefault(self.storage_data[item.storage_index], []).append(item)
            for file, items in by_file.items():
                _as_files([file], folder)  # what the name is now, not what it was when the index was read
                with safe_open(str(file), framework="pt") as f:
                    for item in items:
                        self._process_read_request(f, item, planner)  # the slice of one tensor, into its target
            done: Future[None] = Future()
            done.set_result(None)
            return done

    return FolderReader(str(folder))


# ---- writing: a checkpoint's tensors as Hugging Face safetensors shards, one bounded buffer at a time ---------------
SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}
"""The dtypes an export writes, by their safetensors names."""


class ExportTensor(NamedTuple):
    key: str
    """Its name in the Hugging Face checkpoint."""
    source: str
    """Its name where it is read from (the step folder's, without the DCP prefix)."""
    shape: tuple[int, ...]
    """Its shape as stored in the source (the written one is the transpose when ``transposed``); of the piece, for
    one with an ``index``."""
    transposed: bool = False
    index: tuple = ()
    """Where in the source tensor it lies, ``source[index]`` (a piece of it: one expert of an MoE block's grouped
    experts); () for the whole tensor."""


Reader = Callable[[list[str]], dict[str, torch.Tensor]]
"""Reads the named source tensors, whole, on the CPU: the only tensors an export holds at a time."""


def shard_plan(tensors: list[ExportTensor], dtype: torch.dtype, max_shard_bytes: int) -> list[list[ExportTensor]]:
    """The tensors split, in order, into files of at most ``max_shard_bytes`` (a larger tensor gets a file alone)."""
    files: list[list[ExportTensor]] = [[]]
    size = 0
    for tensor in tensors:
        nbytes = math.prod(tensor.shape) * dtype.itemsize
        if files[-1] and size + nbytes > max_shard_bytes:
            files.append([])
            size = 0
        files[-1].append(tensor)
        size += nbytes
    return files


def write_shards(
    tensors: list[ExportTensor],
    read: Reader,
    out: Path,
    dtype: torch.dtype,
    max_shard_bytes: int,
    buffer_bytes: int,
) -> dict[str, Any]:
    """Write ``tensors`` into ``out`` as ``model-0000i-of-0000n.safetensors`` files and their
    ``model.safetensors.index.json``; returns the index. Each file's header is written from the shapes first, then
    its tensors are read (``read``) a group of at most ``buffer_bytes`` at a time (one tensor when larger), converted
    and appended: a process never holds more than one group, whatever the model's size."""
    files = shard_plan(tensors, dtype, max_shard_bytes)
    weight_map, total = {}, 0
    for i, group in enumerate(files, start=1):
        name = f"model-{i:05d}-of-{len(files):05d}.safetensors"
        total += _write_file(out / name, group, read, dtype, buffer_bytes)
        weight_map |= {t.key: name for t in group}
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / INDEX_FILE).write_text(json.dumps(index, indent=2))
    return index


def _write_file(path: Path, tensors: list[ExportTensor], read: Reader, dtype: torch.dtype, buffer_bytes: int) -> int:
    """One safetensors file (header, then each tensor's bytes in order); returns the bytes of its tensors."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for t in tensors:
        nbytes = math.prod(t.shape) * dtype.itemsize
        shape = list(t.shape[::-1] if t.transposed else t.shape)
        header[t.key] = {"dtype": SAFETENSORS_DTYPES[dtype], "shape": shape, "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # safetensors aligns the data to 8 bytes, padding the header with spaces
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(encoded)))
        f.write(encoded)
        for group in _groups(tensors, buffer_bytes):
            state = read(list(dict.fromkeys(t.source for t in group)))  # a source read once for all its pieces
            for t in group:
                tensor = state[t.source][t.index]
                tensor = (tensor.t() if t.transposed else tensor).to(dtype).contiguous()
                if tuple(tensor.shape[::-1] if t.transposed else tensor.shape) != t.shape:
                    raise CheckpointError(f"{t.source} read as {list(tensor.shape)}, expected {list(t.shape)}")
                f.write(tensor.reshape(-1).view(torch.uint8).numpy().data)
                del tensor
            del state
    return offset


def _groups(tensors: list[ExportTensor], budget: int) -> list[list[ExportTensor]]:
    """Consecutive tensors in groups of at most ``budget`` bytes as stored in fp32 (one tensor when larger); the
    consecutive pieces of one source stay in one group, so the source is read once for them all."""
    runs: list[list[ExportTensor]] = []
    for tensor in tensors:
        if runs and tensor.index and runs[-1][-1].source == tensor.source:
            runs[-1].append(tensor)
        else:
            runs.append([tensor])
    groups: list[list[ExportTensor]] = [[]]
    size = 0
    for run in runs:
        nbytes = sum(math.prod(t.shape) for t in run) * torch.float32.itemsize
        if groups[-1] and size + nbytes > budget:
            groups.append([])
            size = 0
        groups[-1] += run
        size += nbytes
    return groups


def read_tensors(file: Path, keys: list[str], folder: Path | None = None) -> dict[str, torch.Tensor]:
    """The tensors ``keys`` of the safetensors ``file``, each read alone; the file checked again first as one of
    ``folder``'s (``_as_files``) when given. Any failure is one CheckpointError line naming the file."""
    from safetensors import safe_open

    if folder is not None:
        _as_files([file], folder)
    try:
        with safe_open(str(file), framework="pt") as f:
            return {key: f.get_tensor(key) for key in keys}
    except Exception as e:  # safetensors' own errors have no common type
        raise CheckpointError(f"{file} could not be read ({first_cause(e)})") from None


class _IndexReadOnce(SafeReader):
    """dcp_reader's SafeReader given the step folder's index, read and checked once for all the groups an export
    reads: unpickling a checkpoint's .metadata (0.3 s for a 50 MB model's, more with its size) costs more than
    reading a group's bytes."""

    def __init__(self, step: Path, metadata: Metadata) -> None:
        super().__init__(str(step))
        self.metadata = metadata

    def read_metadata(self, *args: Any) -> Metadata:
        if self.metadata.storage_meta is None:
            self.metadata.storage_meta = StorageMeta()
        self.metadata.storage_meta.load_id = self.load_id  # as FileSystemReader does
        return self.metadata


def step_folder_reader(step: Path, prefixes: tuple[str, ...] = ("model.",)) -> tuple[dict[str, tuple], Reader]:
    """The tensors of DCP step folder ``step`` by name (the first of ``prefixes`` under which each is stored wins:
    ("ema.", "model.") reads the average where there is one), as {name: shape}, and a Reader of them that loads only
    the entries asked for (DCP reads each chunk's bytes from its file, never a whole file)."""
    metadata = dcp_reader.read_metadata(step)
    entries = metadata.state_dict_metadata
    stored: dict[str, tuple[str, Any]] = {}
    for prefix in reversed(prefixes):  # the first prefix written last, so it wins
        for key, item in entries.items():
            if key.startswith(prefix) and isinstance(item, TensorStorageMetadata):
                stored[key.removeprefix(prefix)] = (prefix, item)

    def read(names: list[str]) -> dict[str, torch.Tensor]:
        state: dict[str, dict[str, torch.Tensor]] = {}
        for name in names:
            prefix, item = stored[name]
            state.setdefault(prefix.rstrip("."), {})[name] = torch.empty(item.size, dtype=item.properties.dtype)
        planner = SafeLoadPlanner(step)
        try:
            dcp.load(state, storage_reader=_IndexReadOnce(step, metadata), planner=planner, no_dist=True)
        except (Exception, CheckpointException) as e:  # DCP wraps every failure in its own (Base)Exception types
            raise CheckpointError(f"checkpoint {step} could not be read ({first_cause(e)})") from None
        finally:
            # DCP's load leaves the planner, which holds the state it filled, in reference cycles: left there, each
            # group's tensors would stay alive until Python's cyclic GC happens to run, and the groups pile up.
            planner.state_dict = planner.original_state_dict = {}
        return {name: tensor for part in state.values() for name, tensor in part.items()}

    return {name: tuple(item.size) for name, (_, item) in stored.items()}, read


def safetensors_reader(file: Path) -> tuple[dict[str, tuple], Reader]:
    """The tensors of one safetensors file (shardlab-consolidate's) by name, as {name: shape}, and a Reader of them
    that reads each tensor alone."""
    files = [file]
    shapes = {key: shape for key, (shape, _) in tensor_shapes(files).items()}

    def read(names: list[str]) -> dict[str, torch.Tensor]:
        return read_tensors(file, names)

    return shapes, read
