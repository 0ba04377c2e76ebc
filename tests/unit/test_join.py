"""Ranks meet before the process group exists (shardlab.distributed.join), through a real TCPStore, one thread per
rank: they go on together when they opened the same data, and all stop with rank 0's one message when one rank
failed, opened other data, or died while preparing."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from datetime import timedelta

import pytest
from torch.distributed import TCPStore

from shardlab.distributed import join
from shardlab.distributed.env import DistEnv, free_port
from shardlab.errors import DataError, RankFailed
from tests.conftest import ROOT, TINY_LM


def run_ranks(prepares: list, prefix: str | list[str], port: int | None = None) -> list[BaseException | None]:
    """prepare_and_agree on one thread per rank (rank 0 hosts the store, unless ``port`` names a running one); each
    rank's exception, or None. ``prefix``: the join's keys, one for all ranks or one per rank."""
    hosts, port = port is None, port or free_port()
    stores = [TCPStore("127.0.0.1", port, len(prepares), hosts and r == 0, timedelta(seconds=30),
                       wait_for_workers=False) for r in range(len(prepares))]  # fmt: skip
    prefixes = prefix if isinstance(prefix, list) else [prefix] * len(prepares)
    outcome: list[BaseException | None] = [None] * len(prepares)

    def rank(r: int) -> None:
        try:
            join.prepare_and_agree(stores[r], r, len(prepares), prepares[r], prefixes[r])
        except BaseException as e:  # noqa: B036  (recorded for the test)
            outcome[r] = e

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(len(prepares))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
        assert not t.is_alive(), "a rank hung"
    return outcome


def test_ranks_that_opened_the_same_data_go_on_together_however_long_one_prepares():
    def slow():
        time.sleep(2 * join.HEARTBEAT_S)  # longer than any poll; not a collective, so no timeout applies
        return "100 train / 10 valid tokens (abc)"

    assert run_ranks([lambda: "100 train / 10 valid tokens (abc)", slow], "same/") == [None, None]


def test_ranks_that_opened_different_data_all_refuse_with_rank_zeros_message():
    outcome = run_ranks([lambda: "100 tokens (abc)", lambda: "100 tokens (abc)", lambda: "90 tokens (def)"], "diff/")
    assert all(isinstance(e, DataError) for e in outcome)
    assert len({str(e) for e in outcome}) == 1
    assert str(outcome[0]).startswith("the ranks opened different data: rank 0 (")
    assert "100 tokens (abc), rank 2" in str(outcome[0]) and "90 tokens (def)" in str(outcome[0])


def test_a_rank_whose_data_fails_stops_every_rank():
    def bad():
        raise DataError("data.path: /nodelocal/corpus does not exist")

    outcome = run_ranks([lambda: "x", bad], "fail/")
    assert isinstance(outcome[1], DataError)  # its own error, as raised
    assert isinstance(outcome[0], RankFailed)
    assert str(outcome[0]) == "rank 1 could not prepare its data: data.path: /nodelocal/corpus does not exist"


def test_rank_zero_failing_stops_the_others():
    def bad():
        raise DataError("broken corpus")

    outcome = run_ranks([bad, lambda: "x"], "fail0/")
    assert isinstance(outcome[0], DataError)
    assert str(outcome[1]) == "rank 0 could not prepare its data: broken corpus"


def test_a_rank_that_died_while_preparing_is_given_up_on(monkeypatch):
    monkeypatch.setattr(join, "STALL_S", 1.5)
    port = free_port()
    master = TCPStore("127.0.0.1", port, 2, True, timedelta(seconds=30), wait_for_workers=False)
    dead = TCPStore("127.0.0.1", port, 2, False, timedelta(seconds=30))
    dead.add("dead/alive/1", 1)  # rank 1 started preparing, then its process (and heartbeat) ended
    with pytest.raises(RankFailed, match=r"rank 1 stopped while preparing its data \(no heartbeat for 2 s\)"):
        join.prepare_and_agree(master, 0, 2, lambda: "x", "dead/")


def test_after_a_torchrun_restart_counted_on_one_node_only_the_ranks_agree_on_fresh_keys(monkeypatch):
    """Two nodes join, then node A's rank fails and its agent restarts it (restart count 1); node B's agent restarts
    its healthy rank when A rejoins, without counting it (0). Both must meet in the new attempt's keys: by the count
    alone, A waited for B in empty keys until APPEAR_S while B passed at once on the old attempt's verdict."""
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    port = free_port()
    server = TCPStore("127.0.0.1", port, 2, True, timedelta(seconds=30), wait_for_workers=False)
    attempt_0 = [join._arrive(server, 1, rank) for rank in (0, 1)]  # count 0 everywhere
    assert run_ranks([lambda: "data", lambda: "data"], attempt_0, port) == [None, None]
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    node_a = join._arrive(server, 1, 0)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    node_b = join._arrive(server, 1, 1)
    assert node_a == node_b == join._prefix(1, attempt=1)
    outcome = run_ranks([lambda: "data", lambda: "other data"], [node_a, node_b], port)  # a real new agreement
    assert all(isinstance(e, DataError) and "the ranks opened different data" in str(e) for e in outcome)


