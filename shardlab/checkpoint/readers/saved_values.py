"""What DCP stores inside its shard files, read without ``torch.load``: each tensor chunk and each small value
(an optimizer's learning rate, betas, parameter names) is a ``torch.save`` archive, a zip holding ``data.pkl`` and the
tensors' raw bytes.

torch's own reader (``torch.load(weights_only=True)``, which DCP uses for tensors and shardlab used for values) hashes
whatever a dict key is: a 132-byte value whose key is a tuple nested 60 deep, each level sharing its halves, takes
2**60 steps to hash, and every reader of the checkpoint hung on it (issue 41). It also sets attributes through BUILD
on the objects it admits (a safe-global Enum member, for the whole process). So the pickle goes through
``ValueUnpickler``, dcp_reader's MetadataUnpickler taught the few opcodes and globals ``torch.save`` writes: keys are
only strings or ints, nothing is built but plain values, an OrderedDict and a tensor, and a tensor is a view whose
shape, strides and offset are checked against its bytes before it exists. What it returns is then walked once with a
budget, so a structure that shares its parts cannot cost more than its bytes to anyone who walks it later.
"""

from __future__ import annotations

import io
import math
import pickle
import struct
import zipfile
from collections import OrderedDict
from typing import Any

import torch

from shardlab.checkpoint.readers.metadata_pickle import MetadataUnpickler, _shown, _Unreadable
from shardlab.errors import CheckpointError, UnsafeCheckpointError

VALUE_MAX_BYTES = 64 * 2**20
"""A pickled value (hyper-parameters, a list of parameter names) larger than this is no value DCP writes."""
MAX_DEPTH = 32
"""Containers nested deeper than this in a value: no optimizer or task state nests so."""
MAX_NODES = 1_000_000
"""Elements a value may expand to, counting shared parts at every place they appear: a bound on anyone who walks it."""

STORAGE_DTYPES = {
    "torch.FloatStorage": torch.float32,
    "torch.DoubleStorage": torch.float64,
    "torch.HalfStorage": torch.float16,
    "torch.BFloat16Storage": torch.bfloat16,
    "torch.LongStorage": torch.int64,
    "torch.IntStorage": torch.int32,
    "torch.ShortStorage": torch.int16,
    "torch.CharStorage": torch.int8,
    "torch.ByteStorage": torch.uint8,
    "torch.BoolStorage": torch.bool,
    "torch.ComplexFloatStorage": torch.complex64,
    "torch.ComplexDoubleStorage": torch.complex128,
}
"""The storage classes torch.save names a tensor's bytes by, and the dtype each holds."""


class _StorageType:
    """A storage class named by the file: only a dtype, never the class itself."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype


class _Storage:
    """A storage the file's persistent id loaded: a flat tensor over the archive's bytes."""

    def __init__(self, flat: torch.Tensor) -> None:
        self.flat = flat


def _rebuild_tensor() -> None:
    """Stands for torch._utils._rebuild_tensor_v2 in the file's pickle; ValueUnpickler.reduce does its work."""


VALUE_GLOBALS: dict[str, Any] = {
    "collections.OrderedDict": OrderedDict,
    "torch.Size": torch.Size,
    "torch._utils._rebuild_tensor_v2": _rebuild_tensor,
    **{name: _StorageType(dtype) for name, dtype in STORAGE_DTYPES.items()},
}
"""Every global a torch.save of DCP's values and tensors names."""


