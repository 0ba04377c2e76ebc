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
here: resume (checkpoint.manager, checkpoint.resume), ``init_from`` and the tools (checkpoint.weights: generate,
consolidate, export_hf, evaluate).
"""

from __future__ import annotations

import io
import json
import math
import os
import pickle
import pickletools
import stat
import struct
import types
from collections import OrderedDict
from pathlib import Path, PosixPath, PurePosixPath
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    _MEM_FORMAT_ENCODING,
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from shardlab.checkpoint.regular_file import describe_os_error, open_regular, read_at, read_into, read_regular
from shardlab.errors import CheckpointError, UnsafeCheckpointError
from shardlab.train_state import nonfinite

METADATA_FILE = ".metadata"
"""The name DCP's FileSystemWriter gives the index (tests/unit/test_dcp_reader.py checks torch still writes it)."""

METADATA_CLASSES: tuple[type, ...] = (
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorStorageMetadata,
    BytesStorageMetadata,
    ChunkStorageMetadata,
    TensorProperties,
    _StorageInfo,  # where each entry lies in a shard file
)
"""The dataclasses DCP pickles into ``.metadata``: the only objects a file may create empty and then fill (NEWOBJ,
BUILD), and only the ones it created itself."""

_NONE = type(None)
FIELD_TYPES: dict[type, dict[str, tuple[type, ...]]] = {
    Metadata: {
        "state_dict_metadata": (dict,),
        "planner_data": (dict, _NONE),
        "storage_data": (dict,),
        "storage_meta": (StorageMeta, _NONE),
        "version": (str, _NONE),
    },
    MetadataIndex: {"fqn": (str,), "offset": (torch.Size, _NONE), "index": (int, _NONE)},
    StorageMeta: {
        "checkpoint_id": (str, PosixPath, PurePosixPath, _NONE),
        "save_id": (str, _NONE),
        "load_id": (str, _NONE),
        "modules": (list,),
    },
    TensorStorageMetadata: {"properties": (TensorProperties,), "size": (torch.Size,), "chunks": (list,)},
    BytesStorageMetadata: {},
    ChunkStorageMetadata: {"offsets": (torch.Size,), "sizes": (torch.Size,)},
    TensorProperties: {
        "dtype": (torch.dtype,),
        "layout": (torch.layout,),
        "requires_grad": (bool,),
        "memory_format": (torch.memory_format,),
        "pin_memory": (bool,),
    },
    _StorageInfo: {
        "relative_path": (str,),
        "offset": (int,),
        "length": (int,),
        "transform_descriptors": (list, tuple, _NONE),
    },
}
"""The exact type of every field of each metadata class, as DCP writes them: checked when a file fills an object
(BUILD) and again, all the way down, once it is read."""

CALLABLES: tuple[Any, ...] = (
    torch.Size,
    PosixPath,  # StorageMeta.checkpoint_id
    PurePosixPath,
    torch.serialization._get_layout,  # how torch.layout pickles: a lookup by name
    _MEM_FORMAT_ENCODING,  # an Enum TensorProperties pickles its memory format as: a lookup by value
    OrderedDict,
)
"""What a file may call (REDUCE): constructors of plain values and lookups by name, none of which runs code an
attacker chose or changes anything outside the object it returns."""


def _ints(args: tuple) -> bool:
    return len(args) == 1 and type(args[0]) in (list, tuple) and all(type(n) is int for n in args[0])


ARGUMENTS: dict[Any, Any] = {
    torch.Size: _ints,
    PosixPath: lambda args: all(type(a) is str for a in args),
    PurePosixPath: lambda args: all(type(a) is str for a in args),
    torch.serialization._get_layout: lambda args: len(args) == 1 and type(args[0]) is str,
    _MEM_FORMAT_ENCODING: lambda args: len(args) == 1 and type(args[0]) is int,
    OrderedDict: lambda args: not args,  # filled by SETITEMS afterwards
}
"""The arguments each of CALLABLES may be called with, by exact type: only strings and ints are ever hashed or
compared (a tuple that shares its parts can take 2**60 steps to hash or print)."""

