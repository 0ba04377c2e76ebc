"""Issue 41's crafted step folders, kept as fixtures (built here, seeded, from a normal checkpoint): each is refused in
one line, in under 2 s and under 1 GB, by the readers that open step folders (the index, a whole read as consolidate
does, generate's model). They run in one child process, so a regression that hangs (the hash bomb hashed 2**60 tuple
levels; a FIFO blocked in open) fails the test at its timeout instead of hanging the suite, and each case's peak
memory is measured alone (/proc/self/clear_refs resets the peak before it). The bound is on CPU seconds: the wall
clock of a machine shared by other jobs measures them too (both are printed)."""

from __future__ import annotations

import io
import json
import os
import pickle
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from shardlab.checkpoint.readers import dcp_reader
from shardlab.distributed import env as dist_env
from shardlab.errors import CheckpointError
from shardlab.runner import run_rank

RUN = ["optimization.max_steps=2", "checkpoint.interval_steps=2", "validation.interval_steps=0"]
SECONDS, MIB = 2.0, 1024


@pytest.fixture(scope="module")
def normal(tiny_lm, tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("crafted")
    run_rank(tiny_lm(*RUN), tmp / "run", dist_env.detect())
    return tmp / "run" / "checkpoints" / "step_00000002"


def torch_save_archive(pickled: bytes) -> bytes:
    """A torch.save zip around ``pickled`` (its data.pkl), as DCP stores a value."""
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as z:
        z.writestr("archive/data.pkl", pickled)
        z.writestr("archive/byteorder", "little")
        z.writestr("archive/version", "3\n")
    return out.getvalue()


def shared_tuple(depth: int) -> bytes:
    """Protocol-2 opcodes (the ones torch.save writes, which torch's weights_only unpickler reads) leaving a tuple of
    ``depth`` levels whose two halves are one object: 2**depth leaves to hash."""
    ops = b")q\x00"  # EMPTY_TUPLE, BINPUT 0
    for level in range(depth):
        ops += b"h" + bytes([level]) + b"\x86q" + bytes([level + 1])  # BINGET, TUPLE2, BINPUT
    return ops


def hash_bomb() -> bytes:
    """The issue's value: a dict whose key is a tuple nested 60 deep sharing its halves (a few hundred bytes)."""
    return b"\x80\x02}" + shared_tuple(60) + b"G?\xf0\x00\x00\x00\x00\x00\x00s."  # EMPTY_DICT, key, 1.0, SETITEM


def edit_index(folder: Path, edit) -> None:
    metadata = dcp_reader.read_metadata(folder, values=False)
    edit(metadata)
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))


def _value_bomb(folder: Path) -> None:
    payload = torch_save_archive(hash_bomb())
    (folder / "__9_0.distcp").write_bytes(payload)
    edit_index(folder, lambda m: m.storage_data.__setitem__(
        MetadataIndex("optim.param_groups.0.lr"), _StorageInfo("__9_0.distcp", 0, len(payload))))  # fmt: skip


def _dev_zero_metadata(folder: Path) -> None:
    (folder / ".metadata").unlink()
    (folder / ".metadata").symlink_to("/dev/zero")


def _fifo_metadata(folder: Path) -> None:
    (folder / ".metadata").unlink()
    os.mkfifo(folder / ".metadata")


def _outside_shard(folder: Path) -> None:
    outside = folder.parent / "elsewhere.distcp"
    shutil.move(folder / "__0_0.distcp", outside)
    (folder / "__0_0.distcp").symlink_to(outside)


def _largest_chunk(metadata) -> tuple[str, TensorStorageMetadata]:
    return max(
        ((k, e) for k, e in metadata.state_dict_metadata.items() if isinstance(e, TensorStorageMetadata)),
        key=lambda ke: ke[1].size.numel(),
    )


def _shared_bytes(folder: Path) -> None:
    """16 more tensors over the bytes of the largest one: a consolidated file 17 times its folder."""

    def edit(metadata) -> None:
        fqn, entry = _largest_chunk(metadata)
        info = metadata.storage_data[MetadataIndex(fqn, entry.chunks[0].offsets)]
        for i in range(16):
            metadata.state_dict_metadata[f"model.copy{i}"] = entry
            metadata.storage_data[MetadataIndex(f"model.copy{i}", entry.chunks[0].offsets)] = info

    edit_index(folder, edit)


