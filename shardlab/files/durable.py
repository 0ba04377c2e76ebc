"""Writes that survive a kill at any instant, and a power loss where asked: JSON files replaced whole (a reader sees the
old file or the new one), fsyncs of a file and of the folder a rename changed, and the mode a created file gets.

Every small JSON file a run keeps goes through ``write_json_atomic`` (status.json, tracker ids, rank notes, the
autotune decision, the corpus cache's plan and notes); the checkpoint folder's renames (shardlab.checkpoint.layout)
and the corpus cache's shards fsync through ``fsync_path``. Torch-free, for the LM's preprocessing workers.
"""

from __future__ import annotations

import json
import os
import secrets
from pathlib import Path
from typing import Any


def fsync_path(path: Path) -> None:
    """Make a file's data, or a folder's entries (new files, renames), durable; a rename is only as safe as its
    parent's fsync."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json_durably(path: Path, obj: Any) -> None:
    """Write ``path`` in place and fsync it: not atomic, a kill mid-write leaves a torn file. Only for a file inside a
    folder that is renamed into place whole afterwards (shardlab.checkpoint.layout's ``publish``: shardlab.json in
    step_N.tmp), which no reader sees before the rename and ``clean_stale`` deletes after a kill; anywhere else,
    ``write_json_atomic``."""
    with open(path, "w") as f:
        f.write(json.dumps(obj, indent=1))
        f.flush()
        os.fsync(f.fileno())


def write_json_atomic(path: Path, obj: Any, *, indent: int | None = None, durable: bool = False) -> None:
    """Replace ``path`` with ``obj`` as JSON whole: a reader, or a kill at any instant, sees the old file or the new
    one, never part of one. The temp file beside it has a unique name (processes on other hosts, threads) and is
    removed on any failure, which is raised. ``durable``: fsync the file and then the folder, so the new content also
    survives a power loss or node crash once this returns."""
    text = json.dumps(obj, indent=indent)  # before any file exists: an object that cannot be written changes nothing
    # Not tempfile.mkstemp: its 0600 would replace the file's umask permissions (status.json is read by others).
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        with open(tmp, "x") as f:
            f.write(text)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if durable:
        fsync_path(path.parent)


def umask() -> int:
    """This process's umask, read without setting it where Linux shows it (``os.umask`` sets it for every thread)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    current = os.umask(0o022)
    os.umask(current)
    return current


def follow_umask(path: Path) -> Path:
    """Give a file another library wrote with 0600 (safetensors' save_file) the mode a file created here gets, 0666
    less the umask: a consolidated model or an adapter is meant to be read by others where the umask says so."""
    os.chmod(path, 0o666 & ~umask())
    return path
