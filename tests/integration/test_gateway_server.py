"""The gateway's own HTTP server (gateway/server.py) over real sockets: keep-alive and pipelined
requests answered in order, whole bodies with content-length, chunked streams, bad requests,
the lifespan, and a graceful stop that lets a request in flight finish."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tensora.gateway.server import Server
from tests.support.services import free_port

EVENTS: list[str] = []
SLOW_IN = threading.Event()  # set when a request to /slow comes in
HEADER_SHAPES: dict[str, Any] = {  # ASGI lets an app send its headers as any pairs: each is answered alike
    "tuples": [(b"x-a", b"1"), (b"content-length", b"2")],
    "lists": [[b"x-a", b"1"], [b"content-length", b"2"]],
    "a-tuple-then-a-list": [(b"x-a", b"1"), [b"content-length", b"2"]],
}


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] == "lifespan":
        while True:
            msg = await receive()
            EVENTS.append(msg["type"])
            await send({"type": msg["type"] + ".complete"})
            if msg["type"] == "lifespan.shutdown":
                return
    body = (await receive())["body"]
    if scope["path"] == "/stream":
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        for i in range(3):
            await send({"type": "http.response.body", "body": b"part%d;" % i, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        return
    if scope["path"].startswith("/pairs/"):
        shape = HEADER_SHAPES[scope["path"].removeprefix("/pairs/")]
        await send({"type": "http.response.start", "status": 200, "headers": shape})
        await send({"type": "http.response.body", "body": b"ok"})
        return
    if scope["path"] == "/slow":
        SLOW_IN.set()
        await asyncio.sleep(0.5)
    if scope["path"] == "/boom":
        raise RuntimeError("a bug")
    await send({"type": "http.response.start", "status": 201, "headers": [(b"x-echo", scope["path"].encode())]})
    await send({"type": "http.response.body", "body": b"got " + body + b" " + scope["query_string"]})


@contextlib.contextmanager
def started(**kw: Any) -> Iterator[tuple[Server, asyncio.Event, asyncio.AbstractEventLoop, threading.Thread]]:
    """A server on a loop of its own in a thread, listening: it, its stop event, its loop and its thread."""
    loop = asyncio.new_event_loop()
    stop = asyncio.Event()
    srv = Server(app, "127.0.0.1", free_port(), grace_s=5, **kw)

    def run() -> None:
        asyncio.set_event_loop(loop)
        loop.run_until_complete(srv.serve(stop))

    t = threading.Thread(target=run, daemon=True)
    t.start()
    try:
        deadline = time.monotonic() + 10
        while srv.bound is None:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        yield srv, stop, loop, t
    finally:
        loop.call_soon_threadsafe(stop.set)
        t.join(10)
        loop.close()


@pytest.fixture
def server() -> Iterator[tuple[str, asyncio.Event, asyncio.AbstractEventLoop, threading.Thread]]:
    EVENTS.clear()
    with started() as (srv, stop, loop, t):
        yield f"http://127.0.0.1:{srv.port}", stop, loop, t


def test_whole_bodies_streams_and_keep_alive(server: Any) -> None:
    url, *_ = server
    with httpx.Client(base_url=url) as c:
        r = c.post("/echo?x=1", content=b"hello")
        s = c.get("/stream")
        again = c.post("/echo", content=b"more")
    assert (r.status_code, r.text, r.headers["content-length"], r.headers["x-echo"]) == (201, "got hello x=1",
                                                                                          "13", "/echo")
    assert s.text == "part0;part1;part2;" and s.headers["transfer-encoding"] == "chunked"
    assert again.text == "got more "


@pytest.mark.parametrize("shape", HEADER_SHAPES)
def test_an_apps_headers_are_answered_alike_whatever_pairs_it_sends_them_as(server: Any, shape: str) -> None:
    url, *_ = server
    with socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1]))) as s:
        s.sendall(f"GET /pairs/{shape} HTTP/1.1\r\nhost: x\r\n\r\n".encode())
        data = b""
        while not data.endswith(b"\r\n\r\nok"):
            chunk = s.recv(65536)
            assert chunk, data
            data += chunk
    head = data.split(b"\r\n\r\n")[0].split(b"\r\n")
    assert head[0] == b"HTTP/1.1 200 OK" and sorted(head[1:]) == [b"content-length: 2", b"x-a: 1"]


def test_pipelined_requests_are_answered_in_order_and_bad_ones_get_400(server: Any) -> None:
    url, *_ = server
    port = int(url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(b"POST /slow HTTP/1.1\r\nhost: x\r\ncontent-length: 1\r\n\r\naPOST /fast HTTP/1.1\r\nhost: x\r\n"
                  b"content-length: 1\r\n\r\nb")
        data = b""
        while data.count(b"HTTP/1.1 201") < 2:
            data += s.recv(65536)
    assert data.index(b"/slow") < data.index(b"/fast")
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(b"NONSENSE\r\n\r\n")
        assert s.recv(65536).startswith(b"HTTP/1.1 400")


def test_a_failing_app_is_a_500_and_the_lifespan_runs(server: Any) -> None:
    url, *_ = server
    with httpx.Client(base_url=url) as c:
        r = c.get("/boom")
    assert r.status_code == 500 and "error" in r.json()
    assert EVENTS == ["lifespan.startup"]


def test_a_stop_lets_the_request_in_flight_finish_then_runs_shutdown(server: Any) -> None:
    url, stop, loop, thread = server
    out: list[httpx.Response] = []
    t = threading.Thread(target=lambda: out.append(httpx.post(f"{url}/slow", content=b"x", timeout=10)))
    SLOW_IN.clear()
    t.start()
    assert SLOW_IN.wait(10)  # the request is in flight
    loop.call_soon_threadsafe(stop.set)
    t.join(10)
    thread.join(10)
    assert out and out[0].status_code == 201
    assert EVENTS == ["lifespan.startup", "lifespan.shutdown"]


_QUIET_GC = """
import asyncio, gc, sys
from tensora.gateway.server import Server