GLOBALS: dict[str, Any] = {
    **{f"{o.__module__}.{o.__qualname__}": o for o in (*METADATA_CLASSES, *CALLABLES)},
    "pathlib.PosixPath": PosixPath,  # the module these classes pickle under up to Python 3.12 ...
    "pathlib.PurePosixPath": PurePosixPath,
    "pathlib._local.PosixPath": PosixPath,  # ... and from 3.13
    "pathlib._local.PurePosixPath": PurePosixPath,
    **{f"torch.{name}": value for name, value in vars(torch).items() if isinstance(value, torch.dtype)},
}
"""Every global a DCP .metadata file names, by the name it pickles under. A fixed table, built at import: reading a
file never imports a module or looks up an attribute by a name the file gives."""

_OPCODE_NAMES = {op.code.encode("latin-1")[0]: op.name for op in pickletools.opcodes}
_METADATA_CLASS_BY_ID = {id(c): c for c in METADATA_CLASSES}
_ARGUMENTS_BY_ID = {id(func): (func, check) for func, check in ARGUMENTS.items()}
"""By id, so that finding what the file names costs one lookup, and never hashes an object the file made."""


def _is_metadata_class(obj: Any) -> bool:
    return _METADATA_CLASS_BY_ID.get(id(obj)) is obj


class _Unreadable(Exception):
    """The bytes are no pickle this reader can follow (truncated, garbled): unreadable, not unsafe."""


