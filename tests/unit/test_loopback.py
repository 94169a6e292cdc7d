"""Each local replica's own loopback host (``drivers.loopback``): never Tensora's 127.0.0.1, never a live
replica's, a ``*.localhost`` name where the host has no other loopback address; ports free there and none of
Tensora's."""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest

from tensora.drivers import loopback
from tensora.drivers.loopback import Origin


def everything(_: str) -> bool:
    return True


def nothing(_: str) -> bool:  # macOS: only 127.0.0.1 is configured
    return False


@dataclass
class Case:
    replica: str
    usable: Callable[[str], bool] = everything
    taken: set[str] = field(default_factory=set)
    want: Callable[[Origin], bool] = lambda o: True


FIRST = loopback.candidate("rp_a", 0)
SECOND = loopback.candidate("rp_a", 1)
NAMED = loopback.named_host("rp_a", 0)

CASES = {
    "a free host: its first candidate, as address and host": Case(
        "rp_a", want=lambda o: o == Origin(FIRST, FIRST)),
    "its first candidate taken by a live replica: the next": Case(
        "rp_a", taken={FIRST}, want=lambda o: o == Origin(SECOND, SECOND)),
    "no other loopback address: a name of its own on 127.0.0.1": Case(
        "rp_a", usable=nothing, want=lambda o: o == Origin("127.0.0.1", NAMED)),
    "the name taken too: the next name": Case(
        "rp_a", usable=nothing, taken={NAMED},
        want=lambda o: o.address == "127.0.0.1" and o.host not in (NAMED, "127.0.0.1")
        and o.host.endswith(".localhost")),
    "another replica: another address": Case("rp_b", want=lambda o: o.address != FIRST),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_choose(case: Case) -> None:
    origin = loopback.choose(case.replica, case.taken, case.usable)
    assert case.want(origin), origin
    assert origin.host != "127.0.0.1" and origin.host not in case.taken


def test_every_candidate_is_loopback_and_none_is_tensoras() -> None:
    seen = {loopback.candidate(f"rp_{i}", a) for i in range(2000) for a in range(2)}
    assert len(seen) > 3990  # drawn from 16 million: collisions are rare, and ``choose`` steps past them
    for address in seen:
        ip = ipaddress.IPv4Address(address)
        assert ip.is_loopback and address not in ("127.0.0.1", "127.0.0.0", "127.255.255.255")


def test_a_name_is_one_lowercase_label_under_localhost() -> None:
    # ids are case-sensitive base 62; host names are not: two ids must never fold to one name
    assert loopback.named_host("rp_Ab") != loopback.named_host("rp_aB")
    label, _, rest = loopback.named_host("rp_Ab").partition(".")
    assert rest == "localhost" and label == label.lower() and label.replace("-", "").isalnum()


def test_when_every_address_and_name_is_taken_it_says_so() -> None:
    taken = {loopback.candidate("rp_a", a) for a in range(loopback.TRIES)}
    with pytest.raises(loopback.NoAddress, match="rp_a"):
        loopback.choose("rp_a", taken, everything)


def test_urls_name_the_host_and_tensora_connects_to_the_address() -> None:
    named = Origin("127.0.0.1", NAMED)
    assert named.url(8888, "/lab") == f"http://{NAMED}:8888/lab"
    assert named.connect_url(8888, "/v1") == "http://127.0.0.1:8888/v1"


def test_this_host_binds_other_loopback_addresses() -> None:
    """Linux routes 127.0.0.0/8 to lo: the detection says so here (it is False only on EADDRNOTAVAIL)."""
    assert loopback.bindable(FIRST)
    assert not loopback.bindable("192.0.2.1")  # TEST-NET-1: configured on no host


def test_a_port_is_free_on_the_address_and_never_one_of_tensoras() -> None:
    with socket.socket() as held:  # Tensora's server on 127.0.0.1: its port is free on the replica's address
        held.bind(("127.0.0.1", 0))
        tensoras = int(held.getsockname()[1])
        port = loopback.free_port(FIRST, avoid={tensoras})
        assert port != tensoras
        with socket.socket() as s:
            s.bind((FIRST, port))  # free there
    with pytest.raises(OSError, match="no free port"):  # every port avoided: none handed out
        loopback.free_port(FIRST, avoid=set(range(1, 65536)))
