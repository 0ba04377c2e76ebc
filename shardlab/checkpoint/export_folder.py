"""Where an export may write: a new folder, an empty one, or one an earlier export wrote; never a folder it did not
write, never one a run reads from.

An export's ``--out`` is replaced whole once the new folder is complete (``staged_folder``), so a wrong ``--out``
would delete what is there: the model a LoRA run still names as its frozen base, the step folder being exported, the
run's folder. ``out_refusal`` says why an ``--out`` may not be written, before anything is read or written: it is a
symbolic link (what it leads to is not the export's), it is, is inside or contains one of the paths the caller
protects (the step folder, the run folder, model.pretrained, checkpoint.init_from...), or it holds files and no
``EXPORT_MARKER`` (the file every export writes, so the next one knows the folder as its own). Torch-free.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

from shardlab.errors import ConfigError
from shardlab.files.regular_file import NotAFile, stat_file

EXPORT_MARKER = "shardlab_export.json"
"""The file each export writes into its folder: a folder that holds files is replaced only when it has this one."""


def _relation(out: Path, protected: Path) -> str | None:
    """How the real path ``out`` lies to the real path ``protected``: "is", "is inside", "contains", or None."""
    if out == protected:
        return "is"
    if out.is_relative_to(protected):
        return "is inside"
    return "contains" if protected.is_relative_to(out) else None


def is_export(folder: Path) -> bool:
    """Whether ``folder`` holds the marker an export writes, as a regular file of its own (no link)."""
    try:
        stat_file(folder / EXPORT_MARKER)
    except (OSError, NotAFile):
        return False
    return True


def out_refusal(out: Path, protected: Mapping[str, Path | str | None]) -> str | None:
    """Why the export may not write ``out`` (the end of a line that starts with "--out "), or None when it may.
    ``protected``: what the export reads, by its name in words ("the step folder", "model.pretrained"), each of
    which ``out`` may not be, lie inside or contain (links resolved on both sides)."""
    out = Path(out).expanduser()
    if out.is_symlink():
        return f"{out} is a symbolic link (to {os.path.realpath(out)}); give the path of a new folder"
    real = Path(os.path.realpath(out))
    for what, path in protected.items():
        if not path:
            continue
        relation = _relation(real, Path(os.path.realpath(Path(path).expanduser())))
        if relation is not None:
            return f"{out} {relation} {what} ({path}), which the export must not replace; give a new folder"
    if not os.path.lexists(out):
        return None
    if not out.is_dir():
        return f"{out} exists and is not a folder; give the path of a new folder"
    if any(out.iterdir()) and not is_export(out):
        return (
            f"{out} holds files an export did not write (no {EXPORT_MARKER}); give a new or empty folder, the "
            "export replaces the folder whole"
        )
    return None


@contextmanager
def staged_folder(out: Path, protected: Mapping[str, Path | str | None] | None = None) -> Iterator[Path]:
    """A fresh folder beside ``out`` to write into, with ``EXPORT_MARKER`` in it, put in ``out``'s place only once
    the block completes: an export cut short leaves ``out`` as it was, and running it again over an earlier export
    replaces it whole. Refused (ConfigError, nothing written) where ``out_refusal`` says so."""
    if reason := out_refusal(out, protected or {}):
        raise ConfigError(f"--out {reason}")
    out = Path(out).expanduser().absolute()
    out.parent.mkdir(parents=True, exist_ok=True)
    staging, old = (out.parent / f".{out.name}.{tag}-{os.getpid()}" for tag in ("partial", "replaced"))
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    try:
        yield staging
        (staging / EXPORT_MARKER).write_text(json.dumps({"written_by": "shardlab-export"}) + "\n")
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    if out.exists():
        out.rename(old)
    staging.rename(out)
    shutil.rmtree(old, ignore_errors=True)
