"""A chunk or value read from a step folder is freed when its reader is done with it, by reference counting, not left
in a reference cycle for Python's cyclic GC: such cycles once held every chunk's buffer until a collection happened
to run, ~10 MB more at the peak of a 51 MB model's export (tests/unit/test_export_memory.py).

Measured in a fresh interpreter: the cyclic GC's count is process-wide, so in a pytest worker a thread that an
earlier test left running (mlflow's and wandb's OpenTelemetry exporters, tqdm's monitor) adds its own cycles to the
count at random (the clean-clone suite once counted 419-740 objects this way)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

MEASURE = r"""
import gc, io, json, sys, threading
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from shardlab.checkpoint.readers import dcp_reader
from shardlab.checkpoint.readers.metadata_pickle import unpickle_metadata
from shardlab.checkpoint.readers.saved_values import read_tensor, read_value


def unreachable_after(fn):
    '''Objects the cyclic GC finds unreachable after fn runs (with automatic collection off).'''
    gc.collect()
    gc.disable()
    try:
        fn()
        return gc.collect()
    finally:
        gc.enable()


def saved(value):
    buffer = io.BytesIO()
    torch.save(value, buffer)  # as DCP's writer stores each chunk and value
    return bytearray(buffer.getvalue())


chunk = saved(torch.arange(4096, dtype=torch.float32))


def read_chunk():
    out = torch.empty(4096)
    out.copy_(read_tensor(bytearray(chunk), "chunk"))
    assert torch.equal(out, torch.arange(4096, dtype=torch.float32))


def planted():
    cycle = []
    cycle.append(cycle)


value = bytes(saved({"lr": 0.1, "betas": (0.9, 0.95), "params": ["a", "b"]}))
folder = Path(sys.argv[1])
dcp.save({"w": torch.ones(8, 4), "lr": 0.5}, checkpoint_id=str(folder), no_dist=True)
raw = (folder / dcp_reader.METADATA_FILE).read_bytes()
assert threading.active_count() == 1, [t.name for t in threading.enumerate()]  # nothing else adds to the count
print(json.dumps({
    "chunk": unreachable_after(read_chunk),
    "value": unreachable_after(lambda: read_value(value, "value")),
    "index": unreachable_after(lambda: unpickle_metadata(raw, folder / dcp_reader.METADATA_FILE)),
    "planted": unreachable_after(planted),
}))
"""


@pytest.fixture(scope="module")
def unreachable(tmp_path_factory) -> dict[str, int]:
    folder = tmp_path_factory.mktemp("step")
    proc = subprocess.run(
        [sys.executable, "-c", MEASURE, str(folder)], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_the_measure_counts_a_cycle_left_behind(unreachable):
    """The planted list that holds itself is found: a count of 0 below means no cycle, not a blind measure."""
    assert unreachable["planted"] >= 1


def test_reading_a_tensor_chunk_leaves_no_cycle(unreachable):
    assert unreachable["chunk"] == 0


def test_reading_a_value_leaves_no_cycle(unreachable):
    assert unreachable["value"] == 0


def test_reading_a_step_folders_index_leaves_no_cycle(unreachable):
    assert unreachable["index"] == 0