class MetadataUnpickler:
    """The pickle opcodes DCP's ``.metadata`` uses (protocol 2 to 5), interpreted one by one with each object's
    origin tracked, so that nothing outside the objects this file created can change.

    Why not torch's own: ``torch.load(weights_only=True)`` expects torch.save's container around the pickle, and
    the unpickler under it (``torch._weights_only_unpickler``, private) knows only the protocol-2 opcodes torch.save
    writes, while DCP writes .metadata with ``pickle.dump`` at the default protocol (FRAME, MEMOIZE, STACK_GLOBAL):
    it refuses every DCP checkpoint (tests/unit/test_dcp_reader.py checks that torch still does, so that this reader
    is replaced when torch's can read the file). Python's ``pickle.Unpickler`` filters only ``find_class``: its BUILD
    sets attributes on whatever is on the stack, an allowed class or function included, which rewires them for the
    whole process (``GLOBAL pathlib.PurePosixPath; BUILD {'_str': ...}`` turns every path into the attacker's).

    Here: a global is looked up in GLOBALS only; REDUCE calls only CALLABLES, with the argument types ARGUMENTS
    gives; NEWOBJ creates only METADATA_CLASSES; BUILD fills only an object of METADATA_CLASSES that this file
    created, with its own fields of the types FIELD_TYPES gives; SETITEM and APPEND change only dicts and lists this
    file created, keyed by strings, ints or a filled MetadataIndex. So nothing runs code, nothing outside the file's
    own objects changes, and nothing is hashed or compared that costs more than its bytes. Any other opcode is
    refused (INST, OBJ, EXT, PERSID, ...)."""

    def __init__(self, data: bytes, source: Path) -> None:
        self.data, self.pos, self.source = data, 0, source
        self.stack: list[Any] = []
        self.metastack: list[list[Any]] = []
        self.memo: dict[int, Any] = {}
        self.made: dict[int, Any] = {}  # id -> object, for the objects this file created (kept alive: ids stay unique)
        self.built: set[int] = set()  # ids of made objects whose fields BUILD checked
        ops = {
            pickle.PROTO: self.proto,
            pickle.FRAME: lambda: self.read(8),  # frames are contiguous in the stream: only a buffering hint
            pickle.MARK: self.mark,
            pickle.NONE: lambda: self.stack.append(None),
            pickle.NEWTRUE: lambda: self.stack.append(True),
            pickle.NEWFALSE: lambda: self.stack.append(False),
            pickle.BININT: lambda: self.stack.append(struct.unpack("<i", self.read(4))[0]),
            pickle.BININT1: lambda: self.stack.append(self.read(1)[0]),
            pickle.BININT2: lambda: self.stack.append(struct.unpack("<H", self.read(2))[0]),
            pickle.LONG1: lambda: self.stack.append(int.from_bytes(self.read(self.read(1)[0]), "little", signed=True)),
            pickle.SHORT_BINUNICODE: lambda: self.text(self.read(1)[0]),
            pickle.BINUNICODE: lambda: self.text(struct.unpack("<I", self.read(4))[0]),
            pickle.BINUNICODE8: lambda: self.text(struct.unpack("<Q", self.read(8))[0]),
            pickle.EMPTY_TUPLE: lambda: self.stack.append(()),
            pickle.TUPLE1: lambda: self.stack.append((self.stack.pop(),)),
            pickle.TUPLE2: lambda: self.stack.append(tuple(self.popn(2))),
            pickle.TUPLE3: lambda: self.stack.append(tuple(self.popn(3))),
            pickle.TUPLE: self.load_tuple,
            pickle.EMPTY_LIST: lambda: self.stack.append(self.make([])),
            pickle.EMPTY_DICT: lambda: self.stack.append(self.make({})),
            pickle.APPEND: self.load_append,
            pickle.APPENDS: self.appends,
            pickle.SETITEM: self.setitem,
            pickle.SETITEMS: self.setitems,
            pickle.MEMOIZE: lambda: self.memo.__setitem__(len(self.memo), self.stack[-1]),
            pickle.BINPUT: lambda: self.memo.__setitem__(self.read(1)[0], self.stack[-1]),
            pickle.LONG_BINPUT: lambda: self.memo.__setitem__(struct.unpack("<I", self.read(4))[0], self.stack[-1]),
            pickle.BINGET: lambda: self.stack.append(self.memo[self.read(1)[0]]),
            pickle.LONG_BINGET: lambda: self.stack.append(self.memo[struct.unpack("<I", self.read(4))[0]]),
            pickle.GLOBAL: self.global_by_line,
            pickle.STACK_GLOBAL: self.stack_global,
            pickle.NEWOBJ: self.newobj,
            pickle.REDUCE: self.reduce,
            pickle.BUILD: self.build,
        }
        self.ops = {code[0]: op for code, op in ops.items()}

    def load(self) -> Any:
        """The unpickled object; UnsafeCheckpointError for what DCP never writes, CheckpointError if unreadable."""
        data, ops, stop = self.data, self.ops, pickle.STOP[0]
        try:
            while True:  # the opcode read inline: this loop runs once per opcode (a million for 8,000 chunks)
                if self.pos >= len(data):
                    raise _Unreadable(f"cut short at byte {len(data)}")
                code = data[self.pos]
                self.pos += 1
                if code == stop:
                    return self.stack.pop()
                op = ops.get(code)
                if op is None:
                    if code in _OPCODE_NAMES:
                        raise self.refuse(f"uses the pickle opcode {_OPCODE_NAMES[code]}")
                    raise _Unreadable(f"byte {self.pos - 1} is no pickle opcode ({code:#04x})")
                op()
        except (CheckpointError, _Unreadable):
            raise
        except Exception as e:  # noqa: BLE001  (a stack or memo underflow, a bad argument to a constructor, ...)
            raise _Unreadable(f"{type(e).__name__}: {' '.join(str(e)[:200].split())}") from None

    def refuse(self, what: str) -> UnsafeCheckpointError:
        return UnsafeCheckpointError(
            f"{self.source} {what}, which DCP checkpoint metadata never holds: refused without running it (a crafted "
            "or foreign file); load checkpoints only from sources you trust"
        )

    def read(self, n: int) -> bytes:
        if self.pos + n > len(self.data):
            raise _Unreadable(f"cut short at byte {len(self.data)}")
        self.pos += n
        return self.data[self.pos - n : self.pos]

    def proto(self) -> None:
        if not 2 <= self.read(1)[0] <= pickle.HIGHEST_PROTOCOL:
            raise _Unreadable("an unknown pickle protocol")

    def text(self, n: int) -> None:
        self.stack.append(str(self.read(n), "utf-8", "surrogatepass"))

    def make(self, obj: Any) -> Any:
        self.made[id(obj)] = obj
        return obj

    def mark(self) -> None:
        self.metastack.append(self.stack)
        self.stack = []

    def pop_mark(self) -> list[Any]:
        items, self.stack = self.stack, self.metastack.pop()
        return items

    def popn(self, n: int) -> list[Any]:
        if len(self.stack) < n:
            raise _Unreadable("a stack underflow")
        items = self.stack[-n:]
        del self.stack[-n:]
        return items

    def target(self, *kinds: type) -> Any:
        """The object on the stack a SETITEM or APPEND changes: only a dict or list this file created."""
        obj = self.stack[-1]
        if type(obj) not in kinds or id(obj) not in self.made:
            raise self.refuse(f"would change {self.describe(obj)}")
        return obj

    def load_tuple(self) -> None:
        items = self.pop_mark()  # first: it changes which list self.stack is
        self.stack.append(tuple(items))

    def load_append(self) -> None:
        item = self.stack.pop()
        self.target(list).append(item)

    def appends(self) -> None:
        items = self.pop_mark()
        self.target(list).extend(items)

    def key(self, key: Any) -> Any:
        """A dict key: a string, an int or a MetadataIndex whose fields BUILD checked (hashing runs no code and
        takes time linear in the file)."""
        if type(key) in (str, int) or (type(key) is MetadataIndex and id(key) in self.built):
            return key
        raise self.refuse(f"uses {_shown(key)} as a key")

    def setitem(self) -> None:
        value, key = self.stack.pop(), self.stack.pop()
        self.target(dict, OrderedDict)[self.key(key)] = value

    def setitems(self) -> None:
        items = self.pop_mark()
        target = self.target(dict, OrderedDict)
        if len(items) % 2:
            raise _Unreadable("SETITEMS with an odd number of items")
        for i in range(0, len(items), 2):
            target[self.key(items[i])] = items[i + 1]

    def find(self, module: Any, name: Any) -> None:
        found = GLOBALS.get(f"{module}.{name}") if isinstance(module, str) and isinstance(name, str) else None
        if found is None:
            shown = f"{module}.{name}" if isinstance(module, str) and isinstance(name, str) else ""
            raise self.refuse(f"refers to {shown if shown.isprintable() else _shown(module) + '.' + _shown(name)}")
        self.stack.append(found)

    def global_by_line(self) -> None:
        lines = []
        for _ in range(2):
            end = self.data.find(b"\n", self.pos)
            if end < 0:
                raise _Unreadable("a GLOBAL without its names")
            lines.append(self.read(end + 1 - self.pos)[:-1].decode("utf-8"))
        self.find(*lines)

    def stack_global(self) -> None:
        module, name = self.popn(2)
        self.find(module, name)

    def newobj(self) -> None:
        cls, args = self.popn(2)
        if not _is_metadata_class(cls) or type(args) is not tuple or args:
            raise self.refuse(f"creates {self.describe(cls)} by NEWOBJ")
        self.stack.append(self.make(cls.__new__(cls)))

    def reduce(self) -> None:
        func, args = self.popn(2)
        allowed, takes = _ARGUMENTS_BY_ID.get(id(func), (None, None))
        takes = takes if allowed is func else None
        if takes is None or type(args) is not tuple:
            raise self.refuse(f"calls {self.describe(func)}")
        if not takes(args):
            raise self.refuse(f"calls {self.describe(func)} with {_shown(args)} of {[_shown(a) for a in args[:3]]}")
        result = func(*args)
        if type(result) is OrderedDict:
            self.make(result)
        self.stack.append(result)

    def build(self) -> None:
        """Fill an object this file created: TensorProperties through its own ``__setstate__`` (a 5-tuple), the
        other dataclasses with a dict of their own field names. Never a class, function or module, never an object
        that existed before (a dtype, an Enum member, a layout): that would change it for the whole process."""
        state = self.stack.pop()
        inst = self.stack[-1]
        cls = type(inst)
        if id(inst) not in self.made or not _is_metadata_class(cls):
            raise self.refuse(f"would set attributes of {self.describe(inst)}")
        if cls is TensorProperties:
            if type(state) is not tuple or len(state) != 5 or type(state[3]) is not _MEM_FORMAT_ENCODING:
                raise self.refuse(f"gives a TensorProperties the state {_shown(state)}")
            inst.__setstate__(state)
        elif type(state) is dict and all(type(k) is str and k in FIELD_TYPES[cls] for k in state):
            vars(inst).update(state)
        else:
            raise self.refuse(f"gives a {cls.__name__} the state {_shown(state)}")
        if defect := _fields_defect(inst):
            raise self.refuse(f"makes {defect}")
        self.built.add(id(inst))

    @staticmethod
    def describe(obj: Any) -> str:
        if isinstance(obj, type):
            return f"the class {obj.__module__}.{obj.__qualname__}"
        if isinstance(obj, types.ModuleType):
            return f"the module {obj.__name__}"
        if callable(obj) and hasattr(obj, "__qualname__"):
            return f"the function {getattr(obj, '__module__', '?')}.{obj.__qualname__}"
        return f"a {type(obj).__name__} it did not create"


