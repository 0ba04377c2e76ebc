"""Ranks join a job in two steps: each prepares its data on its own (preprocessing may take minutes or hours), then
they meet through the launcher's rendezvous store and agree that they opened the same data - all before the process
group exists, so nothing slow ever runs under distributed.timeout_s.

While a rank prepares, a thread bumps a heartbeat counter in the store; rank 0, once ready itself, waits for the
others, and gives up on a rank whose heartbeat stopped (a killed process, a lost node) or that never appeared. Rank 0
then decides - the same data everywhere, or the first failure or difference - and every rank reads that verdict, so
all stop with one message or all go on together.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from collections.abc import Callable
from datetime import timedelta

from torch.distributed import Store

from shardlab.errors import DataError, RankFailed

HEARTBEAT_S = 2.0
STALL_S = 120.0
"""A preparing rank whose heartbeat has not moved for this long (by rank 0's clock) is taken for dead."""
APPEAR_S = 600.0
"""How long rank 0 waits for a rank that never connected to the store (a slow start, a node not up yet)."""
POLL_S = 0.2

_joins_in_process = 0
"""Joins so far in this process (tests run several jobs in one set of processes): each gets its own keys."""


def _prefix() -> str:
    global _joins_in_process
    _joins_in_process += 1
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")  # torchrun's store outlives a restarted worker
    return f"shardlab/join/{restart}/{_joins_in_process}/"


def prepare_and_agree(
    store: Store, rank: int, world_size: int, prepare: Callable[[], str], prefix: str | None = None
) -> None:
    """Run ``prepare()`` (this rank's data; returns what it opened, e.g. token counts and a content hash) with a
    heartbeat, then wait until every rank has, and raise on every rank if one failed or opened other data.
    ``prefix``: the store keys of this join (default: one per join in this process and torchrun restart)."""
    keys = _Keys(prefix or _prefix())
    stop = threading.Event()
    beat = threading.Thread(target=_heartbeat, args=(store, keys.alive(rank), stop), daemon=True)
    beat.start()
    try:
        try:
            identity = prepare()
        except BaseException as e:
            message = str(e) if isinstance(e, (DataError, RankFailed)) else f"{type(e).__name__}: {e}"
            if rank == 0:
                store.set(keys.verdict, json.dumps({"error": f"rank 0 could not prepare its data: {message}"}))
            else:
                store.set(keys.failed(rank), message)
                store.add(keys.count, 1)
            raise
        store.set(keys.ready(rank), json.dumps({"data": identity, "host": socket.gethostname()}))
        store.add(keys.count, 1)
        if rank == 0:
            store.set(keys.verdict, json.dumps(_decide(store, keys, world_size)))
        verdict = _wait_for_verdict(store, keys)
    finally:
        stop.set()
        beat.join()
    if "error" in verdict:
        error = DataError if verdict.get("data") else RankFailed
        raise error(verdict["error"])


class _Keys:
    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.count = prefix + "count"
        self.verdict = prefix + "verdict"

    def alive(self, rank: int) -> str:
        return f"{self.prefix}alive/{rank}"

    def ready(self, rank: int) -> str:
        return f"{self.prefix}ready/{rank}"

    def failed(self, rank: int) -> str:
        return f"{self.prefix}failed/{rank}"


def _heartbeat(store: Store, key: str, stop: threading.Event) -> None:
    while True:
        try:
            store.add(key, 1)
        except Exception:  # the store went away (rank 0 ended): the main thread finds out on its next call
            return
        if stop.wait(HEARTBEAT_S):
            return


def _decide(store: Store, keys: _Keys, world_size: int) -> dict:
    """Rank 0: wait for every rank's result (giving up on dead ones); the verdict every rank will read."""
    started = time.monotonic()
    beats: dict[int, tuple[int, float]] = {}  # rank -> (last counter seen, when it last moved)
    while store.add(keys.count, 0) < world_size:
        now = time.monotonic()
        for r in range(1, world_size):
            if store.check([keys.ready(r)]) or store.check([keys.failed(r)]):
                continue
            if not store.check([keys.alive(r)]):
                if now - started > APPEAR_S:
                    return {"error": f"rank {r} never joined ({APPEAR_S:.0f} s); see its log"}
                continue
            counter = store.add(keys.alive(r), 0)
            last, moved = beats.get(r, (None, now))
            if counter != last:
                beats[r] = (counter, now)
            elif now - moved > STALL_S:
                return {"error": f"rank {r} stopped while preparing its data (no heartbeat for {STALL_S:.0f} s)"}
        time.sleep(1.0)
    for r in range(1, world_size):
        if store.check([keys.failed(r)]):
            return {"error": f"rank {r} could not prepare its data: {store.get(keys.failed(r)).decode()}"}
    opened = [json.loads(raw) for raw in store.multi_get([keys.ready(r) for r in range(world_size)])]
    for r, other in enumerate(opened):
        if other["data"] != opened[0]["data"]:
            return {
                "data": True,
                "error": f"the ranks opened different data: rank 0 ({opened[0]['host']}) {opened[0]['data']}, rank "
                f"{r} ({other['host']}) {other['data']}; give every rank the same data (node-local copies must hold "
                "the same files)",
            }
    return {"ok": True}


def _wait_for_verdict(store: Store, keys: _Keys) -> dict:
    while not store.check([keys.verdict]):
        time.sleep(POLL_S)
    return json.loads(store.get(keys.verdict))


def store_timeout(timeout_s: float) -> timedelta:
    """How long a rank may take to reach the store at start-up (not a collective: ranks start at different speeds)."""
    return timedelta(seconds=max(timeout_s, APPEAR_S))