class _Archive:
    """The members of a torch.save zip, each a view of ``buffer`` (nothing copied): stored (uncompressed) members
    under one prefix, as torch writes them."""

    def __init__(self, buffer: bytearray | bytes, label: str) -> None:
        self.buffer, self.label = buffer, label
        view = memoryview(buffer)
        try:
            infos = zipfile.ZipFile(_ViewFile(view)).infolist()
        except (zipfile.BadZipFile, ValueError, OSError, EOFError) as e:
            raise CheckpointError(f"{label} is no torch.save archive ({e})") from None
        self.members: dict[str, tuple[int, int]] = {}  # name -> (start, size) in buffer
        for info in infos:
            if info.compress_type != zipfile.ZIP_STORED or info.compress_size != info.file_size:
                raise _refused(label, f"compresses its member {_shown(info.filename)}, which torch.save never does")
            start = info.header_offset + 30
            if start > len(view):
                raise CheckpointError(f"{label} is no torch.save archive (a member past its end)")
            name_len, extra_len = struct.unpack("<HH", view[start - 4 : start])
            start += name_len + extra_len
            if start + info.file_size > len(view):
                raise CheckpointError(f"{label} is no torch.save archive (a member past its end)")
            self.members[info.filename] = (start, info.file_size)
        pickles = [name for name in self.members if name.endswith("/data.pkl") and name.count("/") == 1]
        if len(pickles) != 1:
            raise CheckpointError(f"{label} is no torch.save archive (no data.pkl)")
        self.prefix = pickles[0].removesuffix("data.pkl")
        order = self.read(self.prefix + "byteorder")
        if order is not None and order != b"little":
            raise _refused(label, f"is saved in byte order {_shown(order[:16].decode('latin-1'))}")

    def read(self, name: str) -> bytes | None:
        if name not in self.members:
            return None
        start, size = self.members[name]
        return bytes(memoryview(self.buffer)[start : start + size])

    def storage(self, key: str, dtype: torch.dtype, numel: int) -> torch.Tensor:
        start, size = self.members.get(f"{self.prefix}data/{key}", (0, -1))
        if size != numel * dtype.itemsize:
            raise _refused(self.label, f"names a storage {_shown(key)} of {numel} elements its archive does not hold")
        if numel == 0:
            return torch.empty(0, dtype=dtype)
        return torch.frombuffer(self.buffer, dtype=dtype, count=numel, offset=start)


class _ViewFile(io.RawIOBase):
    """A read-only file over a memoryview, for zipfile to find the members in (it reads only the directory)."""

    def __init__(self, view: memoryview) -> None:
        self.view, self.pos = view, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, pos: int, whence: int = 0) -> int:
        self.pos = max(0, [pos, self.pos + pos, len(self.view) + pos][whence])
        return self.pos

    def tell(self) -> int:
        return self.pos

    def readinto(self, b) -> int:
        n = max(0, min(len(b), len(self.view) - self.pos))
        b[:n] = self.view[self.pos : self.pos + n]
        self.pos += n
        return n


class ValueUnpickler(MetadataUnpickler):
    """MetadataUnpickler for the pickle in a torch.save archive: plain values (None, bools, ints, floats, strings,
    bytes, tuples, lists, dicts keyed by strings or ints, OrderedDict), torch.Size and tensors over the archive's own
    storages. No NEWOBJ and no BUILD: no object is created empty and then filled."""

    def __init__(self, data: bytes, label: str, archive: _Archive) -> None:
        super().__init__(data, label)  # type: ignore[arg-type]  (a label, not a path, in its messages)
        self.archive = archive
        self.ops[pickle.BINFLOAT[0]] = lambda: self.stack.append(struct.unpack(">d", self.read(8))[0])
        self.ops[pickle.SHORT_BINBYTES[0]] = lambda: self.stack.append(self.read(self.read(1)[0]))
        self.ops[pickle.BINBYTES[0]] = lambda: self.stack.append(self.read(struct.unpack("<I", self.read(4))[0]))
        self.ops[pickle.BINPERSID[0]] = self.persistent
        for refused in (pickle.NEWOBJ, pickle.BUILD):
            del self.ops[refused[0]]

    def refuse(self, what: str) -> UnsafeCheckpointError:
        return _refused(str(self.source), what)

    def key(self, key: Any) -> Any:
        if type(key) in (str, int):
            return key
        raise self.refuse(f"uses {_shown(key)} as a dict key")

    def find(self, module: Any, name: Any) -> None:
        found = VALUE_GLOBALS.get(f"{module}.{name}") if type(module) is str and type(name) is str else None
        if found is None:
            shown = f"{module}.{name}" if type(module) is str and type(name) is str else ""
            raise self.refuse(f"names {shown if shown.isprintable() else 'a global that is no name'}")
        self.stack.append(found)

    def persistent(self) -> None:
        pid = self.stack.pop()
        if not (
            type(pid) is tuple
            and len(pid) == 5
            and pid[0] == "storage"
            and type(pid[1]) is _StorageType
            and type(pid[2]) is str
            and type(pid[3]) is str
            and type(pid[4]) is int
            and pid[4] >= 0
        ):
            raise self.refuse(f"loads the persistent id {_shown(pid)}")
        self.stack.append(_Storage(self.archive.storage(pid[2], pid[1].dtype, pid[4])))

    def reduce(self) -> None:
        func, args = self.popn(2)
        if type(args) is not tuple:
            raise self.refuse(f"calls {self.describe(func)} with {_shown(args)}")
        if func is OrderedDict and not args:
            self.stack.append(self.make(OrderedDict()))
        elif func is torch.Size and len(args) == 1 and _ints(args[0]):
            self.stack.append(torch.Size(args[0]))
        elif func is _rebuild_tensor:
            self.stack.append(self.tensor(args))
        else:
            raise self.refuse(f"calls {self.describe(func)}")

    def tensor(self, args: tuple) -> torch.Tensor:
        """torch._utils._rebuild_tensor_v2's tensor, once its view is checked to lie inside its storage."""
        if not (6 <= len(args) <= 7 and type(args[0]) is _Storage and type(args[1]) is int):
            raise self.refuse("rebuilds a tensor from arguments torch.save never writes")
        storage, offset, size, stride, requires_grad, hooks = args[:6]
        extra = args[6] if len(args) == 7 else None
        if not (_ints(size) and _ints(stride) and len(size) == len(stride) and type(requires_grad) is bool):
            raise self.refuse(f"rebuilds a tensor of shape {_shown(size)} and strides {_shown(stride)}")
        if type(hooks) is not OrderedDict or hooks or extra not in (None, {}):
            raise self.refuse("rebuilds a tensor with hooks or metadata")
        if offset < 0 or any(n < 0 for n in size) or any(s < 0 for s in stride):
            raise self.refuse(f"rebuilds a tensor of shape {list(size)}, strides {list(stride)} at offset {offset}")
        numel = storage.flat.numel()
        if math.prod(size) and offset + sum((n - 1) * s for n, s in zip(size, stride, strict=True)) >= numel:
            raise self.refuse(f"rebuilds a tensor of shape {list(size)} and strides {list(stride)} past its storage")
        if not math.prod(size) and offset > numel:
            raise self.refuse(f"rebuilds a tensor at offset {offset} past its storage of {numel}")
        return torch.as_strided(storage.flat, tuple(size), tuple(stride), offset)