def _many_chunks(folder: Path, n: int = 8000) -> None:
    """A [1, n] tensor in n one-element chunks, each in bytes of its own, but for one of two elements that overlaps
    its neighbour (the sizes still add up to n): the tiling check's worst case, the overlap found last."""
    (folder / "__7_0.distcp").write_bytes(bytes(4 * (n + 2)))
    props = TensorProperties(dtype=torch.float32)
    layout = [(c, 1) for c in range(n - 3)] + [(n - 3, 2), (n - 2, 1)]

    def edit(metadata) -> None:
        chunks = [ChunkStorageMetadata(torch.Size([0, c]), torch.Size([1, w])) for c, w in layout]
        metadata.state_dict_metadata["model.crafted"] = TensorStorageMetadata(props, torch.Size([1, n]), chunks)
        for c, w in layout:
            at = 4 * c if w == 1 else 4 * n  # the wide one in bytes past the others'
            metadata.storage_data[MetadataIndex("model.crafted", torch.Size([0, c]))] = _StorageInfo(
                "__7_0.distcp", at, 4 * w
            )

    edit_index(folder, edit)


def _negative_shape(folder: Path) -> None:
    def edit(metadata) -> None:
        fqn, entry = _largest_chunk(metadata)
        entry.size, entry.chunks = torch.Size([-2, 0]), []

    edit_index(folder, edit)


def _long_name(folder: Path) -> None:
    def edit(metadata) -> None:
        index = next(k for k in metadata.storage_data if k.fqn == "optim.param_groups.0.lr")
        metadata.storage_data[index] = _StorageInfo("x" * 300, 0, 8)

    edit_index(folder, edit)


def _symlink_loop(folder: Path) -> None:
    (folder / "loop").symlink_to("loop")

    def edit(metadata) -> None:
        index = next(k for k in metadata.storage_data if k.fqn == "optim.param_groups.0.lr")
        metadata.storage_data[index] = _StorageInfo("loop", 0, 8)

    edit_index(folder, edit)


def _huge_config(folder: Path) -> None:
    """shardlab.json describing a model of 64 layers of width 16384 (about 200 GB of fp32) over the tiny one's
    tensors."""
    meta = json.loads((folder / "shardlab.json").read_text())
    for section in (meta["model_config"], meta["config"]["model"]):
        section.update(num_layers=64, dim=16384, num_heads=64)
    (folder / "shardlab.json").write_text(json.dumps(meta))


CASES = {
    "hash-bomb value": (_value_bomb, "uses a tuple as a dict key"),
    "/dev/zero .metadata": (_dev_zero_metadata, ".metadata is a symbolic link"),
    "FIFO .metadata": (_fifo_metadata, ".metadata is not a regular file (a FIFO)"),
    "shard linked outside": (_outside_shard, "__0_0.distcp, which is not a regular file (a symbolic link)"),
    "shared chunk bytes": (_shared_bytes, "in the same bytes of"),
    "8000 one-element chunks": (
        _many_chunks,
        "gives model.crafted [1, 8000] overlapping chunks at [0, 7997] and [0, 7998]",
    ),
    "shape [-2, 0]": (_negative_shape, "the shape [-2, 0]"),
    "300-character name": (_long_name, "has a name longer than the file system allows"),
    "symlink loop": (_symlink_loop, "loop, which is not a regular file (a symbolic link)"),
}
READERS = {
    "index": "dcp_reader.read_metadata(path)",
    "whole": "weights.read_full(path)",
    "generate": "generate.load_model(path)",
}
CHILD = """
import json, re, sys, time
from pathlib import Path
from shardlab.checkpoint import weights
from shardlab.checkpoint.readers import dcp_reader
from shardlab.errors import ShardlabError
from shardlab_commands import generate

def rss_kib(field):
    return int(re.search(field + r":\\s+(\\d+)", open("/proc/self/status").read()).group(1))

generate.load_model(Path(sys.argv[2]))  # warm: the imports and registries a first build loads are no input's cost
for name, folder, reader in json.loads(sys.argv[1]):
    path = Path(folder)
    open("/proc/self/clear_refs", "w").write("5")  # the peak from here
    before, start, cpu = rss_kib("VmRSS"), time.perf_counter(), time.process_time()
    try:
        eval(reader)
        error = None
    except ShardlabError as e:
        error = f"{type(e).__name__}: {e}"
    seconds, cpu, grew = time.perf_counter() - start, time.process_time() - cpu, (rss_kib("VmHWM") - before) / 1024
    print(json.dumps({"case": name, "reader": reader, "error": error, "s": seconds, "cpu": cpu, "mib": grew}))
"""


