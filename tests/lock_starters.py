"""Starters racing for run locks, shared by the lock tests (tests/unit/test_lock_file.py, test_run_lock.py): forked
processes that each take the lock of the same run folders at the same moments, folder after folder, a barrier apart.
A test runs ``race`` in a child process of its own (``python -c``), so the forks start from a fresh interpreter."""

from __future__ import annotations

import json
import multiprocessing as mp
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from shardlab.errors import RunFolderInUse
from shardlab.jobs import run_lock

folder = 0
"""The number of the folder this starter takes now: a patch may pace itself by it."""


def dead_holders(root: Path, folders: int) -> None:
    """Run folders run0 .. run<folders-1> under ``root``, each holding the lock of a job of this host that died."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    holder = {"job": None, "host": run_lock.socket.gethostname(), "pid": dead.pid, "token": "dead"}
    for i in range(folders):
        (root / f"run{i}").mkdir()
        (root / f"run{i}" / run_lock.LOCK_FILE).write_text(json.dumps(holder))


def race(
    root: Path, starters: int, folders: int, patch: Callable[[int], None] | None = None
) -> dict[tuple[int, int], bool]:
    """Whether starter ``who`` held the lock of folder ``i`` (``root/run<i>``), keyed ``(who, i)``: ``starters``
    forked processes, each calling ``patch(who)`` first (to slow its judging, say), take each folder's lock at once."""
    ctx = mp.get_context("fork")
    barrier, held = ctx.Barrier(starters), ctx.Manager().dict()
    jobs = [ctx.Process(target=_starter, args=(root, barrier, held, who, folders, patch)) for who in range(starters)]
    for job in jobs:
        job.start()
    for job in jobs:
        job.join()
    return dict(held)


def _starter(root: Path, barrier, held, who: int, folders: int, patch: Callable[[int], None] | None) -> None:
    global folder
    run_lock.HEARTBEAT_S = 3600
    if patch is not None:
        patch(who)
    for folder in range(folders):
        barrier.wait()
        try:
            run_lock.RunLock(root / f"run{folder}").acquire()
            held[(who, folder)] = True
        except RunFolderInUse:
            held[(who, folder)] = False
    barrier.wait()  # no one exits while another may still read its lock: a dead holder's lock is rightly stale
