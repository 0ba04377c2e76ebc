"""Opening a step folder never runs its code: a .metadata pickle that would is refused, in one line, by every path
that reads checkpoints, and so is a pickled value among the shards (DCP's own planner unpickles those with
weights_only=False) and an index that points outside the folder's files or gives a tensor more than its files hold;
a normal checkpoint keeps torch's own format, so torch's DCP tools still read it."""

from __future__ import annotations

import collections
import io
import os
import pathlib
import pickle
import random
import shutil

import pytest
import torch
import torch.distributed.checkpoint.metadata as dcp_metadata
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex

from shardlab.checkpoint import weights
from shardlab.checkpoint.readers import dcp_reader
from shardlab.distributed import env as dist_env
from shardlab.errors import CheckpointError, ConfigError, UnsafeCheckpointError, first_cause
from shardlab.runner import run_rank
from shardlab_commands import consolidate, evaluate, export_hf, generate

RUN = ["optimization.max_steps=2", "checkpoint.interval_steps=2", "validation.interval_steps=0"]


class RunsCode:
    """What an attacker puts into a pickle: unpickling it calls os.system."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self):
        return os.system, (self.command,)


@pytest.fixture(scope="module")
def checkpoints(tiny_lm, tmp_path_factory):
    """A normal step folder, and a copy whose .metadata also carries a payload that would create ``marker``."""
    tmp = tmp_path_factory.mktemp("dcp_reader")
    run_rank(tiny_lm(*RUN), tmp / "run", dist_env.detect())
    normal = tmp / "run" / "checkpoints" / "step_00000002"
    crafted = tmp / "crafted" / "step_00000002"
    shutil.copytree(normal, crafted)
    marker = tmp / "code-ran"
    metadata = dcp_reader.read_metadata(normal)
    metadata.planner_data = {"payload": RunsCode(f"touch {marker}")}  # hidden among the real entries
    (crafted / ".metadata").write_bytes(pickle.dumps(metadata))
    return normal, crafted, marker


def crafted_copy(normal, dest, edit) -> None:
    """``dest``: a copy of step folder ``normal`` whose index ``edit(metadata, dest)`` changed."""
    shutil.copytree(normal, dest)
    metadata = dcp_reader.read_metadata(normal)
    edit(metadata, dest)
    (dest / ".metadata").write_bytes(pickle.dumps(metadata))


def byte_entry_payload(marker):
    """An edit that makes the optimizer's first learning rate a pickle that would create ``marker`` when loaded."""

    def edit(metadata, dest) -> None:
        buffer = io.BytesIO()
        torch.save(RunsCode(f"touch {marker}"), buffer)  # as DCP writes its values: torch.save's format
        payload = buffer.getvalue()
        (dest / "__9_0.distcp").write_bytes(payload)
        metadata.storage_data[MetadataIndex("optim.param_groups.0.lr")] = _StorageInfo("__9_0.distcp", 0, len(payload))

    return edit


@pytest.fixture(scope="module")
def crafted_value(checkpoints, tmp_path_factory):
    """A step folder whose index is DCP's own but one of whose pickled values would run code."""
    normal, _, _ = checkpoints
    tmp = tmp_path_factory.mktemp("crafted_value")
    marker = tmp / "code-ran"
    crafted_copy(normal, tmp / "step_00000002", byte_entry_payload(marker))
    return tmp / "step_00000002", marker


def assert_value_refused(error: BaseException, crafted, marker) -> None:
    message = str(error)
    assert "\n" not in message
    assert f"{crafted}: its entry optim.param_groups.0.lr names posix.system, which DCP never writes" in message
    assert not marker.exists(), "the payload ran"


def assert_refused(error: BaseException, crafted, marker) -> None:
    message = str(error)
    assert "\n" not in message
    assert f"{crafted / '.metadata'} refers to posix.system, which DCP checkpoint metadata never holds" in message
    assert not marker.exists(), "the payload ran"


def test_torch_still_writes_the_index_under_the_name_we_read():
    from torch.distributed.checkpoint.filesystem import _metadata_fn

    assert _metadata_fn == dcp_reader.METADATA_FILE


