"""Files on disk, the way every part of shardlab touches them: below checkpoint/ and jobs/, which both lean on it.

- ``regular_file``: the one reader of an untrusted file (a step folder's, the run lock, a corpus, a pretrained weights
  file): opened as a regular file or refused in one line, never through a link out of its folder, never a FIFO,
  capped in size.
- ``durable``: writes a kill cannot tear (``write_json_atomic``: status.json, tracker ids, caches) and the fsyncs that
  make a rename survive a power loss (the checkpoint folder's, the corpus cache's).
- ``liveness``: whether a lock's holder still runs (its pid and start time on this host, its heartbeat from another):
  the run lock's and the corpus cache's.

Torch-free and light: the LM's preprocessing workers, the run lock and status.json import it.
"""

from __future__ import annotations

__all__ = ["durable", "liveness", "regular_file"]
