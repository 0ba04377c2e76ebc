"""Ranks join a job in two steps: each prepares its data on its own (preprocessing may take minutes or hours), then
they meet through the launcher's rendezvous store and agree that they opened the same data - all before the process
group exists, so nothing slow ever runs under distributed.timeout_s.

While a rank prepares, a thread bumps a heartbeat counter in the store; rank 0, once ready itself, waits for the
others, and gives up on a rank whose heartbeat stopped (a killed process, a lost node) or that never appeared. Rank 0
then decides - the same data everywhere, or the first failure or difference - and every rank reads that verdict, so
all stop with one message or all go on together. A rank that fails before it reaches the join (a config or path
error on its node) says so in the store too (``tell_peers_before_joining``), so the others stop at once instead of
waiting ``APPEAR_S`` for it.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from collections.abc import Callable
from datetime import timedelta

from torch.distributed import Store, TCPStore

from shardlab.distributed.network import WAIT_NOTE_S
from shardlab.errors import DataError, RankFailed

HEARTBEAT_S = 2.0
STALL_S = 120.0
"""A preparing rank whose heartbeat has not moved for this long (by rank 0's clock) is taken for dead."""
APPEAR_S = 600.0
"""How long rank 0 waits for a rank that never connected to the store (a slow start, a node not up yet)."""
POLL_S = 0.2
EARLY_CONNECT_S = 60.0
"""How long a rank that failed before joining tries to reach the store to say so: a rank 0 that hosts it starts it
only once its own checks passed, often seconds after another rank's config check failed."""
EARLY_LINGER_S = 60.0
"""How long rank 0, failing before the join in a store it hosts, keeps it up for the others to read why (each one
that has read it or failed too shortens the wait)."""

_joins_in_process = 0
"""Joins so far in this process (tests run several jobs in one set of processes), counting a failure told before one:
each gets its own keys, and a process that took part in one has its failures known there."""


def agent_hosts_store(env) -> bool:
    """torchrun's agent hosts the job's store (TORCHELASTIC_USE_AGENT_STORE), not rank 0."""
    return env.launcher == "torchrun" and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"


def _prefix(number: int, attempt: int | None = None) -> str:
    """The store keys of this process's ``number``-th join in ``attempt`` (default: torchrun's restart count)."""
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) if attempt is None else attempt
    return f"shardlab/join/{attempt}/{number}/"


def _arrive(store: Store, number: int, rank: int) -> str:
    """The keys of this rank's ``number``-th join, its arrival marked there. torchrun's store outlives restarted
    workers, so each attempt has keys of its own; but TORCHELASTIC_RESTART_COUNT is each node's own count (an agent
    restarts its healthy workers when another node's failed ones rejoin, without counting it), so it is only where a
    rank starts looking: it takes the first attempt from there it has not taken part in, as every rank of the new
    attempt does. (A rank of a node whose count lags that never reached the store in the failed attempt would still
    take that one.)"""
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    while store.check([_Keys(_prefix(number, attempt)).arrived(rank)]):
        attempt += 1
    keys = _Keys(_prefix(number, attempt))
    store.set(keys.arrived(rank), str(os.getpid()))
    return keys.prefix


def prepare_and_agree(
    store: Store,
    rank: int,
    world_size: int,
    prepare: Callable[[], str],
    prefix: str | None = None,
    route: dict | None = None,
    appear_s: float = APPEAR_S,
) -> list[dict | None]:
    """Run ``prepare()`` (this rank's data; returns what it opened, e.g. token counts and a content hash) with a
    heartbeat, then wait until every rank has, and raise on every rank if one failed or opened other data. Returns
    every rank's ``route`` (what it sees of the network: shardlab.distributed.network.Route), in rank order.
    ``prefix``: the store keys of this join (default: one per join in this process and attempt, see ``_arrive``);
    ``appear_s``: how long rank 0 waits for a rank that never connected (distributed.init_timeout_s)."""
    global _joins_in_process
    _joins_in_process += 1
    number = _joins_in_process
    keys = _Keys(prefix or _arrive(store, number, rank))
    if rank > 0 and store.check([keys.verdict]):  # rank 0 failed before joining: no need to prepare anything
        _raise_if_failed(_read_verdict(store, keys))
    stop = threading.Event()
    beat = threading.Thread(target=_heartbeat, args=(store, keys.alive(rank), stop), daemon=True)
    beat.start()
    try:
        try:
            identity = prepare()
        except BaseException as e:
            message = str(e) if isinstance(e, (DataError, RankFailed)) else f"{type(e).__name__}: {e}"
            _post_failure(store, keys, rank, f"rank {rank} could not prepare its data: {message}")
            raise
        ready = {"data": identity, "host": socket.gethostname(), "route": route}
        store.set(keys.ready(rank), json.dumps(ready))
        store.add(keys.count, 1)
        if rank == 0:
            store.set(keys.verdict, json.dumps(_decide(store, keys, world_size, appear_s)))
        verdict = _wait_for_verdict(store, keys)
    finally:
        stop.set()
        beat.join()
    _raise_if_failed(verdict)
    return verdict["routes"]


def _raise_if_failed(verdict: dict) -> None:
    if "error" in verdict:
        error = DataError if verdict.get("data") else RankFailed
        raise error(verdict["error"])


