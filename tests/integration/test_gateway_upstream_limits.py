"""What a model server sends the gateway is bounded: a whole answer past ``max_upstream_body_bytes``
is a 502, an SSE event past ``max_sse_event_bytes`` ends the stream with the error event (or, before
the first token, moves on), and a stream the gateway's reader lags behind stops being read. The model
server is a scripted socket server (fault injection); the gateway is served by its own server."""

from __future__ import annotations

import asyncio
import socket
import socketserver
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import orjson
import pytest

from tensora.gateway.breaker import Policy
from tensora.gateway.limits import MemoryLimiter
from tensora.gateway.proxy import Gateway, Options
from tensora.gateway.upstream import _HIGH, Client
from tensora.keys import apikeys
from tests.support.gateway_harness import chat, make_table, replica, serving_own, sse_payloads

pytestmark = pytest.mark.timeout(60)

ALICE = apikeys.generate()
LIMIT = 1 << 20  # max_upstream_body_bytes in these tests
EVENT = 64 << 10  # max_sse_event_bytes


def completion(text: str) -> bytes:
    return orjson.dumps({"id": "c", "object": "chat.completion", "model": "m", "choices": [
        {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1}})


def whole(body: bytes) -> bytes:
    return b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(body) + body


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


SSE_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
FIRST = b'data: {"choices":[{"index":0,"delta":{"content":"hi"}}]}\n\n'
HUGE_EVENT = b"data: " + b"a" * (EVENT * 3)  # no blank line: one event that never ends


class Scripted:
    """A model server that answers every request with ``reply`` (bytes, or a list written a piece at a time)."""

    def __init__(self) -> None:
        self.reply: Callable[[], list[bytes]] = lambda: [whole(completion("ok"))]
        self.pause = 0.01  # between pieces
        self.sent = 0  # bytes written so far
        outer = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                data = b""
                while b"\r\n\r\n" not in data:
                    if not (got := self.request.recv(65536)):
                        return
                    data += got
                head, _, body = data.partition(b"\r\n\r\n")
                length = int(next(v for k, v in (h.split(b":", 1) for h in head.split(b"\r\n")[1:])
                                  if k.strip().lower() == b"content-length"))
                while len(body) < length:
                    body += self.request.recv(65536)
                try:
                    for piece in outer.reply():
                        self.request.sendall(piece)
                        outer.sent += len(piece)
                        time.sleep(outer.pause)
                    time.sleep(0.2)
                except OSError:
                    pass

        socketserver.ThreadingTCPServer.allow_reuse_address = True
        self.server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def upstream() -> Iterator[Scripted]:
    s = Scripted()
    try:
        yield s
    finally:
        s.close()


@pytest.fixture
def gateway(upstream: Scripted) -> Iterator[str]:
    table = make_table([{"id": "wl_main", "name": "my-llm", "owner": "alice",
                         "replicas": [replica("r1", upstream.url)]}], {ALICE: ("alice", ["inference"])})
    o = Options(ttft_s=2.0, deadline_s=30.0, breaker=Policy(consecutive=1000), max_upstream_body_bytes=LIMIT,
                max_sse_event_bytes=EVENT)
    with serving_own(Gateway(o, lambda: table, MemoryLimiter(), None)) as server:
        yield f"http://127.0.0.1:{server.bound[1]}/v1"


def post(url: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{url}/chat/completions", json=body, headers={"Authorization": f"Bearer {ALICE}"}, timeout=20)


WHOLE = [  # (name, the answer's text length, expected status)
    ("well under", 1000, 200),
    ("just under", LIMIT - 400, 200),
    ("over", LIMIT + 1, 502),
    ("far over", 8 * LIMIT, 502),
]


@pytest.mark.parametrize(("size", "status"), [(n, s) for _, n, s in WHOLE], ids=[name for name, *_ in WHOLE])
def test_a_whole_answer_past_the_bound_is_a_502(upstream: Scripted, gateway: str, size: int, status: int) -> None:
    upstream.reply = lambda: [whole(completion("x" * size))]
    r = post(gateway, chat())
    assert r.status_code == status, r.text[:300]
    if status == 502:
        assert r.json()["error"]["code"] == "upstream_too_large"
        assert r.headers["x-tensora-attempts"] == "my-llm/r1:body_too_large"
    else:
        assert r.json()["choices"][0]["message"]["content"] == "x" * size


def test_a_4xx_whose_body_is_past_the_bound_is_passed_on_with_an_error_saying_so(upstream: Scripted,
                                                                                gateway: str) -> None:
    body = orjson.dumps({"error": {"message": "x" * (2 * LIMIT), "type": "invalid_request_error"}})
    upstream.reply = lambda: [b"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\n"
                              b"content-length: %d\r\n\r\n" % len(body) + body]
    r = post(gateway, chat())
    assert r.status_code == 400, r.text[:300]
    assert r.json()["error"]["code"] == "upstream_400" and "could not be read" in r.json()["error"]["message"]
    assert r.headers["x-tensora-attempts"] == "my-llm/r1:http_400"

def test_an_event_past_the_bound_after_the_first_token_ends_the_stream_with_the_error_event(
        upstream: Scripted, gateway: str) -> None:
    upstream.reply = lambda: [SSE_HEAD, chunk(FIRST), *[chunk(HUGE_EVENT[i:i + 8192])
                                                        for i in range(0, len(HUGE_EVENT), 8192)]]
    r = post(gateway, chat(stream=True))
    assert r.status_code == 200
    events = sse_payloads(r.text)
    assert orjson.loads(events[0])["choices"][0]["delta"]["content"] == "hi"
    assert orjson.loads(events[-2])["error"]["code"] == "upstream_failed" and "event_too_large" in events[-2]
    assert events[-1] == "[DONE]" and len(r.content) < EVENT


def test_an_event_past_the_bound_before_the_first_token_fails_the_attempt(upstream: Scripted, gateway: str) -> None:
    upstream.reply = lambda: [SSE_HEAD, chunk(HUGE_EVENT)]
    r = post(gateway, chat(stream=True))
    assert r.status_code == 503
    assert r.headers["x-tensora-attempts"] == "my-llm/r1:event_too_large"


def test_events_under_the_bound_pass(upstream: Scripted, gateway: str) -> None:
    big = b'data: {"choices":[{"index":0,"delta":{"content":"' + b"y" * (EVENT - 200) + b'"}}]}\n\n'
    upstream.reply = lambda: [SSE_HEAD, chunk(FIRST), chunk(big), chunk(b"data: [DONE]\n\n"), b"0\r\n\r\n"]
    r = post(gateway, chat(stream=True))
    events = sse_payloads(r.text)
    assert [orjson.loads(e)["choices"][0]["delta"]["content"][:3] for e in events[:-1]] == ["hi", "yyy"]
    assert events[-1] == "[DONE]"


def test_a_stream_the_reader_lags_behind_stops_being_read(upstream: Scripted) -> None:
    """20 MiB sent as fast as the socket takes them: unread, the client holds about ``_HIGH`` of them."""
    piece = chunk(b"z" * (1 << 20))
    upstream.reply = lambda: [SSE_HEAD, *[piece] * 20, b"0\r\n\r\n"]

    async def run() -> tuple[int, int]:
        client = Client(max_body=64 << 20)
        resp = await client.post(upstream.url, "/chat/completions", b"{}", [], 5.0)
        await asyncio.sleep(0.5)
        held = resp._queued
        total = len(await resp.read())
        resp.release()
        client.close()
        return held, total

    held, total = asyncio.run(run())
    assert held <= _HIGH + (1 << 20), held
    assert total == 20 << 20


def test_scripted_server_speaks_http(upstream: Scripted) -> None:
    """The fake itself: a sanity check that a failure above is the gateway's, not the script's."""
    with socket.create_connection(upstream.server.server_address) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\n\r\n{}")
        assert s.recv(65536).startswith(b"HTTP/1.1 200")


def test_a_client_that_never_reads_a_stream_holds_back_the_model_server(upstream: Scripted, gateway: str) -> None:
    """32 MiB of events for a client that reads none: the gateway's buffers stay bounded, so the model
    server is held back by TCP (what it got out is the sockets' buffers, about 8 MiB); then all arrive."""
    event = b'data: {"choices":[{"index":0,"delta":{"content":"' + b"w" * 8000 + b'"}}]}\n\n'
    pieces = [chunk(event * 128)] * 32  # 32 x 1 MiB
    upstream.pause = 0
    upstream.reply = lambda: [SSE_HEAD, *pieces, chunk(b"data: [DONE]\n\n"), b"0\r\n\r\n"]
    port = int(gateway.rsplit(":", 1)[1].split("/")[0])
    body = orjson.dumps(chat(stream=True))
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer %s\r\n"
                  b"content-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (ALICE.encode(), len(body), body))
        time.sleep(2.0)
        held_back = upstream.sent
        s.settimeout(30)
        got = b""
        while not got.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n"):
            got += s.recv(1 << 20)
    assert held_back < 20 << 20, held_back
    assert got.count(b'"content":"www') == 32 * 128


def test_a_body_that_came_whole_is_taken_at_once_and_leaves_its_connection_readable() -> None:
    """``read_now`` (the relay's way to a whole answer without a timer) takes a body that is all in. One that
    went past ``_HIGH`` on its last read paused the connection: taken, it must not go back to the pool paused
    (the next answer on it would never be read)."""
    from tensora.gateway.upstream import _END, Pool, Response, _Conn

    class Transport:  # what a connection asks of its transport here (a compiled Response takes only a real _Conn)
        def get_extra_info(self, name: str) -> None:
            return None

        def pause_reading(self) -> None:
            pass

        def resume_reading(self) -> None:
            pass

    conn = _Conn(Pool("127.0.0.1", 9), asyncio.new_event_loop())
    conn.connection_made(Transport())  # type: ignore[arg-type]
    resp = Response(conn, 64 << 20)
    resp._push(b"a" * (_HIGH - 10))
    assert resp.read_now() is None and resp.ready()  # not all in yet
    resp._push(b"b" * 100)
    resp._push(_END)
    assert conn.paused
    assert resp.read_now() == b"a" * (_HIGH - 10) + b"b" * 100 and not conn.paused and not resp.ready()
    conn.loop.close()


KEPT = [  # answers one kept-alive connection gives in turn: each framing after each other one
    ("whole", whole(completion("one")), completion("one")),
    ("chunked", b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n" + chunk(b"tw") + chunk(b"o") + b"0\r\n\r\n",
     b"two"),
    ("a stream", SSE_HEAD + chunk(FIRST) + chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n", FIRST + b"data: [DONE]\n\n"),
    ("a 429", b"HTTP/1.1 429 Too Many Requests\r\nretry-after: 1\r\ncontent-length: 4\r\n\r\nbusy", b"busy"),
    ("empty", b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n", b""),
    ("whole again", whole(completion("six")), completion("six")),
]


def test_one_kept_alive_connection_carries_answers_of_every_framing_in_turn() -> None:
    """The client's parser, kept with its connection from one answer to the next, reads each whole, whatever came
    before it on that connection: one connection for all of them."""
    accepted = []

    async def run() -> list[tuple[int, bytes]]:
        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            accepted.append(writer)
            for _, answer, _ in KEPT:
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(next(line.split(b":", 1)[1] for line in head.split(b"\r\n")
                                  if line.lower().startswith(b"content-length:")))
                await reader.readexactly(length)
                writer.write(answer)
                await writer.drain()

        srv = await asyncio.start_server(serve, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{srv.sockets[0].getsockname()[1]}/v1"
        client = Client()
        got = []
        for _ in KEPT:
            resp = await client.post(url, "/chat/completions", b"{}", [], 5.0)
            got.append((resp.status, await resp.read()))
            resp.release()
        client.close()
        for writer in accepted:
            writer.close()
            await writer.wait_closed()
        srv.close()
        await srv.wait_closed()
        return got

    got = asyncio.run(run())
    assert got == [(429 if name == "a 429" else 200, body) for name, _, body in KEPT]
    assert len(accepted) == 1
