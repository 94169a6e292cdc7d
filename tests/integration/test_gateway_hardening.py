"""The gateway's own HTTP server against hostile clients, over raw sockets: oversized and too many
headers, dribbled headers, idle connections, pipelined floods, a client that never reads, too many
connections, oversized bodies. Short limits through ``Limits`` (the gateway's settings) keep it quick."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tensora.gateway.server import Limits
from tests.support.gateway_harness import serving_own

pytestmark = pytest.mark.timeout(60)

seen: list[str] = []  # the paths the app was given, in order
gate = threading.Event()  # /wait holds until it is set
produced: list[int] = [0]  # bytes /big has handed to send()
BIG = 32 << 20


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] == "lifespan":
        while True:
            msg = await receive()
            await send({"type": msg["type"] + ".complete"})
            if msg["type"] == "lifespan.shutdown":
                return
    body = (await receive())["body"]
    seen.append(scope["path"])
    if scope["path"] == "/wait":
        while not gate.is_set():
            await asyncio.sleep(0.01)
    if scope["path"] == "/big":  # 32 MiB, 64 KiB at a time, as a stream relays it
        await send({"type": "http.response.start", "status": 200, "headers": []})
        piece = b"x" * (64 << 10)
        for _ in range(BIG // len(piece)):
            await send({"type": "http.response.body", "body": piece, "more_body": True})
            produced[0] += len(piece)
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        return
    await send({"type": "http.response.start", "status": 200, "headers": [(b"x-path", scope["path"].encode())]})
    await send({"type": "http.response.body", "body": b"ok " + scope["path"].encode() + b" %d" % len(body)})


@pytest.fixture(autouse=True)
def _clean() -> Iterator[None]:
    seen.clear()
    gate.clear()
    produced[0] = 0
    yield
    gate.set()


def connect(server: Any) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", server.bound[1]), timeout=10)
    return s


def read_all(s: socket.socket, until: float = 5.0) -> bytes:
    """Everything until the server closes (or ``until`` seconds pass)."""
    s.settimeout(until)
    out = b""
    try:
        while chunk := s.recv(1 << 20):
            out += chunk
    except (TimeoutError, ConnectionResetError):
        pass
    return out


def until_closed(s: socket.socket, until: float = 3.0) -> bytes | None:
    """Everything until the server closes the connection; None when ``until`` seconds pass first (it is open)."""
    s.settimeout(until)
    out = b""
    try:
        while chunk := s.recv(1 << 20):
            out += chunk
    except TimeoutError:
        return None
    except ConnectionResetError:
        pass
    return out


def still_open(s: socket.socket) -> bool:
    """Whether the server has neither closed nor written to ``s`` yet (asked without waiting)."""
    s.setblocking(False)
    try:
        s.recv(1, socket.MSG_PEEK)
    except BlockingIOError:
        return True
    finally:
        s.setblocking(True)
    return False


def send_all(s: socket.socket, data: bytes) -> None:
    """As much as the server takes: it may answer and stop reading half-way (that is the point)."""
    with contextlib.suppress(BrokenPipeError, ConnectionResetError):
        s.sendall(data)


def get(path: str = "/", headers: bytes = b"") -> bytes:
    return b"GET " + path.encode() + b" HTTP/1.1\r\nhost: x\r\n" + headers + b"\r\n"


HEADS = [  # (name, request head, expected status)
    ("one 16 MiB header", get(headers=b"x-big: " + b"a" * (16 << 20) + b"\r\n"), 431),
    ("one 70 KiB header", get(headers=b"x-big: " + b"a" * (70 << 10) + b"\r\n"), 431),
    ("a 70 KiB request line", get("/" + "a" * (70 << 10)), 431),
    ("many headers, 64 KiB together", get(headers=b"".join(b"x-h%d: %s\r\n" % (i, b"v" * 900) for i in range(72))),
     431),
    ("101 headers", get(headers=b"".join(b"x-h%d: v\r\n" % i for i in range(100))), 431),
    ("100 headers", get(headers=b"".join(b"x-h%d: v\r\n" % i for i in range(99))), 200),
    ("a 50 KiB header", get(headers=b"x-big: " + b"a" * (50 << 10) + b"\r\n"), 200),
    ("not HTTP", b"NONSENSE\r\n\r\n", 400),
]


@pytest.mark.parametrize(("head", "status"), [(h, s) for _, h, s in HEADS], ids=[n for n, *_ in HEADS])
def test_header_size_and_count_are_bounded(head: bytes, status: int) -> None:
    with serving_own(app) as server, connect(server) as s:
        send_all(s, head)
        s.shutdown(socket.SHUT_WR)
        out = read_all(s)
    assert out.startswith(b"HTTP/1.1 %d" % status), out[:200]
    assert seen == (["/"] if status == 200 else [])


def test_heads_are_measured_one_by_one_in_a_large_read() -> None:
    """Three pipelined 30 KiB heads in one write: 90 KiB together, each under the bound, all answered."""
    with serving_own(app) as server, connect(server) as s:
        s.sendall(b"".join(get(f"/h{i}", b"x-big: " + b"a" * (30 << 10) + b"\r\n") for i in range(3))
                  + get("/h3", b"x-big: " + b"a" * (61 << 10) + b"\r\n"))
        out = read_all(s)
    assert seen == ["/h0", "/h1", "/h2"]
    assert out.count(b"HTTP/1.1 200") == 3 and out.count(b"HTTP/1.1 431") == 1


def test_the_server_stops_reading_a_huge_head_early() -> None:
    """16 MiB of header are not read whole: the 431 comes while the client is still sending."""
    with serving_own(app) as server, connect(server) as s:
        s.sendall(get()[:-4] + b"\r\nx-big: ")
        sent = 0
        s.settimeout(0.5)
        try:
            while sent < (16 << 20):
                sent += s.send(b"a" * (1 << 16))
        except (TimeoutError, BrokenPipeError, ConnectionResetError):
            pass
        out = read_all(s)
    assert out.startswith(b"HTTP/1.1 431"), out[:200]


def test_dribbled_headers_are_a_408_after_header_timeout() -> None:
    with serving_own(app, Limits(header_timeout_s=0.4)) as server, connect(server) as s:
        s.sendall(b"GET / HTTP/1.1\r\n")
        s.settimeout(0.1)
        out = b""
        lines = 0  # header lines sent before the server answered
        for i in range(40):  # a header line every 0.1 s, for up to 4 s: never idle, never done
            try:
                s.sendall(b"x-h%d: v\r\n" % i)
                lines = i + 1
                out += s.recv(65536)
            except TimeoutError:
                continue
            except (BrokenPipeError, ConnectionResetError):
                break
            if out:
                break
        out += read_all(s, 2)
    assert out.startswith(b"HTTP/1.1 408"), out[:200]
    assert 2 <= lines < 40, lines  # it took a few lines (each one on time), then cut the head short
    assert seen == []


def test_a_body_that_stops_coming_is_a_408_after_idle_timeout() -> None:
    with serving_own(app, Limits(idle_timeout_s=0.4)) as server, connect(server) as s:
        s.sendall(b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: 100\r\n\r\nabc")
        out = read_all(s, 3)
    assert out.startswith(b"HTTP/1.1 408"), out[:200]
    assert seen == []


def test_idle_keep_alive_connections_are_closed() -> None:
    with serving_own(app, Limits(idle_timeout_s=0.4)) as server:
        with connect(server) as s:  # never sends a byte
            assert still_open(s)  # not turned away on arrival
            assert until_closed(s) == b""  # the server closed it, silent: not our wait that ran out
        with connect(server) as s:  # one request, then silence
            s.sendall(get("/one"))
            out = until_closed(s)
            assert out is not None and out.startswith(b"HTTP/1.1 200") and out.endswith(b"ok /one 0")
        with connect(server) as s:  # busy enough: kept open past the idle timeout
            for i in range(6):
                s.sendall(get(f"/k{i}"))
                assert s.recv(65536).startswith(b"HTTP/1.1 200")
                time.sleep(0.15)
        deadline = time.monotonic() + 5
        while server.conns:
            assert time.monotonic() < deadline
            time.sleep(0.02)


def _tasks(server: Any) -> int:
    """The tasks alive on the server's loop, asked of the loop itself."""
    done = threading.Event()
    n = [0]

    def count() -> None:
        n[0] = len(asyncio.all_tasks(server.loop))
        done.set()

    server.loop.call_soon_threadsafe(count)
    assert done.wait(5)
    return n[0]