def tell_peers_before_joining(env, message: str) -> None:
    """This rank failed before it reached the join (``env``: its DistEnv): post ``message`` where the join's rank 0
    looks, so every rank stops with it now. Best effort, bounded by EARLY_CONNECT_S (and EARLY_LINGER_S for a rank 0
    that hosts the store); nothing to do for one process, a rank that already took part in a join, or shardlab's own
    local ranks (their launcher stops the others when one exits)."""
    global _joins_in_process
    if env.world_size <= 1 or env.launcher in ("none", "local") or _joins_in_process:
        return
    _joins_in_process += 1
    number = _joins_in_process  # this join's number, read once: the global may move on while the store starts
    hosts = env.rank == 0 and not agent_hosts_store(env)
    try:
        store = TCPStore(
            env.master_addr, env.master_port, world_size=env.world_size, is_master=hosts,
            timeout=timedelta(seconds=EARLY_CONNECT_S), wait_for_workers=False, multi_tenant=True,
        )  # fmt: skip
        keys = _Keys(_arrive(store, number, env.rank))
        _post_failure(store, keys, env.rank, f"rank {env.rank} failed before joining: {message}")
        if hosts:  # the store ends with this process: keep it until the others have read the verdict (or failed)
            deadline = time.monotonic() + EARLY_LINGER_S
            while store.add(keys.done, 0) < env.world_size - 1:
                if time.monotonic() > deadline:
                    break
                time.sleep(POLL_S)
    except Exception:  # no store to reach: the others find out as before (APPEAR_S, or their launcher)
        pass


def cannot_tell_peers() -> None:
    """This rank cannot reach the job's store (network.wait_for_master gave up): nothing can be told, now or later."""
    global _joins_in_process
    _joins_in_process += 1


def _post_failure(store: Store, keys: _Keys, rank: int, message: str) -> None:
    if rank == 0:
        store.set(keys.verdict, json.dumps({"error": message}))
    else:
        store.set(keys.failed(rank), message)
        store.add(keys.count, 1)
        store.add(keys.done, 1)


class _Keys:
    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.count = prefix + "count"
        self.verdict = prefix + "verdict"
        self.done = prefix + "done"
        """Ranks that are through with this join: read the verdict, or posted their own failure."""

    def arrived(self, rank: int) -> str:
        return f"{self.prefix}arrived/{rank}"

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


def _decide(store: Store, keys: _Keys, world_size: int, appear_s: float = APPEAR_S) -> dict:
    """Rank 0: wait for every rank's result (giving up on dead ones, and on waiting at all once one rank failed: a
    launcher may already have stopped that rank's neighbours), saying every WAIT_NOTE_S who it still waits for; the
    verdict every rank will read."""
    started = noted = time.monotonic()
    beats: dict[int, tuple[int, float]] = {}  # rank -> (last counter seen, when it last moved)

    def first_failure() -> dict | None:
        failed = next((r for r in range(1, world_size) if store.check([keys.failed(r)])), None)
        return None if failed is None else {"error": store.get(keys.failed(failed)).decode()}

    while store.add(keys.count, 0) < world_size:
        if failure := first_failure():
            return failure
        now = time.monotonic()
        absent, preparing = [], []
        for r in range(1, world_size):
            if store.check([keys.ready(r)]):
                continue
            if not store.check([keys.alive(r)]):
                if now - started > appear_s:
                    return {
                        "error": f"rank {r} never joined ({appear_s:.0f} s, distributed.init_timeout_s); see its log "
                        "(a node that did not start, or cannot reach this one)"
                    }
                absent.append(r)
                continue
            preparing.append(r)
            counter = store.add(keys.alive(r), 0)
            last, moved = beats.get(r, (None, now))
            if counter != last:
                beats[r] = (counter, now)
            elif now - moved > STALL_S:
                return {"error": f"rank {r} stopped while preparing its data (no heartbeat for {STALL_S:.0f} s)"}
        if now - noted >= WAIT_NOTE_S:
            noted = now
            print(f"[rank 0] waiting for ranks to join ({now - started:.0f} s): {world_size - len(absent)} of "
                  f"{world_size} connected; not yet: {_ranks(absent)}; preparing their data: {_ranks(preparing)}",
                  flush=True)  # fmt: skip
        time.sleep(1.0)
    if failure := first_failure():  # a failing rank counts itself in too
        return failure
    opened = [json.loads(raw) for raw in store.multi_get([keys.ready(r) for r in range(world_size)])]
    for r, other in enumerate(opened):
        if other["data"] != opened[0]["data"]:
            return {
                "data": True,
                "error": f"the ranks opened different data: rank 0 ({opened[0]['host']}) {opened[0]['data']}, rank "
                f"{r} ({other['host']}) {other['data']}; give every rank the same data (node-local copies must hold "
                "the same files)",
            }
    return {"ok": True, "routes": [other.get("route") for other in opened]}


def _ranks(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks[:16])) + (f" and {len(ranks) - 16} more" if len(ranks) > 16 else "") or "none"


def _wait_for_verdict(store: Store, keys: _Keys) -> dict:
    while not store.check([keys.verdict]):
        time.sleep(POLL_S)
    return _read_verdict(store, keys)


def _read_verdict(store: Store, keys: _Keys) -> dict:
    verdict = json.loads(store.get(keys.verdict))
    store.add(keys.done, 1)  # a rank 0 that failed before joining keeps its store up until the others have read it
    return verdict


def store_timeout(timeout_s: float) -> timedelta:
    """How long a rank may take to reach the store at start-up (not a collective: ranks start at different speeds)."""
    return timedelta(seconds=max(timeout_s, APPEAR_S))
