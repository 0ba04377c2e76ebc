"""Which address and interface a rank talks on, when its job spans several hosts.

A job's ranks meet at the master address (the first host of the Slurm step, torchrun's --master_addr) and then open
gloo (or NCCL) connections to each other. Both libraries pick the interface to offer their peers from the host name;
on clusters the host name often resolves to a loopback address (Debian's ``127.0.1.1 <host>`` line) or to another NIC,
and the job then hangs in its first collective or fails with "Connection refused, remote=[127.0.0.1]". So each rank
chooses the interface itself, from what it can know for sure:

- a rank on another host than the master: the interface that holds the source address of its route to the master;
- a rank on the master's own host (where the master's name may resolve to loopback): the interface that holds the
  master address as the *other* hosts resolved it (they reached the store there, so it is the right one);
- a job on one host: nothing is set (loopback is right there);
- a user's GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME always wins.

Before the store exists, a rank that is not the master probes the master's port with plain TCP connects, saying every
WAIT_NOTE_S who it waits for, and fails after distributed.init_timeout_s with one line naming the address, the port
and the interface it tried, instead of waiting in torch's TCPStore without a word.
"""

from __future__ import annotations

import ipaddress
import os
import re
import socket
import struct
import time
from dataclasses import asdict, dataclass, field

from shardlab.errors import MasterUnreachable, RankFailed

WAIT_NOTE_S = 30.0
"""How often a rank waiting for the master (or rank 0 waiting for the others) says so."""
PROBE_S = 2.0
"""One connect attempt to the master's port times out after this long (then the next one starts)."""
IFNAME_VARIABLES = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


@dataclass(frozen=True)
class Route:
    """What one rank sees of the network: posted in the join, so every rank knows every other's view."""

    host: str
    master_ip: str
    """The master address as this host resolves it."""
    source: str
    """This host's address on its route to master_ip (for a local master_ip: that address itself)."""

    def to_json(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Joined:
    """What a rank learned when it joined its job's process group."""

    hosts: list[str]
    """The host name of each rank, in rank order."""
    interface: str | None
    """The interface gloo/NCCL offer their peers from this rank (None: their own choice, as on one host)."""
    addresses: list[str] = field(default_factory=list)
    """The address each rank reaches the master from (its address on the job's network), in rank order."""

    @property
    def spans_hosts(self) -> bool:
        return len(set(self.hosts)) > 1

    def lost_peer(self, error: BaseException) -> str | None:
        """'shl-n2 (10.77.0.12, rank 1)' where ``error`` (a failed collective: gloo names the peer whose connection
        broke, "Read error [10.77.0.12]:4272: Connection reset by peer") names another host of this job; else None."""
        for ip in re.findall(r"\[([0-9a-fA-F.:]+)\]", str(error)):
            ranks = [r for r, address in enumerate(self.addresses) if address == ip]
            if ranks and not is_loopback(ip):
                named = ", ".join(map(str, ranks))
                return f"{self.hosts[ranks[0]]} ({ip}, rank{'s' if len(ranks) > 1 else ''} {named})"
        return None


def collective_reason(error: BaseException) -> str:
    """A failed collective's message without gloo's source location and advice: 'Read error [10.77.0.12]:4272:
    Connection reset by peer'."""
    text = str(error).strip().splitlines()[-1] if str(error).strip() else type(error).__name__
    text = re.sub(r"^\[[^\]]*\.(cc|cpp|h):\d+\]\s*", "", text)
    return text.split(". This is typically caused")[0].rstrip(".")


def resolve(address: str) -> str:
    """``address`` (a name or an IPv4/IPv6 literal) as this host resolves it; socket.gaierror where it cannot."""
    try:
        return str(ipaddress.ip_address(address))
    except ValueError:
        pass
    infos = socket.getaddrinfo(address, None, type=socket.SOCK_STREAM)
    return sorted(infos, key=lambda info: info[0] != socket.AF_INET)[0][4][0]  # IPv4 first, as TCPStore tries


def source_address(ip: str) -> str:
    """The local address the kernel would send from to reach ``ip`` (a UDP connect sends nothing)."""
    family = socket.AF_INET6 if ":" in ip else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect((ip, 9))
        return s.getsockname()[0]


def local_route(master_addr: str) -> Route:
    ip = resolve(master_addr)
    return Route(host=socket.gethostname(), master_ip=ip, source=source_address(ip))


def interfaces() -> dict[str, str]:
    """This host's IPv4 addresses and the interface holding each (Linux's SIOCGIFADDR; empty elsewhere)."""
    try:
        import fcntl
    except ImportError:
        return {}
    found = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))  # SIOCGIFADDR
            except OSError:  # an interface without an IPv4 address
                continue
            found[socket.inet_ntoa(packed[20:24])] = name
    return found