LEAVES = {  # how a keep-alive client leaves, after some requests answered on its connection
    "idle, between requests": b"",
    "with a request in flight": get("/wait"),
}


@pytest.mark.parametrize("last", LEAVES.values(), ids=LEAVES.keys())
def test_a_connection_holds_one_task_between_its_requests_and_none_once_gone(last: bytes) -> None:
    with serving_own(app) as server:
        before = _tasks(server)
        with connect(server) as s:
            for i in range(5):
                s.sendall(get(f"/k{i}"))
                assert s.recv(65536).startswith(b"HTTP/1.1 200")
            assert _tasks(server) == before + 1  # one for the connection, not one a request
            s.sendall(last)
            if last:
                deadline = time.monotonic() + 5
                while "/wait" not in seen:
                    assert time.monotonic() < deadline
                    time.sleep(0.01)
        deadline = time.monotonic() + 5
        while server.conns or _tasks(server) != before:
            assert time.monotonic() < deadline, "the connection's task outlived it"
            time.sleep(0.02)


def test_pipelined_requests_in_one_write_are_answered_in_order() -> None:
    with serving_own(app, Limits(max_pipelined=8)) as server, connect(server) as s:
        s.sendall(b"".join(get(f"/p{i}") for i in range(6)) + get("/last", b"connection: close\r\n"))
        out = read_all(s)
    paths = [f"/p{i}" for i in range(6)] + ["/last"]
    assert seen == paths
    assert out.count(b"HTTP/1.1 200") == 7
    assert [out.index(b"ok " + p.encode()) for p in paths] == sorted(out.index(b"ok " + p.encode()) for p in paths)


