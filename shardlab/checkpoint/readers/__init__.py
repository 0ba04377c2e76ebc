"""The hardened readers of a step folder: every path that reads a checkpoint (resume, ``checkpoint.init_from``, an
export, shardlab-consolidate) comes through here, and reading never runs code from the folder.

- ``dcp_reader``: DCP's reader with its ``.metadata`` pickle read through an allow-list (``read_metadata``, ``load``,
  ``SafeReader``), and what a torn or crafted folder is (``integrity_defect``).
- ``metadata_pickle``: the interpreter of that pickle (``MetadataUnpickler``) and the tables of what it may name,
  call and build.
- ``saved_values``: the small values and tensor chunks of the shard files (``ValueUnpickler``), bounded in depth and
  size.

Each file is opened through shardlab.files.regular_file. The everyday save and resume path (shardlab.checkpoint's
manager, resume, restore) only calls ``dcp_reader``; the rest is defence a newcomer tracing a resume may skip.
"""

from __future__ import annotations

__all__ = ["dcp_reader", "metadata_pickle", "saved_values"]
