"""Checkpoints that are never lost and resume on any world size.

- ``manager``: ``Checkpointer``, the object the trainer saves through: save (sync or async), prune.
- ``resume``: the trainer's start, in one place (``restore_training``, its one entry): the folder's run or
  checkpoint.resume, else ``checkpoint.init_from``'s weights, else the seeded init. ``resume.line``: where a run
  began, so a requeue continues its own run whatever checkpoint.resume says; ``resume.candidates``: which step (rank 0
  decides, every rank agrees), loading it, what an unreadable checkpoint is, and rollbacks.
- ``policy``: when a run saves (interval_steps, milestones, interval_minutes), and checkpoint.save_on_error.
- ``agreement``: rank 0's decisions and any rank's failure, the same on every rank.
- ``readers``: the hardened readers of a step folder (reading never runs code): ``dcp_reader``, DCP's reader with its
  .metadata pickle read through an allow-list; ``metadata_pickle`` its interpreter, ``saved_values`` the values and
  chunks of the shard files; each file opened through shardlab.files.regular_file.
- ``layout``: the folder on disk (``step_N/``, ``shardlab.json``), its renames (through shardlab.files.durable),
  pruning rules.
- ``async_save``: ``checkpoint.async_save``: staging buffers and the background write.
- ``weights``: a model's weights outside training: read a step folder whole, write and read one safetensors file,
  ``checkpoint.init_from``; used by shardlab-consolidate, generate.py and export_hf.py.

What a checkpoint restores besides the weights and optimizer state is the training state, shardlab.train_state.
Importing the package is light (no torch): ``layout`` serves torch-free code (shardlab_bench/kill_loop.py), and the rest
loads on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["Checkpointer", "layout", "weights"]


def __getattr__(name: str) -> Any:
    if name == "Checkpointer":
        from shardlab.checkpoint.manager import Checkpointer

        return Checkpointer
    if name in ("layout", "weights", "manager", "async_save"):
        return importlib.import_module(f"shardlab.checkpoint.{name}")
    raise AttributeError(f"module 'shardlab.checkpoint' has no attribute {name!r}")
