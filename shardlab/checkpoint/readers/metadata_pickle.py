"""The pickle interpreter that reads DCP's ``.metadata`` without running it (``MetadataUnpickler``; why: the
docstring of shardlab.checkpoint.readers.dcp_reader), and the tables of what such a file may name, call and build.
saved_values extends it to the values and tensors torch.save writes; dcp_reader checks the index it returns against
the step folder."""

from __future__ import annotations

import pickle
import pickletools
import struct
import types
from collections import OrderedDict
from pathlib import Path, PosixPath, PurePosixPath
from typing import Any

import torch
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

from shardlab.errors import CheckpointError, UnsafeCheckpointError

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
        finally:
            # The table's closures and bound methods refer back to the unpickler: left in place, it and all it holds
            # (saved_values' archive: a chunk's whole buffer) wait in a cycle for Python's cyclic GC, and an export
            # or a resume piled up ~10 MB of chunks that way. One load per unpickler, so the table is done with.
            self.ops.clear()

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


def _unsafe(source: Path, what: str) -> UnsafeCheckpointError:
    return UnsafeCheckpointError(
        f"{source} {what}, which DCP never writes: refused before reading it (a crafted or foreign file); load "
        "checkpoints only from sources you trust"
    )
