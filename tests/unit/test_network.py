"""shardlab.distributed.network: the interface a rank offers its peers when the job spans hosts, the wait for an
unreachable master, and naming the host a broken collective lost."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from shardlab.distributed import network
from shardlab.distributed.env import free_port
from shardlab.distributed.network import Joined, Route, choose_interface
from shardlab.errors import MasterUnreachable, RankFailed

# Two hosts as the test cluster makes them: each resolves its own name to 127.0.1.1 (Debian's line).
N1_OWN = Route(host="n1", master_ip="127.0.1.1", source="127.0.0.1")
N2 = Route(host="n2", master_ip="10.77.0.11", source="10.77.0.12")
N1_ADDRESSES = {"127.0.0.1": "lo", "10.77.0.11": "eth1"}
N2_ADDRESSES = {"127.0.0.1": "lo", "10.77.0.12": "eth2"}


def test_one_host_leaves_the_interface_to_the_library():
    local = Route(host="n1", master_ip="127.0.0.1", source="127.0.0.1")
    assert choose_interface(local, [local, local], N1_ADDRESSES) is None


def test_a_host_away_from_the_master_offers_the_interface_of_its_route_to_it():
    assert choose_interface(N2, [N1_OWN, N2], N2_ADDRESSES) == "eth2"


def test_the_masters_host_offers_the_interface_the_other_hosts_reached_it_at():
    """Its own name resolves to loopback there: the others' view of the master address is the one to offer."""
    assert choose_interface(N1_OWN, [N1_OWN, N1_OWN, N2, N2], N1_ADDRESSES) == "eth1"


def test_a_master_host_that_holds_none_of_the_addresses_the_others_used_says_what_to_set():
    with pytest.raises(RankFailed, match=r"^host n1 resolves the master address to 127.0.1.1 \(loopback\), and the "
                       r"other hosts reach it at 10.77.0.11, none of them an address of this host; set "
                       r"GLOO_SOCKET_IFNAME"):  # fmt: skip
        choose_interface(N1_OWN, [N1_OWN, N2], {"127.0.0.1": "lo"})


def test_the_users_interface_wins_and_ours_is_chosen_again_by_the_next_job(monkeypatch):
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    monkeypatch.delenv("NCCL_SOCKET_IFNAME", raising=False)
    monkeypatch.setattr(network, "_chosen", None)
    assert network.apply_interface("eth1") == "eth1"
    assert network.apply_interface("eth2") == "eth2"  # a later job in this process chooses again
    assert network.apply_interface(None) is None  # and one on one host leaves it to gloo
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "ib0")
    assert network.apply_interface("eth1") == "ib0"


def test_this_hosts_addresses_include_loopback():
    assert network.interfaces().get("127.0.0.1") == "lo"
    assert network.source_address("127.0.0.1") == "127.0.0.1"


def test_an_unreachable_master_fails_in_one_line_naming_address_port_and_interface():
    port = free_port()  # nothing listens there
    started = time.monotonic()
    with pytest.raises(MasterUnreachable) as raised:
        network.wait_for_master(1, "127.0.0.1", port, timeout_s=1.0, say=lambda *a, **k: None)
    assert time.monotonic() - started < 5
    assert str(raised.value).startswith(
        f"rank 1 on {socket.gethostname()} could not reach the master at 127.0.0.1 port {port} from lo (127.0.0.1) "
        "within distributed.init_timeout_s=1 s (Connection refused); check that the first host is up"
    )
    assert "\n" not in str(raised.value)


def test_a_waiting_rank_says_what_it_waits_for_until_the_master_answers(monkeypatch):
    monkeypatch.setattr(network, "WAIT_NOTE_S", 0.3)
    port = free_port()
    server = socket.socket()
    notes: list[str] = []

    def listen_later():
        time.sleep(1.2)
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind(("127.0.0.1", port))
        server.listen()

    threading.Thread(target=listen_later, daemon=True).start()
    try:
        network.wait_for_master(2, "localhost", port, timeout_s=30, say=lambda line, **_: notes.append(line))
    finally:
        server.close()
    assert notes and all(
        n.startswith(f"[rank 2 on {socket.gethostname()}] waiting for the master at localhost (127.0.0.1) port {port}")
        for n in notes
    )


def test_a_broken_collective_names_the_host_it_lost():
    gloo = RuntimeError(
        "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:545] Read error [10.77.0.12]:4272: "
        "Connection reset by peer. This is typically caused by a remote worker hanging or bugs in the application."
    )
    job = Joined(["n1", "n1", "n2", "n2"], "eth1", ["10.77.0.11", "10.77.0.11", "10.77.0.12", "10.77.0.12"])
    assert job.lost_peer(gloo) == "n2 (10.77.0.12, ranks 2, 3)"
    assert network.collective_reason(gloo) == "Read error [10.77.0.12]:4272: Connection reset by peer"
    assert job.lost_peer(RuntimeError("Timed out waiting 600000ms for recv operation to complete")) is None
    assert Joined(["n1"], None).lost_peer(gloo) is None


def test_the_masters_host_is_named_by_the_address_the_others_reach_it_at():
    """Its ranks route to the master over loopback; gloo names them by the address they offered (the master's)."""
    routes = [N1_OWN, N1_OWN, N2, N2]
    assert network.peer_addresses(routes) == ["10.77.0.11", "10.77.0.11", "10.77.0.12", "10.77.0.12"]
    job = Joined([r.host for r in routes], "eth2", network.peer_addresses(routes))
    assert (
        job.lost_peer(RuntimeError("Read error [10.77.0.11]:5: Connection reset by peer"))
        == "n1 (10.77.0.11, ranks 0, 1)"
    )
    local = Route(host="n1", master_ip="127.0.0.1", source="127.0.0.1")
    assert network.peer_addresses([local, local]) == ["127.0.0.1", "127.0.0.1"]