def test_a_normal_checkpoint_reads_through_the_allow_list_and_through_torchs_own_tools(checkpoints, tmp_path):
    normal, _, _ = checkpoints
    ours = weights.read_full(normal)
    dcp_to_torch_save(str(normal), str(tmp_path / "whole.pt"))
    theirs = torch.load(tmp_path / "whole.pt", weights_only=True)["model"]
    assert sorted(ours) == sorted(theirs) and all(torch.equal(ours[k], theirs[k]) for k in ours)


def test_resume_refuses_a_crafted_metadata_and_sets_nothing_aside(tiny_lm, checkpoints, tmp_path):
    _, crafted, marker = checkpoints
    shutil.copytree(crafted, tmp_path / "checkpoints" / crafted.name)
    with pytest.raises(UnsafeCheckpointError) as auto:  # the folder's own newest: refused, no fallback
        run_rank(tiny_lm(*RUN), tmp_path, dist_env.detect())
    assert_refused(auto.value, tmp_path / "checkpoints" / crafted.name, marker)
    assert (tmp_path / "checkpoints" / crafted.name).is_dir()
    with pytest.raises(CheckpointError) as explicit:
        run_rank(tiny_lm(*RUN, f"checkpoint.resume={crafted}"), tmp_path / "other", dist_env.detect())
    assert_refused(explicit.value, crafted, marker)


def test_init_from_refuses_a_crafted_metadata(tiny_lm, checkpoints, tmp_path):
    _, crafted, marker = checkpoints
    with pytest.raises(CheckpointError) as e:
        run_rank(tiny_lm(*RUN, f"checkpoint.init_from={crafted}"), tmp_path, dist_env.detect())
    assert_refused(e.value, crafted, marker)


@pytest.mark.parametrize(
    "tool",
    [
        lambda c, out: generate.main([str(c), "--max-new-tokens", "2"]),
        lambda c, out: consolidate.main([str(c), "--out", str(out / "m.safetensors")]),
        lambda c, out: export_hf.main([str(c), "--out", str(out / "hf")]),
        lambda c, out: evaluate.main([str(c), "--batch-size", "8"]),
    ],
    ids=["generate", "consolidate", "export_hf", "evaluate"],
)
def test_the_tools_refuse_a_crafted_metadata(checkpoints, tmp_path, tool):
    _, crafted, marker = checkpoints
    with pytest.raises(UnsafeCheckpointError) as e:
        tool(crafted, tmp_path)
    assert_refused(e.value, crafted, marker)
    assert not any(tmp_path.iterdir()), "nothing was written"


def test_garbage_metadata_is_unreadable_not_unsafe(checkpoints, tmp_path):
    normal, _, _ = checkpoints
    broken = tmp_path / "step_00000002"
    shutil.copytree(normal, broken)
    (broken / ".metadata").write_bytes(b"\x80\x04not a pickle")
    with pytest.raises(CheckpointError, match=r"\.metadata is unreadable") as e:
        dcp_reader.read_metadata(broken)
    assert not isinstance(e.value, UnsafeCheckpointError)
    assert "does not unpickle" in dcp_reader.integrity_defect(broken)
    assert dcp_reader.integrity_defect(normal) is None


def test_resume_and_init_from_refuse_a_pickled_value_that_would_run_code(tiny_lm, crafted_value, tmp_path):
    crafted, marker = crafted_value
    shutil.copytree(crafted, tmp_path / "run" / "checkpoints" / crafted.name)
    with pytest.raises(UnsafeCheckpointError) as auto:
        run_rank(tiny_lm(*RUN), tmp_path / "run", dist_env.detect())
    assert_value_refused(auto.value, tmp_path / "run" / "checkpoints" / crafted.name, marker)
    assert (tmp_path / "run" / "checkpoints" / crafted.name).is_dir()  # refused, not set aside
    with pytest.raises(UnsafeCheckpointError) as init:
        run_rank(tiny_lm(*RUN, f"checkpoint.init_from={crafted}"), tmp_path / "init", dist_env.detect())
    assert_value_refused(init.value, crafted, marker)