def test_a_pipelined_flood_in_one_write_waits_unparsed_and_is_answered_in_order() -> None:
    """200 requests in one write, 4 queued at most: the rest wait as bytes, reading paused."""
    with serving_own(app, Limits(max_pipelined=4)) as server, connect(server) as s:
        s.sendall(get("/wait") + b"".join(get(f"/p{i}") for i in range(200)))
        time.sleep(0.3)
        queued = [len(c.queue) for c in list(server.conns)]
        assert queued and max(queued) <= 4 and seen == ["/wait"]
        gate.set()
        s.sendall(get("/end", b"connection: close\r\n"))
        out = read_all(s, 10)
    assert seen == ["/wait", *[f"/p{i}" for i in range(200)], "/end"]
    assert out.count(b"HTTP/1.1 200") == 202


def test_pipelined_requests_past_the_bound_wait_unread() -> None:
    """Requests written one by one while the first is held: the server parses at most ``max_pipelined``
    of them and stops reading; once the first is answered all are, in order."""
    with serving_own(app, Limits(max_pipelined=3)) as server, connect(server) as s:
        s.sendall(get("/wait"))
        time.sleep(0.1)
        for i in range(30):
            s.sendall(get(f"/p{i}"))
            time.sleep(0.005)
        time.sleep(0.3)
        queued = [len(c.queue) for c in list(server.conns)]
        assert queued and max(queued) <= 3
        gate.set()
        s.sendall(get("/end", b"connection: close\r\n"))
        out = read_all(s, 10)
    assert seen == ["/wait", *[f"/p{i}" for i in range(30)], "/end"]
    assert out.count(b"HTTP/1.1 200") == 32