def _ints(value: Any) -> bool:
    return type(value) in (tuple, list, torch.Size) and len(value) <= 64 and all(type(n) is int for n in value)


def _refused(label: str, what: str) -> UnsafeCheckpointError:
    return UnsafeCheckpointError(
        f"{label} {what}, which DCP never writes: refused without running it (a crafted or foreign file); load "
        "checkpoints only from sources you trust"
    )


def _bounded(value: Any, label: str) -> None:
    """Refuse a value deeper than MAX_DEPTH or expanding to more than MAX_NODES elements (shared parts counted at each
    place they appear): whoever walks, copies or prints it later does at most that much work."""
    todo, nodes = [(value, 0)], 0
    while todo:
        obj, depth = todo.pop()
        nodes += 1
        if depth > MAX_DEPTH:
            raise _refused(label, f"is a structure nested deeper than {MAX_DEPTH}")
        if nodes > MAX_NODES:
            raise _refused(label, f"is a structure of more than {MAX_NODES} elements (counting shared parts)")
        if type(obj) in (tuple, list):
            todo.extend((item, depth + 1) for item in obj)
        elif type(obj) in (dict, OrderedDict):
            todo.extend((item, depth + 1) for item in obj.values())


def read_saved(buffer: bytearray | bytes, label: str) -> Any:
    """The object a torch.save archive in ``buffer`` holds (tensors are views of ``buffer``: keep it alive and do not
    reuse it); UnsafeCheckpointError for what torch.save of a value or tensor never writes, CheckpointError if it is
    no archive. ``label`` names the entry in messages ("<step folder>: its entry <fqn>")."""
    archive = _Archive(buffer, label)
    try:
        value = ValueUnpickler(archive.read(archive.prefix + "data.pkl") or b"", label, archive).load()
    except _Unreadable as e:
        raise CheckpointError(f"{label} is unreadable ({e})") from None
    _bounded(value, label)
    return value


def read_value(data: bytes, label: str) -> Any:
    """A small value DCP pickled beside the tensors, at most VALUE_MAX_BYTES long."""
    if len(data) > VALUE_MAX_BYTES:
        raise _refused(label, f"is a value of {len(data)} bytes (more than {VALUE_MAX_BYTES})")
    return read_saved(bytearray(data), label)  # writable: a tensor in it is a view, as in read_tensor


def read_tensor(buffer: bytearray, label: str) -> torch.Tensor:
    """The tensor chunk DCP saved in ``buffer`` (a view of it)."""
    tensor = read_saved(buffer, label)
    if type(tensor) is not torch.Tensor:
        raise _refused(label, f"holds {_shown(tensor)} where a tensor belongs")
    return tensor