def is_loopback(ip: str) -> bool:
    return ipaddress.ip_address(ip).is_loopback


def peer_addresses(routes: list[Route]) -> list[str]:
    """Each rank's address as its peers see it: its source towards the master, or, on the master's host (which resolves
    the master to loopback), the master address as the other hosts resolved it."""
    remote = next((r.master_ip for r in routes if not is_loopback(r.master_ip)), None)
    return [remote if is_loopback(r.source) and remote else r.source for r in routes]


def choose_interface(own: Route, routes: list[Route], addresses: dict[str, str]) -> str | None:
    """The interface this rank should offer its peers (None: leave it to the library, as on one host).

    ``routes``: every rank's Route; ``addresses``: this host's addresses -> interfaces (``interfaces()``)."""
    if len({r.host for r in routes}) <= 1:
        return None
    if not is_loopback(own.source):
        if own.source in addresses:
            return addresses[own.source]
        raise RankFailed(f"host {own.host}: no interface holds {own.source}, its address towards the master")
    # This host resolves the master to loopback: it is the master's host, known to the others by another address.
    seen = sorted({r.master_ip for r in routes if not is_loopback(r.master_ip)})
    for ip in seen:
        if ip in addresses:
            return addresses[ip]
    raise RankFailed(
        f"host {own.host} resolves the master address to {own.master_ip} (loopback), and the other hosts reach it at "
        f"{', '.join(seen) or 'no address'}, none of them an address of this host; set GLOO_SOCKET_IFNAME (and "
        "NCCL_SOCKET_IFNAME on GPUs) to the interface the other hosts reach this one on"
    )


_chosen: str | None = None
"""The interface this process set last: a later job in the same process (tests) may choose again; a user's never."""


def apply_interface(interface: str | None) -> str | None:
    """Point gloo and NCCL at ``interface`` (None: their own choice) where the user did not choose; returns gloo's."""
    global _chosen
    for variable in IFNAME_VARIABLES:
        current = os.environ.get(variable)
        if current and current != _chosen:
            continue  # the user's
        if interface:
            os.environ[variable] = interface
        else:
            os.environ.pop(variable, None)
    _chosen = interface
    return os.environ.get("GLOO_SOCKET_IFNAME")


def describe_source(ip: str) -> str:
    """'shlv2p (10.77.0.12)': an address with the interface that holds it, for messages."""
    name = interfaces().get(ip)
    return f"{name} ({ip})" if name else ip


def wait_for_master(rank: int, master_addr: str, port: int, timeout_s: float, say=print) -> None:
    """Rank ``rank`` (not the one hosting the store) waits until the master's port accepts a TCP connection, saying
    every WAIT_NOTE_S what it waits for; after ``timeout_s`` it fails in one line naming the address, the port and the
    interface it tried. A name that does not resolve (yet: DNS may lag a node's start) is retried the same way."""
    started = time.monotonic()
    noted = started
    host = socket.gethostname()
    while True:
        try:
            ip = resolve(master_addr)
            where = f"{master_addr} ({ip})" if ip != master_addr else ip
            via = describe_source(source_address(ip))
            with socket.create_connection((ip, port), timeout=PROBE_S):
                return
        except socket.gaierror as e:
            where, via, problem = master_addr, "no interface", f"the name does not resolve here ({e.strerror})"
        except OSError as e:
            problem = e.strerror or type(e).__name__
            if isinstance(e, TimeoutError | socket.timeout):
                problem = f"no answer within {PROBE_S:.0f} s"
        waited = time.monotonic() - started
        if waited >= timeout_s:
            raise MasterUnreachable(
                f"rank {rank} on {host} could not reach the master at {where} port {port} from {via} within "
                f"distributed.init_timeout_s={timeout_s:.0f} s ({problem}); check that the first host is up and "
                "reachable from this one (MASTER_ADDR/MASTER_PORT, a firewall, GLOO_SOCKET_IFNAME)"
            )
        if time.monotonic() - noted >= WAIT_NOTE_S:
            noted = time.monotonic()
            say(f"[rank {rank} on {host}] waiting for the master at {where} port {port} from {via}: {problem} "
                f"({waited:.0f} of {timeout_s:.0f} s)", flush=True)  # fmt: skip
        time.sleep(min(1.0, max(0.0, timeout_s - waited)))
