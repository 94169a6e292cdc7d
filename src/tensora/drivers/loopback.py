"""Each local replica's own loopback host: tenant content never shares a host name with Tensora's pages.

Browsers scope cookies by host, not port: were a notebook served at ``http://127.0.0.1:<port>``, every request a
signed-in browser made to it would carry the dashboard's cookies (``127.0.0.1:8700``), and the tenant controls
its server (its Jupyter config is in its home). So every replica that serves HTTP is published on a loopback
address of its own, ``127.a.b.c``, derived from its id and distinct from every live replica's; Tensora's own
servers keep 127.0.0.1. Linux routes all of 127.0.0.0/8 to ``lo``, so nothing needs configuring.

Where the host has no other loopback address (macOS configures only 127.0.0.1), the replica is bound on
127.0.0.1 and its URL names ``r-<hex>.localhost`` instead: a host of its own to a browser (Chromium and Firefox
resolve every ``*.localhost`` to loopback by themselves, RFC 6761), never resolved by Tensora itself (glibc and
macOS do not resolve such names), which connects to the address. Detected, not configured: the first candidate
address that cannot be bound (``EADDRNOTAVAIL``) means the host has none.

Pure but for :func:`bindable` and :func:`free_port`, which ask the kernel.
"""

from __future__ import annotations

import errno
import hashlib
import ipaddress
import socket
from collections.abc import Callable, Collection
from dataclasses import dataclass

TENSORA_HOST = "127.0.0.1"
"""Tensora's own servers' address (API and dashboard, gateway): no replica is ever published on it by name."""
NETWORK = ipaddress.IPv4Network("127.0.0.0/8")
TRIES = 32
"""Candidate addresses tried per replica before giving up (16 million to draw from: never reached in practice)."""
PORT_TRIES = 64


class NoAddress(RuntimeError):
    """No address of its own was free for the replica (more live replicas than could ever run here)."""


@dataclass(frozen=True, slots=True)
class Origin:
    """Where a replica serves: ``address`` is what its server (or pasta) binds and Tensora connects to;
    ``host`` is what its URLs name (the address itself, or a ``*.localhost`` name bound on 127.0.0.1)."""

    address: str
    host: str

    def url(self, port: int, path: str = "") -> str:
        return f"http://{self.host}:{port}{path}"

    def connect_url(self, port: int, path: str = "") -> str:
        """The URL Tensora itself uses (its probes, the gateway): the address, never a name it cannot resolve."""
        return f"http://{self.address}:{port}{path}"


def candidate(replica_id: str, attempt: int) -> str:
    """The ``attempt``-th address drawn for ``replica_id``: 127.0.0.0/8 less its network, broadcast and
    127.0.0.1."""
    n = int.from_bytes(hashlib.sha256(f"{replica_id}/{attempt}".encode()).digest()[:4], "big")
    return str(NETWORK[2 + n % (NETWORK.num_addresses - 3)])


def named_host(replica_id: str, attempt: int = 0) -> str:
    """The fallback host name: a lowercase label (ids are case-sensitive, host names are not)."""
    return f"r-{hashlib.sha256(f'{replica_id}/{attempt}'.encode()).hexdigest()[:16]}.localhost"


def choose(replica_id: str, taken: Collection[str], usable: Callable[[str], bool]) -> Origin:
    """The replica's origin: the first candidate address no live replica has (``taken``: their addresses and
    hosts); a named host on 127.0.0.1 where ``usable`` says the host cannot bind the candidate at all."""
    for attempt in range(TRIES):
        address = candidate(replica_id, attempt)
        if address in taken:
            continue
        if usable(address):
            return Origin(address, address)
        for again in range(TRIES):  # no other loopback address here: a name of its own on 127.0.0.1
            host = named_host(replica_id, again)
            if host not in taken:
                return Origin(TENSORA_HOST, host)
        break
    raise NoAddress(f"no loopback address of its own is free for replica {replica_id}")


def bindable(address: str) -> bool:
    """Whether this host can bind ``address`` (False only where it has no such address: EADDRNOTAVAIL)."""
    with socket.socket() as s:
        try:
            s.bind((address, 0))
        except OSError as exc:
            if exc.errno == errno.EADDRNOTAVAIL:
                return False
            raise
    return True


def free_port(address: str = TENSORA_HOST, avoid: Collection[int] = ()) -> int:
    """A port free on ``address`` and not in ``avoid``: a sandbox's server port is also a port of its own
    loopback, where ``avoid`` (Tensora's ports, forwarded into it) are taken; with an address of its own a
    port Tensora's servers hold on 127.0.0.1 is free there, so it must be refused here."""
    for _ in range(PORT_TRIES):
        with socket.socket() as s:
            s.bind((address, 0))
            port = int(s.getsockname()[1])
        if port not in avoid:
            return port
    raise OSError(f"no free port on {address} outside {sorted(avoid)}")