@pytest.mark.parametrize("tool", ["generate", "consolidate", "export_hf"])
def test_the_tools_refuse_a_pickled_value_that_would_run_code(crafted_value, tmp_path, tool):
    crafted, marker = crafted_value
    run = {
        "generate": lambda: generate.main([str(crafted), "--max-new-tokens", "2"]),
        "consolidate": lambda: consolidate.main([str(crafted), "--out", str(tmp_path / "m.safetensors")]),
        "export_hf": lambda: export_hf.main([str(crafted), "--out", str(tmp_path / "hf")]),
    }[tool]
    with pytest.raises(UnsafeCheckpointError) as e:
        run()
    assert_value_refused(e.value, crafted, marker)
    assert not any(tmp_path.iterdir()), "nothing was written"


def test_the_load_itself_unpickles_values_with_weights_only(checkpoints, crafted_value):
    """Even a caller that skipped the check (checked=True) does not run the value: SafeLoadPlanner reads it."""
    normal, _, _ = checkpoints
    crafted, marker = crafted_value
    state = {"optim": {"param_groups": [{"lr": 0.0}]}}
    with pytest.raises(CheckpointException) as e:  # DCP wraps each rank's error
        dcp_reader.load(state, crafted, checked=True, no_dist=True)
    assert "UnsafeCheckpointError" in first_cause(e.value) and "names posix.system" in first_cause(e.value)
    assert not marker.exists(), "the payload ran"
    dcp_reader.load(state, normal, checked=True, no_dist=True)  # DCP's own values still load, through the same path
    assert isinstance(state["optim"]["param_groups"][0]["lr"], float)


def _outside(metadata, dest) -> None:
    index = next(k for k in metadata.storage_data if k.fqn == "optim.param_groups.0.lr")
    metadata.storage_data[index] = _StorageInfo("/dev/zero", 0, 8 * 2**30)


def _device_link(metadata, dest) -> None:
    (dest / "__8_0.distcp").symlink_to("/dev/zero")
    index = next(k for k in metadata.storage_data if k.fqn == "optim.param_groups.0.lr")
    metadata.storage_data[index] = _StorageInfo("__8_0.distcp", 0, 8 * 2**30)


def _unstored_tensor(metadata, dest) -> None:
    entry = metadata.state_dict_metadata["model.embed.tok.weight"]
    entry.size = torch.Size([2**31])  # 8 GiB of float32 that no file holds
    entry.chunks = []


def _chunk_past_its_bytes(metadata, dest) -> None:
    entry = metadata.state_dict_metadata["model.embed.tok.weight"]
    first = entry.chunks[0]
    entry.size = torch.Size([first.sizes[0] * 1000, *entry.size[1:]])
    entry.chunks = [ChunkStorageMetadata(first.offsets, torch.Size([entry.size[0], *first.sizes[1:]]))]


@pytest.mark.parametrize(
    "edit, refusal",
    [
        (_outside, "places optim.param_groups.0.lr in '/dev/zero', outside the step folder"),
        (_device_link, "__8_0.distcp, which is not a regular file"),
        (_unstored_tensor, "gives model.embed.tok.weight the shape [2147483648] but chunks holding 0 of its elements"),
        (_chunk_past_its_bytes, "stores the chunk of model.embed.tok.weight at [0, 0] in fewer bytes than its"),
    ],
    ids=["absolute-path", "link-to-a-device", "tensor-no-file-holds", "chunk-larger-than-its-bytes"],
)
def test_an_index_that_would_read_or_allocate_past_the_folders_files_is_refused(checkpoints, tmp_path, edit, refusal):
    normal, _, _ = checkpoints
    crafted = tmp_path / "step_00000002"
    crafted_copy(normal, crafted, edit)
    out = tmp_path / "out" / "m.safetensors"
    for read in (dcp_reader.read_metadata, weights.read_full, lambda p: consolidate.main([str(p), "--out", str(out)])):
        with pytest.raises(UnsafeCheckpointError) as e:
            read(crafted)
        assert refusal in str(e.value) and "\n" not in str(e.value)
    assert not out.parent.exists(), "nothing was written"


