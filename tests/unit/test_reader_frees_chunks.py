"""A chunk or value read from a step folder is freed when its reader is done with it, by reference counting, not left
in a reference cycle for Python's cyclic GC: such cycles once held every chunk's buffer until a collection happened
to run, ~10 MB more at the peak of a 51 MB model's export (tests/unit/test_export_memory.py)."""

from __future__ import annotations

import gc
import io
from pathlib import Path

import torch

from shardlab.checkpoint.readers import dcp_reader
from shardlab.checkpoint.readers.metadata_pickle import unpickle_metadata
from shardlab.checkpoint.readers.saved_values import read_tensor, read_value


def _unreachable_after(fn) -> int:
    """Objects the cyclic GC finds unreachable after ``fn`` runs (with automatic collection off)."""
    gc.collect()
    gc.disable()
    try:
        fn()
        return gc.collect()
    finally:
        gc.enable()


def _saved(value) -> bytearray:
    buffer = io.BytesIO()
    torch.save(value, buffer)  # as DCP's writer stores each chunk and value
    return bytearray(buffer.getvalue())


def test_reading_a_tensor_chunk_leaves_no_cycle():
    data = _saved(torch.arange(4096, dtype=torch.float32))

    def read():
        out = torch.empty(4096)
        out.copy_(read_tensor(bytearray(data), "chunk"))
        assert torch.equal(out, torch.arange(4096, dtype=torch.float32))

    assert _unreachable_after(read) == 0


def test_reading_a_value_leaves_no_cycle():
    data = bytes(_saved({"lr": 0.1, "betas": (0.9, 0.95), "params": ["a", "b"]}))
    assert _unreachable_after(lambda: read_value(data, "value")) == 0


def test_reading_a_step_folders_index_leaves_no_cycle(tmp_path: Path):
    import torch.distributed.checkpoint as dcp

    dcp.save({"w": torch.ones(8, 4), "lr": 0.5}, checkpoint_id=str(tmp_path), no_dist=True)
    raw = (tmp_path / dcp_reader.METADATA_FILE).read_bytes()
    assert _unreachable_after(lambda: unpickle_metadata(raw, tmp_path / dcp_reader.METADATA_FILE)) == 0
