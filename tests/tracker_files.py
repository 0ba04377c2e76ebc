"""Read back what the trackers kept, through the libraries' own formats: MLflow through ``MlflowClient``, W&B from its
offline run files (``<run dir>/wandb/offline-run-*/run-<id>.wandb``).

wandb 0.31 has no Python reader of its run files any more (``wandb.sdk.internal.datastore`` went with the move to
wandb-core; ``wandb.beta.LocalApi`` is not released), so ``wandb_records`` splits the file into records by its
documented framing - LevelDB's log format, 32 KiB blocks of (crc32, length, type) chunks after a 7-byte ``:W&B``
header - and parses each with the library's own protobuf, ``wandb.proto.wandb_internal_pb2.Record``.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

BLOCK = 32 * 1024
CHUNK_HEADER = 7  # crc32 (4), length (2), type (1)
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def wandb_records(path: Path) -> list[Any]:
    """The records of one ``.wandb`` file, in order, as ``wandb_internal_pb2.Record`` messages."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    ident, magic, _version = struct.unpack("<4sHB", data[:7])
    assert (ident, magic) == (b":W&B", 0xBEE1), f"{path} is not a W&B run file"
    records, pos, pending = [], 7, b""
    while pos + CHUNK_HEADER <= len(data):
        room = BLOCK - pos % BLOCK
        if room < CHUNK_HEADER:  # a block's tail too short for a header is padding
            pos += room
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + CHUNK_HEADER])
        payload = data[pos + CHUNK_HEADER : pos + CHUNK_HEADER + length]
        pos += CHUNK_HEADER + length
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending + payload)
            records.append(record)
            pending = b""
        elif kind in (FIRST, MIDDLE):
            pending += payload
    return records


def _items(items) -> dict[str, Any]:
    return {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in items}


def wandb_offline_runs(run_dir: Path) -> list[dict[str, Any]]:
    """Each offline run file under ``run_dir/wandb``, oldest first: its run id, group, name, config, history rows
    (step: {key: value}) and summary (the last value of each key)."""
    runs = []
    for folder in sorted((run_dir / "wandb").glob("offline-run-*")):
        (path,) = folder.glob("run-*.wandb")
        run: dict[str, Any] = {"history": {}, "summary": {}, "config": {}, "exit": False}
        for record in wandb_records(path):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                run.update(id=record.run.run_id, group=record.run.run_group, name=record.run.display_name)
                run["tags"] = list(record.run.tags)
                run["config"].update(_items(record.run.config.update))
            elif kind == "config":
                run["config"].update(_items(record.config.update))
            elif kind == "history":
                row = _items(record.history.item)
                run["history"][row["_step"]] = row
            elif kind == "summary":
                run["summary"].update(_items(record.summary.update))
            elif kind == "exit":
                run["exit"] = True
        runs.append(run)
    return runs


def mlflow_runs(tracking_uri: str) -> list[Any]:
    """Every run of every experiment in the store, through MlflowClient."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri)
    experiments = [e.experiment_id for e in client.search_experiments()]
    return client.search_runs(experiments)


def mlflow_history(tracking_uri: str, run_id: str, key: str) -> dict[int, float]:
    from mlflow.tracking import MlflowClient

    return {m.step: m.value for m in MlflowClient(tracking_uri).get_metric_history(run_id, key)}
