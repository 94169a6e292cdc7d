"""What a gateway keeps is its own: two gateways in one process (tests, a benchmark's baseline beside its subject)
share no request-id counter and no count of the loop's reads."""

from __future__ import annotations

import asyncio
from typing import Any

from tensora.gateway.limits import MemoryLimiter
from tensora.gateway.proxy import Gateway, Options
from tensora.gateway.routes import RouteTable
from tensora.gateway.server import Server
from tensora.gateway.upstream import _Conn


def gateway() -> Gateway:
    return Gateway(Options(), RouteTable, MemoryLimiter(), None)


def request_ids(gw: Gateway, n: int) -> list[str]:
    """The X-Request-Id of ``n`` requests that send none (``/healthz``: no key, no body)."""
    ids: list[str] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(msg: dict[str, Any]) -> None:
        if msg["type"] == "http.response.start":
            ids.append(dict(msg["headers"])[b"x-request-id"].decode())

    async def ask() -> None:
        for _ in range(n):
            await gw({"type": "http", "path": "/healthz", "method": "GET", "headers": []}, receive, send)

    asyncio.run(ask())
    return ids


def test_two_gateways_number_their_request_ids_apart() -> None:
    a, b = gateway(), gateway()
    ids_a, ids_b = request_ids(a, 3), request_ids(b, 2)
    prefix_a, prefix_b = ids_a[0][:-1], ids_b[0][:-1]
    assert ids_a == [prefix_a + "1", prefix_a + "2", prefix_a + "3"]
    assert ids_b == [prefix_b + "1", prefix_b + "2"]  # not 4 and 5: a's requests are not b's count
    assert prefix_a != prefix_b and prefix_a.startswith("req_")


def test_a_given_request_id_is_echoed_and_not_counted() -> None:
    gw = gateway()
    echoed: list[str] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b""}

    async def send(msg: dict[str, Any]) -> None:
        if msg["type"] == "http.response.start":
            echoed.append(dict(msg["headers"])[b"x-request-id"].decode())

    asyncio.run(gw({"type": "http", "path": "/healthz", "method": "GET", "headers": [(b"x-request-id", b"mine-1")]},
                   receive, send))
    assert echoed == ["mine-1"]
    assert request_ids(gw, 1) == [gw._rid_prefix + "1"]  # the echoed one took no number


def test_two_gateways_count_their_loop_reads_apart() -> None:
    a, b = gateway(), gateway()
    assert a.reads is not b.reads
    assert a.client.reads is a.reads and a.walk.client is a.client  # its upstream connections count into its own
    server = Server(a, "127.0.0.1", 0, reads=a.reads)
    assert server.reads is a.reads  # and its server does too

    loop = asyncio.new_event_loop()
    try:
        pool, _, _ = a.client._pool("http://127.0.0.1:9/v1")
        conn = _Conn(pool, loop)
        conn.data_received(b"HTTP/1.1 200 OK\r\n")  # an upstream's answer begins: a read the loop handed on
    finally:
        loop.close()
    assert (a.reads.n, b.reads.n) == (1, 0)


def test_a_server_given_no_gateways_count_keeps_its_own() -> None:
    gw = gateway()
    one, two = Server(gw, "127.0.0.1", 0), Server(gw, "127.0.0.1", 0)
    assert one.reads is not two.reads and one.reads is not gw.reads