def test_a_shard_cut_short_is_unreadable_not_unsafe(checkpoints, tmp_path):
    """A torn write: resume falls back past it (tests/unit/test_checkpoint_lifecycle.py), so it is no refusal."""
    normal, _, _ = checkpoints
    torn = tmp_path / "step_00000002"
    shutil.copytree(normal, torn)
    shard = torn / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    with pytest.raises(CheckpointError, match="a write cut short") as e:
        dcp_reader.read_metadata(torn)
    assert not isinstance(e.value, UnsafeCheckpointError)
    assert "a write cut short" in dcp_reader.integrity_defect(torn)


def test_an_optimizer_whose_param_groups_would_not_read_back_is_refused_before_training(tiny_lm, tmp_path, monkeypatch):
    """A plug-in optimizer keeping a numpy scalar in its param groups would save, then have its own checkpoint refused
    at resume as a crafted file: refused at once instead, naming the optimizer."""
    import numpy as np

    from shardlab.optim import OPTIMIZERS

    assert dcp_reader.values_load_back([{"lr": 1e-3, "betas": (0.9, 0.95), "foreach": None, "name": "x"}]) is None
    assert "numpy" in dcp_reader.values_load_back([{"lr": np.float64(1e-3)}])
    build = OPTIMIZERS.build

    def with_numpy_lr(*args, **kwargs):
        optimizer = build(*args, **kwargs)
        optimizer.param_groups[0]["lr"] = np.float64(optimizer.param_groups[0]["lr"])
        return optimizer

    monkeypatch.setattr(OPTIMIZERS, "build", with_numpy_lr)
    with pytest.raises(ConfigError, match=r"optimizer.name=adamw: its param groups hold a value checkpoints cannot"):
        run_rank(tiny_lm(*RUN), tmp_path, dist_env.detect())
    assert not (tmp_path / "checkpoints").exists()


NAMED = (
    *(getattr(dcp_metadata, name) for name in dcp_metadata.__all__),
    dcp_metadata._MEM_FORMAT_ENCODING,
    _StorageInfo,
    torch.Size,
    torch.serialization._get_layout,
    pathlib.PurePath,
    pathlib.PurePosixPath,
    pathlib.PosixPath,
    collections.OrderedDict,
)
"""Everything a DCP .metadata names (the classes and functions whose attributes a crafted one must never change)."""


def test_torchs_weights_only_unpickler_reads_dcp_metadata_at_protocol_2_and_still_is_not_safe_for_it(checkpoints):
    """Why dcp_reader keeps its own MetadataUnpickler. Not the format: torch's restricted unpickler refuses the
    protocol-4 pickle DCP writes, but the same metadata pickled at protocol 2 reads back once DCP's classes are safe
    globals. The reason is what it does with what it admits: BUILD sets attributes on a safe global's Enum member
    for the whole process, and a dict key is hashed however deep it is. Ours refuses both."""
    normal, _, _ = checkpoints
    data = (normal / ".metadata").read_bytes()
    metadata = dcp_reader.read_metadata(normal, values=False)
    with torch.serialization.safe_globals(list(NAMED)):
        with pytest.raises(pickle.UnpicklingError):
            torch.load(io.BytesIO(data), weights_only=True)  # protocol 4, as DCP writes it
        again = torch.load(io.BytesIO(_archive(pickle.dumps(metadata, protocol=2))), weights_only=True)
    assert again.state_dict_metadata.keys() == metadata.state_dict_metadata.keys()  # the format is no obstacle

    member = dcp_metadata._MEM_FORMAT_ENCODING.TORCH_CONTIGUOUS_FORMAT
    build = (  # _MEM_FORMAT_ENCODING(0), then BUILD {'shardlab_probe': 1} on that shared member
        b"\x80\x02ctorch.distributed.checkpoint.metadata\n_MEM_FORMAT_ENCODING\nK\x00\x85R}"
        + _string("shardlab_probe")
        + b"K\x01sb."
    )
    try:
        with torch.serialization.safe_globals(list(NAMED)):
            torch.load(io.BytesIO(_archive(build)), weights_only=True)
        assert getattr(member, "shardlab_probe", None) == 1, "torch no longer builds on a shared member: reconsider"
    finally:
        vars(member).pop("shardlab_probe", None)
    with pytest.raises(UnsafeCheckpointError, match="would set attributes of a _MEM_FORMAT_ENCODING it did not"):
        dcp_reader.unpickle_metadata(build, normal / ".metadata")
    assert not hasattr(member, "shardlab_probe")