def test_a_client_that_never_reads_does_not_grow_server_memory() -> None:
    """The app's send waits while the transport's buffer is over its mark: 32 MiB are not buffered
    for a client that reads nothing; when it reads, the rest comes."""
    with serving_own(app, Limits(write_buffer_bytes=64 << 10)) as server, connect(server) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)
        s.sendall(get("/big"))
        time.sleep(1.0)
        made = produced[0]
        buffered = [c.transport.get_write_buffer_size() for c in list(server.conns) if c.transport is not None]
        assert made < 12 << 20, made  # the socket buffers of loopback, not 32 MiB
        assert buffered and max(buffered) <= (64 << 10) * 2
        s.sendall(get("/after", b"connection: close\r\n"))  # pipelined behind; not read while /big waits
        out = read_all(s, 20)
    assert produced[0] == BIG
    assert len(out) > BIG and out.endswith(b"ok /after 0")


def test_connections_beyond_the_cap_get_503_with_retry_after() -> None:
    with serving_own(app, Limits(max_connections=3, retry_after_s=2)) as server:
        held = [connect(server) for _ in range(3)]
        try:
            for i, s in enumerate(held):
                s.sendall(get(f"/h{i}"))
                assert s.recv(65536).startswith(b"HTTP/1.1 200")
            with connect(server) as extra:
                out = read_all(extra)
            assert out.startswith(b"HTTP/1.1 503") and b"retry-after: 2\r\n" in out and b"connection: close" in out
            held.pop().close()
            deadline = time.monotonic() + 5
            while len(server.conns) >= 3:
                assert time.monotonic() < deadline
                time.sleep(0.02)
            with connect(server) as again:
                again.sendall(get("/again"))
                assert again.recv(65536).startswith(b"HTTP/1.1 200")
        finally:
            for s in held:
                s.close()
    assert "/again" in seen


BODIES = [  # (name, request, expected status)
    ("content-length over the cap", b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: 2000000\r\n\r\n", 413),
    ("chunked past the cap", b"POST / HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n"
     + b"%x\r\n%s\r\n" % (600_000, b"a" * 600_000) * 3 + b"0\r\n\r\n", 413),
    ("at the cap", b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: 1000000\r\n\r\n" + b"a" * 1_000_000, 200),
]


@pytest.mark.parametrize(("request_", "status"), [(r, s) for _, r, s in BODIES], ids=[n for n, *_ in BODIES])
def test_bodies_are_bounded(request_: bytes, status: int) -> None:
    with serving_own(app, Limits(max_body_bytes=1_000_000)) as server, connect(server) as s:
        send_all(s, request_)
        out = read_all(s, 3)
    assert out.startswith(b"HTTP/1.1 %d" % status), out[:200]
    assert seen == (["/"] if status == 200 else [])


def connect_from(server: Any, source: str) -> socket.socket:
    """A connection from another loopback address (Linux answers on all of 127.0.0.0/8)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.settimeout(10)
    s.bind((source, 0))
    s.connect(("127.0.0.1", server.bound[1]))
    return s


def test_one_client_address_cannot_take_every_connection() -> None:
    """40 idle connections from 127.0.0.1 (its share is 10 of the 40): past its share that client is answered 503
    with Retry-After, while 127.0.0.2 is still served."""
    with serving_own(app, Limits(max_connections=40, max_connections_per_client=10, retry_after_s=2)) as server:
        held = [connect(server) for _ in range(10)]
        flood = [connect(server) for _ in range(30)]  # past its share, up to the server's whole cap
        try:
            with connect_from(server, "127.0.0.2") as other:
                other.sendall(get("/other", b"connection: close\r\n"))
                answer = read_all(other)
            assert answer.startswith(b"HTTP/1.1 200"), answer[:200]
            refused = [read_all(s, 5) for s in flood]
            held.pop().close()
            deadline = time.monotonic() + 5
            while len(server.conns) >= 10:  # its slot comes back when one of its connections ends
                assert time.monotonic() < deadline
                time.sleep(0.02)
            with connect(server) as again:
                again.sendall(get("/again", b"connection: close\r\n"))
                again_answer = read_all(again)
        finally:
            for s in held + flood:
                s.close()
    assert all(r.startswith(b"HTTP/1.1 503") and b"retry-after: 2\r\n" in r for r in refused), refused[:1]
    assert again_answer.startswith(b"HTTP/1.1 200"), again_answer[:200]
    assert seen == ["/other", "/again"]
