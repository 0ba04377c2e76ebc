"""Is the holder of a lock alive? The checks of the run lock (shardlab.jobs.run_lock): a process of this host by its
pid and its start time (a reused pid is not the holder), and a heartbeat (a file's mtime) that a holder on another host
touches and a watcher sees change on its own clock. (The corpus cache's lock, shardlab_tasks/lm/corpus/cache_lock.py,
gets the same two checks from filelock's SoftFileLease.)
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any


def process_start(pid: int) -> str | None:
    """When ``pid`` started (clock ticks since boot, from /proc), so a reused pid is told from the holder."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def process_alive(pid: int, started: str | None = None) -> bool:
    """Whether process ``pid`` of this host runs, and is the one that started at ``started`` (if known)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # someone else's process: it exists
    return started is None or process_start(pid) in (None, started)


def touch(path: Path) -> None:
    """A heartbeat: a new mtime for ``path``, the wall time or a second past its mtime now, whichever is later, so
    that it changes even where the file system keeps whole seconds or this host's clock stepped back. Watchers look
    for the change, never compare it with a clock."""
    beat = max(time.time_ns(), os.stat(path).st_mtime_ns + 1_000_000_000)
    os.utime(path, ns=(beat, beat))


class HeartbeatWatch:
    """How long a holder's heartbeat (a lock's mtime, with its bytes for the run lock) has stayed the same, on this
    process's monotonic clock (never the holder's wall clock, which may run on another host, skewed): a watcher that
    sees it change knows the holder is alive."""

    def __init__(self) -> None:
        self.value: Any = None
        self.since: float | None = None
        self.changed = False
        """Whether the value changed after this watch first saw it."""

    def see(self, value: Any) -> float:
        """Seconds ``value`` has been seen unchanged (0 when it is new or changed)."""
        now = time.monotonic()
        if self.since is None or value != self.value:
            self.changed = self.since is not None
            self.value, self.since = value, now
        return now - self.since