async def app(scope, receive, send):
    while True:  # the lifespan only
        msg = await receive()
        await send({"type": msg["type"] + ".complete"})
        if msg["type"] == "lifespan.shutdown":
            return

async def main(own):
    stop = asyncio.Event()
    asyncio.get_running_loop().call_later(0.3, stop.set)
    await Server(app, "127.0.0.1", 0, own_process=own, grace_s=1).serve(stop)
    print(gc.get_freeze_count(), gc.get_threshold()[0])

asyncio.run(main(sys.argv[1] == "own"))
"""


@pytest.mark.parametrize("own", [True, False])
def test_a_server_that_is_its_process_keeps_the_collector_out_of_the_tail(own: bool) -> None:
    """Under load a full collection walked start-up's ~100,000 objects for 35-120 ms (bench/gateway.py, c=32):
    the server of its own process freezes them and collects young objects every 50,000, not 700. A server
    inside another process (the tests, an embedding app) leaves that process's collector alone."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _QUIET_GC, "own" if own else "embedded"], capture_output=True,
                         text=True, timeout=60, check=True).stdout.split()
    frozen, gen0 = int(out[0]), int(out[1])
    assert (frozen > 10_000 and gen0 == 50_000) if own else (frozen == 0 and gen0 == 700), out


# -- busy polling (opt-in) ---------------------------------------------------------------------------------


def test_busy_polling_spins_after_traffic_and_stops_once_it_ends() -> None:
    with started(busy_poll_s=0.005) as (srv, *_):
        assert srv.spin is not None and srv.spin.turns == 0  # nothing came: it sleeps as before
        with httpx.Client(base_url=f"http://127.0.0.1:{srv.port}") as c:
            for i in range(20):
                r = c.post(f"/p{i}", content=b"x")
                assert r.status_code == 201 and r.text == "got x "
        spun = srv.spin.turns
        assert spun > 20  # it polled between the requests
        time.sleep(0.2)  # 40 windows: traffic ended, and so did the spinning
        assert not srv.spin.on
        idle = srv.spin.turns
        time.sleep(0.2)
        assert srv.spin.turns == idle  # idle: no turn at all


def test_by_default_the_loop_never_spins() -> None:
    with started() as (srv, *_), httpx.Client(base_url=f"http://127.0.0.1:{srv.port}") as c:
        assert c.post("/x", content=b"y").status_code == 201
        assert srv.busy_poll_s == 0 and srv.spin is None


@pytest.mark.parametrize("bad", [-1, 10_001])
def test_busy_poll_us_is_bounded(tmp_path: Any, bad: int) -> None:
    from pydantic import ValidationError

    from tensora.gateway.app import GatewaySettings

    with pytest.raises(ValidationError, match="busy_poll_us"):
        GatewaySettings(data_dir=tmp_path, busy_poll_us=bad)