def _archive(pickled: bytes) -> bytes:
    """``pickled`` in torch.save's zip (data.pkl), for torch.load."""
    import zipfile

    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as z:
        z.writestr("archive/data.pkl", pickled)
        z.writestr("archive/byteorder", "little")
        z.writestr("archive/version", "3\n")
    return out.getvalue()


def _string(text: str) -> bytes:
    data = text.encode()
    return pickle.BINUNICODE + len(data).to_bytes(4, "little") + data


ATTACKS = {
    # The finding: every Path of the process would print as the attacker's path.
    "class-slot": (
        b"\x80\x02cpathlib\nPurePosixPath\nN}" + _string("_str") + _string("/attacker") + b"s\x86b.",
        "would set attributes of the class pathlib.PurePosixPath",
    ),
    # torch's layout lookup (how every torch.layout unpickles) would answer from the attacker's table.
    "function-attribute": (
        b"\x80\x02ctorch.serialization\n_get_layout\n}" + _string("cache") + b"}sb.",
        "would set attributes of the function torch.serialization._get_layout",
    ),
    # A shared object that existed before the file: the Enum member TensorProperties pickles its format as.
    "existing-object": (
        b"\x80\x02ctorch.distributed.checkpoint.metadata\n_MEM_FORMAT_ENCODING\nK\x00\x85R}"
        + _string("_value_")
        + b"K\x07sb.",
        "would set attributes of a _MEM_FORMAT_ENCODING it did not create",
    ),
    # A dict that is not the file's own: the class's namespace is not reachable, but a dtype is an existing object.
    "setitem-on-a-global": (
        b"\x80\x02ctorch\nfloat32\n" + _string("x") + b"K\x01s.",
        "would change a dtype it did not create",
    ),
}


def _process_state() -> dict[str, dict[str, int]]:
    """What a crafted file must never change: the attributes (by identity) of pathlib, DCP's metadata module, and of
    every class and function a .metadata may name, plus the contents of the layout lookup's cache."""
    owners = {"pathlib": pathlib, "dcp_metadata": dcp_metadata, "dcp_reader": dcp_reader}
    owners.update({repr(o): o for o in NAMED})
    state = {name: {k: id(v) for k, v in vars(owner).items()} for name, owner in owners.items()}
    state["layout cache"] = {k: id(v) for k, v in torch.serialization._get_layout.cache.items()}
    return state


@pytest.fixture
def restored_process():
    """Puts back whatever a crafted file changed (on today's stdlib-based reader it would), so a failing test does not
    break every later one in this process."""
    saved = {c: dict(vars(c)) for c in NAMED if isinstance(c, type)}
    layout = dict(vars(torch.serialization._get_layout))
    members = {m: dict(vars(m)) for m in dcp_metadata._MEM_FORMAT_ENCODING}
    yield
    for cls, attrs in saved.items():
        for key in set(vars(cls)) - set(attrs):
            delattr(cls, key)
        for key, value in attrs.items():
            if key not in ("__dict__", "__weakref__", "__doc__") and vars(cls).get(key) is not value:
                setattr(cls, key, value)
    for obj, attrs in [(torch.serialization._get_layout, layout), *members.items()]:
        vars(obj).clear()
        vars(obj).update(attrs)