def unpickle_metadata(data: bytes, source: Path) -> Metadata:
    """``data`` (a .metadata file's bytes) as DCP Metadata, every field of the type DCP writes; CheckpointError if it
    does not unpickle, UnsafeCheckpointError if it holds what DCP never writes."""
    try:
        metadata = MetadataUnpickler(data, source).load()
    except _Unreadable as e:
        raise CheckpointError(f"{source} is unreadable ({e})") from None
    if type(metadata) is not Metadata:
        raise CheckpointError(f"{source} holds a {type(metadata).__name__}, not DCP metadata")
    if problem := _structure_defect(metadata):
        raise _unsafe(source, f"holds {problem}")
    return metadata


_UNSET = object()


def _fields_defect(obj: Any) -> str | None:
    """What is wrong with the fields of ``obj`` (of a METADATA_CLASSES class) against FIELD_TYPES, or None."""
    for name, kinds in FIELD_TYPES[type(obj)].items():
        value = getattr(obj, name, _UNSET)
        if type(value) not in kinds:
            return f"a {type(obj).__name__} whose {name} is {_shown(value)}"
    return None


def _shown(value: Any) -> str:
    """A value of the file in a message: a short printable string as itself, anything else by its type only (the
    repr of a file's nested structure can be as long as the file makes it, or its newlines break the line)."""
    if type(value) is str:
        return repr(value[:200]) if value.isprintable() else "a string with unprintable characters"
    return f"a {type(value).__name__}" if type(value) not in (int, bool, _NONE) else repr(value)