# ---- a rank that fails before it reaches the join (a config or path error on its node) -------------------------------
def test_a_rank_failing_before_the_join_stops_rank_zero_without_waiting_for_its_stopped_neighbours(monkeypatch):
    """Rank 1 fails its config check; rank 2, on the same node, was stopped by that node's launcher and never
    appears. Rank 0 stops with rank 1's words at once, not after APPEAR_S."""
    monkeypatch.setattr(join, "_joins_in_process", 0)
    port = free_port()
    master = TCPStore("127.0.0.1", port, 3, True, timedelta(seconds=30), wait_for_workers=False)
    join.tell_peers_before_joining(DistEnv(1, 3, 1, "127.0.0.1", port, "slurm"), "checkpoint.dir: cannot create it")
    started = time.monotonic()
    with pytest.raises(RankFailed, match=r"^rank 1 failed before joining: checkpoint.dir: cannot create it$"):
        join.prepare_and_agree(master, 0, 3, lambda: "x", join._prefix(1))  # the first join: the one rank 1 told
    assert time.monotonic() - started < 5


def test_rank_zero_failing_before_the_join_keeps_its_store_up_until_the_others_have_read_why(monkeypatch):
    """Under Slurm rank 0 hosts the store: failing before the join, it starts the store only to say why, and ends as
    soon as every other rank has read it."""
    monkeypatch.setattr(join, "_joins_in_process", 0)
    port = free_port()
    prefix = join._prefix(1)  # the first join of every rank
    outcome: list[BaseException | None] = [None]

    def rank_one() -> None:
        store = TCPStore("127.0.0.1", port, 2, False, timedelta(seconds=30))
        try:
            join.prepare_and_agree(store, 1, 2, lambda: "x", prefix)
        except BaseException as e:  # noqa: B036  (recorded for the test)
            outcome[0] = e

    thread = threading.Thread(target=rank_one)
    real_store = join.TCPStore

    def rank_zeros_store_then_rank_one(*args, **kwargs):
        # Rank 1 connects once rank 0's store listens. Started before, its client once reached another test's server
        # that held the free port for a moment (another pytest worker), and failed when that server closed.
        store = real_store(*args, **kwargs)
        thread.start()
        return store

    monkeypatch.setattr(join, "TCPStore", rank_zeros_store_then_rank_one)
    started = time.monotonic()
    join.tell_peers_before_joining(DistEnv(0, 2, 0, "127.0.0.1", port, "slurm"), "model.dim: must be > 0")
    thread.join(30)
    assert not thread.is_alive()
    assert isinstance(outcome[0], RankFailed)
    assert str(outcome[0]) == "rank 0 failed before joining: model.dim: must be > 0"
    assert time.monotonic() - started < join.EARLY_LINGER_S / 2  # it left once rank 1 had read it


def test_a_torchrun_rank_whose_run_hydra_cannot_start_stops_rank_zero_at_once(tmp_path, monkeypatch):
    """Rank 1 passes its checks, then Hydra fails to open the run's log file on its node and exits 1 with its own
    message (a CI failure: the other node's ranks waited APPEAR_S for it). The CLI tells rank 0 as soon as it exits."""
    monkeypatch.setattr(join, "_joins_in_process", 0)
    monkeypatch.setattr(join, "APPEAR_S", 10.0)  # untold, rank 0 would stop with "never appeared" after this
    port = free_port()
    master = TCPStore("127.0.0.1", port, 2, True, timedelta(seconds=30), wait_for_workers=False)
    env = {**os.environ, "RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}  # fmt: skip
    args = [*TINY_LM, "distributed.backend=fully_sharded", f"hydra.run.dir={tmp_path / 'run'}",
            "hydra.job_logging.handlers.file.filename=/proc/nowhere/train.log"]  # fmt: skip
    rank_one = subprocess.run([sys.executable, "-m", "shardlab.train", *args], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=120)  # fmt: skip
    assert rank_one.returncode == 1 and "Unable to configure handler 'file'" in rank_one.stderr, rank_one.stderr
    with pytest.raises(RankFailed, match=r"^rank 1 failed before joining: .*the run did not start \(exit code 1"):
        join.prepare_and_agree(master, 0, 2, lambda: "x", join._prefix(1))


def test_one_process_or_a_rank_that_already_joined_tells_nobody(monkeypatch):
    monkeypatch.setattr(join, "TCPStore", lambda *a, **k: pytest.fail("no store should be reached"))
    monkeypatch.setattr(join, "_joins_in_process", 0)
    join.tell_peers_before_joining(DistEnv(0, 1, 0, "127.0.0.1", 1, "none"), "x")
    join.tell_peers_before_joining(DistEnv(1, 2, 1, "127.0.0.1", 1, "local"), "x")
    monkeypatch.setattr(join, "_joins_in_process", 1)  # it joined once
    join.tell_peers_before_joining(DistEnv(1, 2, 1, "127.0.0.1", 1, "torchrun"), "x")


def test_a_torchrun_worker_whose_agent_store_is_gone_says_so_soon(monkeypatch):
    """torchrun's agent starts its store before its workers: a worker that cannot reach it (the first node's torchrun
    ended because its own ranks failed) stops with that reason, not after distributed.timeout_s."""
    from shardlab.distributed import base

    monkeypatch.setattr(base, "AGENT_STORE_CONNECT_S", 1.0)
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    port = free_port()  # nothing listens there
    with pytest.raises(RankFailed, match=rf"^rank 1: torchrun's store at 127.0.0.1:{port} is gone \(the first node's"):
        base._rendezvous_store(DistEnv(1, 2, 1, "127.0.0.1", port, "torchrun"), timeout_s=1800)
