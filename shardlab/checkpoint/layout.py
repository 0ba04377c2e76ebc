"""Where checkpoints live on disk and how they change there: names, listing, durable writes and renames, pruning.

Rank 0 alone calls what changes the folder (the manager decides when); every change is a rename or a write that is
fsynced with its folder, so a kill at any instant leaves each step_N either complete or absent.

The durable writes themselves (``fsync_path``, ``write_json_durably``, ``write_json_atomic``) are
shardlab.files.durable's, which every small JSON file a run keeps outside checkpoints shares (status.json, tracker
ids, rank notes, caches).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

from shardlab.errors import CheckpointError
from shardlab.files.durable import fsync_path, write_json_durably

STEP_DIR = re.compile(r"^step_(\d+)$")
META_FILE = "shardlab.json"
META_MAX_BYTES = 64 * 2**20
"""A shardlab.json larger than this is refused unread (a config and the training state's counters: kilobytes)."""
TMP, PRUNING, REPLACED = ".tmp", ".pruning", ".replaced"
"""Suffixes of folders that are not checkpoints: being written, being deleted, being replaced (restored at start if
the run died between the two renames of a replacement)."""


def step_name(step: int) -> str:
    return f"step_{step:08d}"


def complete_checkpoints(root: Path) -> list[Path]:
    """Finished checkpoints under ``root``, oldest step first."""
    if not root.is_dir():
        return []
    found = [
        (int(m.group(1)), p) for p in root.iterdir() if (m := STEP_DIR.match(p.name)) and (p / META_FILE).is_file()
    ]
    return [p for _, p in sorted(found)]


def read_meta(path: Path) -> dict[str, Any]:
    from shardlab.files.regular_file import read_regular  # a regular file of the folder, capped (issue 41)

    meta_file = path / META_FILE
    try:
        return json.loads(read_regular(meta_file, max_bytes=META_MAX_BYTES))
    except FileNotFoundError:
        raise CheckpointError(
            f"{path} is not a complete shardlab checkpoint (no {META_FILE}); "
            "point checkpoint.resume at a step_N directory that has one"
        ) from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{meta_file} is unreadable ({e}); delete that checkpoint or resume from another") from e


# ---- the folder's changes (rank 0), each a rename or a write fsynced with its folder ------------------------------
def set_aside(path: Path, reason: str) -> Path:
    """Rename ``path`` to ``<name>.<reason>-<k>`` (first free k): kept for the user, invisible to resume."""
    k = 1
    while (target := path.with_name(f"{path.name}.{reason}-{k}")).exists():
        k += 1
    os.replace(path, target)
    return target


def remove(path: Path) -> None:
    """Delete a checkpoint folder: renamed first, so a run killed mid-delete never leaves a torn step_N."""
    doomed = path.with_name(path.name + PRUNING)
    os.replace(path, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def clean_stale(root: Path) -> list[str]:
    """Start of a run: drop unfinished writes and deletions, and finish a replacement a kill interrupted."""
    done: list[str] = []
    if not root.is_dir():
        return done
    for p in sorted(root.iterdir()):
        if p.name.startswith("step_") and p.name.endswith((TMP, PRUNING)):
            shutil.rmtree(p, ignore_errors=True)
            done.append(f"removed {p.name}")
        elif p.name.startswith("step_") and p.name.endswith(REPLACED):
            final = p.with_name(p.name.removesuffix(REPLACED))
            if (final / META_FILE).is_file():
                shutil.rmtree(p, ignore_errors=True)
            else:  # killed between the two renames: the old checkpoint is still the complete one
                os.replace(p, final)
                done.append(f"restored {final.name}")
    if done:
        fsync_path(root)
    return done


def publish(tmp: Path, final: Path, meta: dict[str, Any]) -> None:
    """Rank 0, after every rank's shards are durable in ``tmp``: write shardlab.json, fsync, rename into place."""
    write_json_durably(tmp / META_FILE, meta)
    fsync_path(tmp)
    if final.exists():  # a re-save of the same step: the old one stays until the new one has its name
        old = final.with_name(final.name + REPLACED)
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
        os.replace(tmp, final)
        fsync_path(final.parent)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)
    fsync_path(final.parent)


def save_index(path: Path) -> int:
    """The save counter of a checkpoint (0 for ones written before it existed, or with an unreadable shardlab.json)."""
    from shardlab.files.regular_file import read_json_or_none

    meta = read_json_or_none(path / META_FILE)
    try:
        return int(meta.get("save_index", 0)) if isinstance(meta, dict) else 0
    except (ValueError, TypeError, OverflowError):
        return 0


def to_prune(checkpoints: list[Path], keep_last: int, keep_every_steps: int) -> list[Path]:
    """All but the ``keep_last`` most recently written (by save counter, then step) and the milestones."""
    order = sorted(checkpoints, key=lambda p: (save_index(p), int(STEP_DIR.match(p.name).group(1))))
    milestone = lambda p: keep_every_steps > 0 and int(STEP_DIR.match(p.name).group(1)) % keep_every_steps == 0
    return [p for p in order[:-keep_last] if not milestone(p)]