def run_child(jobs: list[tuple[str, str, str]], warm: Path, timeout: float) -> list[dict]:
    """Each job (case, folder, reader) in one child, after a read of the normal folder ``warm``."""
    out = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps(jobs), str(warm)], capture_output=True, text=True, timeout=timeout
    )
    results = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert len(results) == len(jobs), out.stdout[-2000:] + out.stderr[-4000:]
    return results


@pytest.fixture(scope="module")
def crafted_and_normal(normal, tmp_path_factory) -> list[dict]:
    """Every crafted case by every reader, then the uncrafted folder by the same readers, in one child: the two tests
    below read their own results (one child start fewer; the crafted cases run first, as they did alone)."""
    tmp, jobs = tmp_path_factory.mktemp("cases"), []
    for i, (name, (craft, _)) in enumerate(CASES.items()):
        folder = tmp / f"case{i}" / "step_00000002"
        shutil.copytree(normal, folder, symlinks=True)
        craft(folder)
        jobs += [(name, str(folder), reader) for reader in READERS.values()]
    jobs += [("normal", str(normal), reader) for reader in READERS.values()]
    return run_child(jobs, normal, timeout=300)


def test_crafted_step_folders_are_refused_in_one_line_quickly_and_in_bounded_memory(crafted_and_normal):
    crafted = [result for result in crafted_and_normal if result["case"] != "normal"]
    assert len(crafted) == len(CASES) * len(READERS)
    for result in crafted:
        expected = CASES[result["case"]][1]
        print(f"{result['case']:26s} {result['reader']:34s} {result['s']:.3f} s ({result['cpu']:.3f} CPU)  "
              f"+{result['mib']:.0f} MiB")  # fmt: skip
        assert result["error"] is not None, f"{result['case']}: read without a word by {result['reader']}"
        assert "\n" not in result["error"] and expected in result["error"], result
        assert "CheckpointError" in result["error"], result
        assert result["cpu"] < SECONDS and result["mib"] < MIB, result


def test_a_crafted_model_config_is_refused_before_its_model_is_materialized(normal, tmp_path):
    folder = tmp_path / "step_00000002"
    shutil.copytree(normal, folder)
    _huge_config(folder)
    cache = tmp_path / "cache"
    jobs = [
        ("huge config", str(folder), "generate.load_model(path)"),
        (
            "huge config",
            str(folder),
            f"__import__('shardlab_commands.evaluate').evaluate.main([str(path), 'data.cache_dir={cache}'])",
        ),
    ]
    for result in run_child(jobs, normal, timeout=300):
        print(f"{result['reader'][:60]:60s} {result['s']:.3f} s ({result['cpu']:.3f} CPU)  +{result['mib']:.0f} MiB")
        assert result["error"] and "\n" not in result["error"], result
        assert "IncompatibleCheckpointError" in result["error"], result
        assert "but the model its config describes has" in result["error"], result
        assert result["cpu"] < SECONDS and result["mib"] < MIB, result


def test_a_normal_checkpoint_still_reads_through_the_same_child(crafted_and_normal):
    """The harness measures what it claims: the same readers on the uncrafted folder read without an error."""
    results = [result for result in crafted_and_normal if result["case"] == "normal"]
    assert len(results) == len(READERS) and all(r["error"] is None for r in results), results


