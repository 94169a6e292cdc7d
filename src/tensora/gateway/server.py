"""A lean HTTP/1.1 server for the gateway's ASGI app, on uvloop and httptools.

Written here rather than run under uvicorn: uvicorn is where the gateway lost most of its time
per request (measured with py-spy under bench/gateway.py: a regex check of every header, the
status line and headers written apart from the body, an ASGI task and message dicts per
request). This speaks just what the gateway needs: keep-alive (requests on one connection answered
in order), a response written in one piece when its body is whole (content-length added), chunked
transfer for streams, a body size cap, the ASGI lifespan, and a graceful stop on SIGTERM/SIGINT
(stop accepting, let requests in flight finish for up to ``grace_s``, run the app's shutdown).
The app stays a plain ASGI app: the tests also serve it with uvicorn.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections import deque
from collections.abc import Awaitable, Callable
from http import HTTPStatus
from typing import Any

import httptools

from tensora.gateway.upstream import nodelay

log = logging.getLogger("tensora.gateway")

App = Callable[[dict[str, Any], Callable[[], Awaitable[dict[str, Any]]],
                Callable[[dict[str, Any]], Awaitable[None]]], Awaitable[None]]

_REASONS = {s.value: s.phrase.encode() for s in HTTPStatus}


def _status_line(status: int) -> bytes:
    return b"HTTP/1.1 %d %s\r\n" % (status, _REASONS.get(status, b"Unknown"))


class _Request:
    __slots__ = ("body", "headers", "keep_alive", "method", "url")

    def __init__(self) -> None:
        self.url = b""
        self.headers: list[tuple[bytes, bytes]] = []
        self.body: list[bytes] = []
        self.method = b""
        self.keep_alive = True


class _Conn(asyncio.Protocol):
    def __init__(self, server: Server) -> None:
        self.server = server
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.req = _Request()
        self.size = 0
        self.queue: deque[_Request] = deque()
        self.task: asyncio.Task[None] | None = None
        self.lost: asyncio.Future[None] | None = None
        self.closed = False

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        nodelay(transport)
        self.lost = self.server.loop.create_future()
        self.server.conns.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.server.conns.discard(self)
        if self.lost is not None and not self.lost.done():
            self.lost.set_result(None)
        if self.task is not None and not self.task.done():
            self.task.cancel()  # the client is gone: stop the upstream work for it

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._reject(400, b"upgrades are not supported")
        except httptools.HttpParserError:
            self._reject(400, b"malformed HTTP request")

    def _reject(self, status: int, message: bytes) -> None:
        body = b'{"error":{"message":"' + message + b'","type":"invalid_request_error"}}'
        if self.transport is not None and not self.closed:
            self.transport.write(_status_line(status) + b"content-type: application/json\r\ncontent-length: %d\r\n"
                                 b"connection: close\r\n\r\n" % len(body) + body)
            self.transport.close()
            self.closed = True

    def _abort(self, wrote: bool) -> None:
        if not wrote:
            self._reject(500, b"internal gateway error")
        elif self.transport is not None:
            self.transport.close()  # a half-written response: the client sees the connection end

    # httptools callbacks
    def on_message_begin(self) -> None:
        self.req = _Request()
        self.size = 0

    def on_url(self, url: bytes) -> None:
        self.req.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self.req.headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        self.req.method = self.parser.get_method()
        self.req.keep_alive = self.parser.should_keep_alive()

    def on_body(self, body: bytes) -> None:
        self.size += len(body)
        if self.size <= self.server.max_body_bytes + 1:  # past the cap, the app answers 413 on what it has
            self.req.body.append(body)

    def on_message_complete(self) -> None:
        self.queue.append(self.req)
        if self.task is None:
            self._next()

    def _next(self) -> None:
        if self.closed or not self.queue:
            self.task = None
            return
        req = self.queue.popleft()
        self.task = self.server.loop.create_task(self._run(req))

    async def _run(self, req: _Request) -> None:
        path, _, query = req.url.partition(b"?")
        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
                 "method": req.method.decode("latin-1"), "path": path.decode("latin-1"), "raw_path": path,
                 "query_string": query, "headers": req.headers, "server": self.server.bound,
                 "client": self.transport.get_extra_info("peername") if self.transport else None}
        body = req.body[0] if len(req.body) == 1 else b"".join(req.body)
        sent_body = False
        state: dict[str, Any] = {"head": None, "chunked": False, "done": False, "wrote": False}

        async def receive() -> dict[str, Any]:
            nonlocal sent_body
            if not sent_body:
                sent_body = True
                return {"type": "http.request", "body": body, "more_body": False}
            assert self.lost is not None
            await self.lost
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            if self.closed or state["done"]:
                return
            t = self.transport
            assert t is not None
            if message["type"] == "http.response.start":
                state["head"] = (message["status"], message.get("headers", []))
                return
            data = message.get("body", b"")
            more = message.get("more_body", False)
            if state["head"] is not None:
                status, headers = state["head"]
                state["head"], state["wrote"] = None, True
                lines = [_status_line(status)]
                has_length = False
                for k, v in headers:
                    has_length = has_length or k == b"content-length"
                    lines += [k, b": ", v, b"\r\n"]
                if more:
                    if not has_length:
                        state["chunked"] = True
                        lines.append(b"transfer-encoding: chunked\r\n")
                elif not has_length:
                    lines.append(b"content-length: %d\r\n" % len(data))
                if not req.keep_alive:
                    lines.append(b"connection: close\r\n")
                lines.append(b"\r\n")
                head = b"".join(lines)
                if state["chunked"]:
                    t.write(head + (b"%x\r\n%s\r\n" % (len(data), data) if data else b"")
                            + (b"" if more else b"0\r\n\r\n"))
                else:
                    t.write(head + data)
            elif state["chunked"]:
                t.write((b"%x\r\n%s\r\n" % (len(data), data) if data else b"") + (b"" if more else b"0\r\n\r\n"))
            elif data:
                t.write(data)
            if not more:
                state["done"] = True

        try:
            await self.server.app(scope, receive, send)
        except asyncio.CancelledError:
            return
        except Exception:
            log.exception("the gateway app failed on %s %s", scope["method"], scope["path"])
            self._abort(state["wrote"])
            return
        if not state["done"] and not self.closed:  # the app ended without finishing: do not leave it hanging
            self._abort(state["wrote"])
            return
        if not req.keep_alive and self.transport is not None:
            self.transport.close()
            return
        self._next()


class Server:
    def __init__(self, app: App, host: str, port: int, *, max_body_bytes: int = 8 << 20, grace_s: float = 10.0) -> None:
        self.app, self.host, self.port = app, host, port
        self.max_body_bytes, self.grace_s = max_body_bytes, grace_s
        self.conns: set[_Conn] = set()
        self.bound: tuple[str, int] | None = None
        self.loop: asyncio.AbstractEventLoop = None  # type: ignore[assignment]

    async def _lifespan(self) -> tuple[asyncio.Queue[dict[str, Any]], asyncio.Task[None], asyncio.Queue[Any]]:
        inbox: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        outbox: asyncio.Queue[Any] = asyncio.Queue()

        async def send(message: dict[str, Any]) -> None:
            await outbox.put(message)

        async def lifespan() -> None:
            await self.app({"type": "lifespan", "asgi": {"version": "3.0"}}, inbox.get, send)

        task = asyncio.create_task(lifespan())
        await inbox.put({"type": "lifespan.startup"})
        got = await outbox.get()
        if got["type"] != "lifespan.startup.complete":
            raise RuntimeError(f"the gateway did not start: {got}")
        return inbox, task, outbox

    async def serve(self, stop: asyncio.Event | None = None) -> None:
        self.loop = asyncio.get_running_loop()
        stop = stop or asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
                self.loop.add_signal_handler(sig, stop.set)
        inbox, life, outbox = await self._lifespan()
        server = await self.loop.create_server(lambda: _Conn(self), self.host, self.port, backlog=2048,
                                               reuse_address=True)
        sock = server.sockets[0].getsockname()
        self.bound = (sock[0], sock[1])
        try:
            await stop.wait()
        finally:
            server.close()
            deadline = self.loop.time() + self.grace_s
            while any(c.task is not None for c in self.conns) and self.loop.time() < deadline:
                await asyncio.sleep(0.05)
            for c in list(self.conns):
                if c.transport is not None:
                    c.transport.close()
            await inbox.put({"type": "lifespan.shutdown"})
            with contextlib.suppress(Exception):
                await asyncio.wait_for(outbox.get(), self.grace_s)
            life.cancel()
            with contextlib.suppress(BaseException):
                await life


def run(app: App, host: str, port: int, **kw: Any) -> None:
    try:
        import uvloop

        runner: Any = uvloop.run
    except ImportError:  # no uvloop (Windows): asyncio's own loop
        runner = asyncio.run
    runner(Server(app, host, port, **kw).serve())