@pytest.mark.parametrize("payload, refusal", ATTACKS.values(), ids=ATTACKS.keys())
def test_a_metadata_that_would_change_a_class_function_or_shared_object_is_refused(
    tiny_lm, checkpoints, tmp_path, restored_process, payload, refusal
):
    """Every path that opens a step folder: the reader, the tools, init_from, resume (auto and by path)."""
    normal, _, _ = checkpoints
    crafted = tmp_path / "run" / "checkpoints" / "step_00000002"
    shutil.copytree(normal, crafted)
    (crafted / ".metadata").write_bytes(payload)
    weights.read_full(normal)  # the layout lookup's cache as a normal read leaves it
    before = _process_state()
    out = tmp_path / "out" / "m.safetensors"
    readers = {
        "read_metadata": dcp_reader.read_metadata,
        "read_full": weights.read_full,
        "consolidate": lambda p: consolidate.main([str(p), "--out", str(out)]),
        "generate": lambda p: generate.main([str(p), "--max-new-tokens", "2"]),
        "evaluate": lambda p: evaluate.main([str(p), "--batch-size", "8"]),
        "init_from": lambda p: run_rank(tiny_lm(*RUN, f"checkpoint.init_from={p}"), tmp_path / "b", dist_env.detect()),
        "resume=path": lambda p: run_rank(tiny_lm(*RUN, f"checkpoint.resume={p}"), tmp_path / "c", dist_env.detect()),
        "resume=auto": lambda p: run_rank(tiny_lm(*RUN), tmp_path / "run", dist_env.detect()),
    }
    for name, read in readers.items():
        with pytest.raises(CheckpointError) as e:
            read(crafted)
        assert refusal in str(e.value) and "\n" not in str(e.value), (name, str(e.value))
    assert str(pathlib.Path("/tmp/x")) == "/tmp/x" and str(pathlib.PurePosixPath("a", "b")) == "a/b"
    assert _process_state() == before
    assert not out.parent.exists(), "consolidate went on after the refusal"
    assert torch.equal(weights.read_full(normal)["embed.tok.weight"], weights.read_full(normal)["embed.tok.weight"])