def test_the_hash_bomb_alone_is_refused_by_the_value_reader_in_under_a_second():
    from shardlab.checkpoint.readers.saved_values import read_value

    payload = torch_save_archive(hash_bomb())
    assert len(hash_bomb()) < 400
    code = (
        "import sys, time; from shardlab.checkpoint.readers.saved_values import read_value\n"
        "start = time.perf_counter()\n"
        "try: read_value(sys.stdin.buffer.read(), 'the value')\n"
        "except Exception as e: print(type(e).__name__, e)\n"
        "print(time.perf_counter() - start)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], input=payload, capture_output=True, timeout=120)
    refusal, seconds = out.stdout.decode().splitlines()
    assert refusal.startswith("UnsafeCheckpointError the value uses a tuple as a dict key"), refusal
    assert float(seconds) < 1.0
    with pytest.raises(CheckpointError, match="deeper than 32"):  # the same tuple as a value: walked with a bound
        read_value(torch_save_archive(b"\x80\x02" + shared_tuple(60) + b"."), "the value")


def test_a_resume_from_non_finite_scheduler_state_is_refused_naming_the_key(tiny_lm, normal, tmp_path):
    """JSON's Infinity in scheduler.base_lrs resumed at lr inf: refused before training, naming the key."""
    crafted = tmp_path / "step_00000002"
    shutil.copytree(normal, crafted)
    meta = json.loads((crafted / "shardlab.json").read_text())
    meta["scheduler"]["base_lrs"][0] = float("inf")
    (crafted / "shardlab.json").write_text(json.dumps(meta))  # json writes Infinity
    assert "Infinity" in (crafted / "shardlab.json").read_text()
    with pytest.raises(CheckpointError, match=r"holds scheduler\.base_lrs\.0 = inf, not a finite number") as e:
        run_rank(
            tiny_lm("optimization.max_steps=4", f"checkpoint.resume={crafted}"), tmp_path / "run", dist_env.detect()
        )
    assert "\n" not in str(e.value)


def test_a_resume_from_a_non_finite_optimizer_value_is_refused_naming_the_entry(normal, tmp_path):
    crafted = tmp_path / "step_00000002"
    shutil.copytree(normal, crafted)
    buffer = io.BytesIO()
    torch.save(float("nan"), buffer)
    (crafted / "__9_0.distcp").write_bytes(buffer.getvalue())
    edit_index(crafted, lambda m: m.storage_data.__setitem__(
        MetadataIndex("optim.param_groups.0.lr"), _StorageInfo("__9_0.distcp", 0, len(buffer.getvalue()))))  # fmt: skip
    state = {"optim": {"param_groups": [{"lr": 0.0}]}}
    from torch.distributed.checkpoint.api import CheckpointException

    from shardlab.errors import first_cause

    with pytest.raises(CheckpointException) as e:  # DCP wraps a rank's error; shardlab's readers report its cause
        dcp_reader.load(state, crafted, no_dist=True)

    assert "optim.param_groups.0.lr is nan, not a finite number" in first_cause(e.value)


def test_the_non_finite_advice_names_the_cause_it_found():
    from shardlab.optim.divergence import nonfinite_cause

    def cause(lr: float, weights_finite: bool) -> str:
        return nonfinite_cause([1e-3, lr], lambda: weights_finite)

    assert "the learning rate is inf" in cause(float("inf"), True)
    assert "the weights themselves are not finite" in cause(1e-3, False)
    assert "lower optimizer.lr" in cause(1e-3, True)


def test_fuzzed_values_and_chunks_are_read_or_refused_in_one_line_in_bounded_time_and_memory(normal):
    """Seeded byte changes of a real value (a param group's names) and a real tensor chunk, read by the readers a
    load uses: each returns or raises a CheckpointError of one line, within 1 CPU s and 64 MiB of growth."""
    import random
    import re
    import time

    from shardlab.checkpoint.readers.saved_values import read_tensor, read_value

    metadata = dcp_reader.read_metadata(normal, values=False)

    def extent(fqn: str) -> bytes:
        info = next(v for k, v in metadata.storage_data.items() if k.fqn == fqn)
        with open(normal / info.relative_path, "rb") as f:
            f.seek(info.offset)
            return f.read(info.length)

    fqn = max((k for k in metadata.state_dict_metadata if k.startswith("model.")), key=len)
    originals = {"value": extent("optim.param_groups.0.params"), "tensor": extent(fqn)}
    hwm = lambda: int(re.search(r"VmHWM:\s+(\d+)", open("/proc/self/status").read()).group(1))  # noqa: E731
    rng, outcomes = random.Random(41), {"read": 0, "refused": 0}
    for i in range(300):
        kind = ("value", "tensor")[i % 2]
        data = bytearray(originals[kind])
        for _ in range(rng.choice((1, 2, 4, 8))):
            data[rng.randrange(len(data))] = rng.randrange(256)
        if rng.random() < 0.1:
            data = data[: rng.randrange(len(data))]
        open("/proc/self/clear_refs", "w").write("5")
        before, cpu = hwm(), time.process_time()
        try:
            read_value(bytes(data), "v") if kind == "value" else read_tensor(data, "t")
            outcomes["read"] += 1
        except CheckpointError as e:
            assert "\n" not in str(e), str(e)
            outcomes["refused"] += 1
        assert time.process_time() - cpu < 1.0
        assert hwm() - before < 64 * 1024, "more than 64 MiB"
    assert outcomes["read"] > 20 and outcomes["refused"] > 20, outcomes  # both sides were reached