def _structure_defect(metadata: Metadata) -> str | None:
    """Why ``metadata`` is not shaped as DCP writes it (each field of its own type, all the way down), or None: the
    checks that follow and DCP's reader then meet only the types they expect."""
    if defect := _fields_defect(metadata):
        return defect
    for fqn, entry in metadata.state_dict_metadata.items():
        if (
            type(fqn) is not str
            or not fqn.isprintable()
            or type(entry) not in (TensorStorageMetadata, BytesStorageMetadata)
        ):
            return f"the entry {_shown(fqn)} as {_shown(entry)}"
        if type(entry) is TensorStorageMetadata:
            if defect := _fields_defect(entry) or _fields_defect(entry.properties):
                return defect
            for chunk in entry.chunks:
                if type(chunk) is not ChunkStorageMetadata:
                    return f"a chunk of {fqn} as {_shown(chunk)}"
                if defect := _fields_defect(chunk):
                    return defect
    for index, info in metadata.storage_data.items():
        if type(index) is not MetadataIndex or type(info) is not _StorageInfo:
            return f"{_shown(info)} where an entry's place belongs"
        if defect := _fields_defect(index) or _fields_defect(info):
            return defect
        if not index.fqn.isprintable() or not info.relative_path.isprintable():
            return f"the entry {_shown(index.fqn)} in the file {_shown(info.relative_path)}"
    for fqn, path in (metadata.planner_data or {}).items():  # a flattened key's path in the nested state dict
        if type(fqn) is not str or type(path) not in (tuple, list) or not all(type(p) in (str, int) for p in path):
            return f"the planner path {_shown(path)} for {_shown(fqn)}"
    if metadata.storage_meta is not None:
        if defect := _fields_defect(metadata.storage_meta):
            return defect
        if not all(type(m) is str for m in metadata.storage_meta.modules):
            return "a StorageMeta whose modules are not names"
    return None


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
        from shardlab.checkpoint.saved_values import read_value

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


def _unsafe(source: Path, what: str) -> UnsafeCheckpointError:
    return UnsafeCheckpointError(
        f"{source} {what}, which DCP never writes: refused before reading it (a crafted or foreign file); load "
        "checkpoints only from sources you trust"
    )


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
        st = os.lstat(path / name)
    except FileNotFoundError:
        raise CheckpointError(f"{path / name} is missing (its index places {fqn} there)") from None
    except OSError as e:
        raise CheckpointError(f"{_shown(str(path / name))} {describe_os_error(path / name, e)}") from None
    if not stat.S_ISREG(st.st_mode):
        link = " (a symbolic link)" if stat.S_ISLNK(st.st_mode) else ""
        raise _unsafe(path / METADATA_FILE, f"places {fqn} in {path / name}, which is not a regular file{link}")
    return st.st_size


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
    from shardlab.checkpoint.saved_values import read_value

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
    from shardlab.checkpoint.saved_values import read_value

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
        from shardlab.checkpoint.saved_values import read_tensor

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