def _overlapping_chunks(metadata, dest) -> None:
    """embed.tok.weight as rows [0, n/2) and [n/4, 3n/4): sizes that add up to the whole, the last quarter unwritten."""
    fqn = "model.embed.tok.weight"
    entry = metadata.state_dict_metadata[fqn]
    rows, cols = entry.size
    first = metadata.storage_data[MetadataIndex(fqn, [0, 0])]
    half = torch.Size([rows // 2, cols])
    entry.chunks = [
        ChunkStorageMetadata(torch.Size([0, 0]), half),
        ChunkStorageMetadata(torch.Size([rows // 4, 0]), half),
    ]
    with open(dest / first.relative_path, "rb") as f:  # bytes of its own, so the chunks are what overlaps
        f.seek(first.offset)
        (dest / "__7_0.distcp").write_bytes(f.read(first.length))
    metadata.storage_data[MetadataIndex(fqn, [rows // 4, 0])] = _StorageInfo("__7_0.distcp", 0, first.length // 2)


def test_chunks_that_overlap_are_refused_although_their_sizes_add_up(checkpoints, tmp_path):
    normal, _, _ = checkpoints
    crafted = tmp_path / "step_00000002"
    crafted_copy(normal, crafted, _overlapping_chunks)
    out = tmp_path / "out" / "m.safetensors"
    for read in (dcp_reader.read_metadata, weights.read_full, lambda p: consolidate.main([str(p), "--out", str(out)])):
        with pytest.raises(UnsafeCheckpointError, match=r"gives model.embed.tok.weight \[\d+, 64\] overlapping chunks"):
            read(crafted)
    assert dcp_reader.integrity_defect(normal) is None
    assert not out.parent.exists(), "nothing was written"


def _model_read_twice(path) -> tuple[dict, dict]:
    """The model entries of step folder ``path`` loaded into tensors filled with 0 and then with 1 before the load:
    an element the load did not write differs between the two."""
    metadata = dcp_reader.read_metadata(path, values=False)
    loads = []
    for fill in (0.0, 1.0):
        state = {
            k.removeprefix("model."): torch.full(e.size, fill, dtype=e.properties.dtype)
            for k, e in metadata.state_dict_metadata.items()
            if k.startswith("model.")
        }
        dcp_reader.load({"model": state}, path, checked=True, no_dist=True)
        loads.append(state)
    return loads[0], loads[1]


def test_fuzzed_metadata_is_refused_in_one_line_or_read_whole_and_never_changes_the_process(checkpoints, tmp_path):
    """Random byte changes of a real .metadata: each is refused as a CheckpointError of one line, or reads back into
    tensors every element of which the load wrote; none changes a module, class or function attribute."""
    normal, _, _ = checkpoints
    original = (normal / ".metadata").read_bytes()
    reference = weights.read_full(normal)
    fuzzed = tmp_path / "step_00000002"
    shutil.copytree(normal, fuzzed)
    before = _process_state()
    rng = random.Random(29)
    outcomes = {"refused": 0, "refused by the load": 0, "read, equal": 0, "read, other bytes": 0}
    for _ in range(250):
        data = bytearray(original)
        for _ in range(rng.choice((1, 1, 2, 4))):
            data[rng.randrange(len(data))] = rng.randrange(256)
        if rng.random() < 0.1:
            data = data[: rng.randrange(len(data))]
        (fuzzed / ".metadata").write_bytes(bytes(data))
        try:
            dcp_reader.read_metadata(fuzzed)
        except CheckpointError as e:
            assert "\n" not in str(e), str(e)
            outcomes["refused"] += 1
            continue
        try:  # an index whose every field is plausible can still place a chunk on bytes that are no tensor
            zeros, ones = _model_read_twice(fuzzed)
        except CheckpointException:
            with pytest.raises(CheckpointError) as e:  # as every reader in shardlab reports it: one line
                weights.read_full(fuzzed)
            assert "\n" not in str(e.value)
            outcomes["refused by the load"] += 1
            continue
        assert all(torch.equal(zeros[k], ones[k]) for k in zeros), "a tensor was left partly unwritten"
        same = sorted(zeros) == sorted(reference) and all(torch.equal(zeros[k], reference[k]) for k in zeros)
        outcomes["read, equal" if same else "read, other bytes"] += 1
    assert _process_state() == before
    assert str(type(normal)("/tmp/x")) == "/tmp/x"
    assert outcomes["refused"] > 150 and outcomes["read, equal"] > 2, outcomes  # both sides were reached


def _shared_tuple(depth: int) -> bytes:
    """Pickle opcodes leaving on the stack a tuple of ``depth`` levels whose two halves are the same object: a few
    hundred bytes, 2**depth leaves to hash, compare or print."""
    ops = b"\x29\x94"  # EMPTY_TUPLE, MEMOIZE (memo 0)
    for level in range(depth):
        ops += b"h" + bytes([level]) + b"\x86\x94"  # BINGET (the tuple on the stack again), TUPLE2, MEMOIZE
    return ops


def test_a_metadata_whose_key_or_argument_would_take_forever_to_hash_is_refused_at_once(tmp_path):
    """Only strings, ints and checked metadata objects are ever hashed: a shared 64-level tuple as a dict key, or as
    the argument of a lookup, would hash for ages under pickle.load. Run in a child so a regression fails, not hangs."""
    import subprocess
    import sys

    payloads = {
        "key": b"\x80\x04}" + _shared_tuple(64) + b"Ns.",  # EMPTY_DICT, the tuple, NONE, SETITEM
        "argument": b"\x80\x02ctorch.serialization\n_get_layout\n" + _shared_tuple(64) + b"\x85R.",  # (tuple,) REDUCE
    }
    for name, payload in payloads.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / ".metadata").write_bytes(payload)
    code = (
        "import sys; from shardlab.checkpoint.readers import dcp_reader\n"
        "from shardlab.errors import UnsafeCheckpointError\n"
        "for folder in sys.argv[1:]:\n"
        "    try: dcp_reader.read_metadata(folder)\n"
        "    except UnsafeCheckpointError as e: print(e)\n"
    )
    folders = [str(tmp_path / name) for name in payloads]
    out = subprocess.run([sys.executable, "-c", code, *folders], capture_output=True, text=True, timeout=120)
    lines = out.stdout.splitlines()
    assert len(lines) == 2, out.stdout + out.stderr
    assert "uses a tuple as a key, which DCP checkpoint metadata never holds" in lines[0]
    assert "calls the function torch.serialization._get_layout with a tuple of ['a tuple']" in lines[1]
