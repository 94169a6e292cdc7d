"""A lean HTTP/1.1 server for the gateway's ASGI app, on uvloop and httptools.

Written here rather than run under uvicorn: under uvicorn the gateway spends most of its time
per request there (measured with py-spy under bench/gateway.py: a regex check of every header, the
status line and headers written apart from the body, an ASGI task and message dicts per
request). This speaks just what the gateway needs: keep-alive (requests on one connection answered
in order), a response written in one piece when its body is whole (content-length added), chunked
transfer for streams, the ASGI lifespan, and a graceful stop on SIGTERM/SIGINT (stop accepting, let
requests in flight finish for up to ``grace_s``, run the app's shutdown).
The app stays a plain ASGI app: the tests also serve it with uvicorn.

Hostile clients are bounded as Envoy bounds them (``Limits``): the request line and headers
(431), the header count (431), the time to send them (408), idle keep-alive connections (closed),
the body (413), connections (503 with Retry-After), connections from one client address on one listener (its
share of them: 503 with Retry-After to that client only; the local driver's sandboxes come in from 127.0.0.1 on a
listener of their own, ``sandbox_sock``, so they share its share and never take the host's clients'), requests
queued on one connection, and the
response bytes waiting for a client that does not read (reading stops, the app's ``send`` waits).
A refusal is answered in its turn after the requests before it, then the connection is closed
after a short linger, so that the client reads the answer rather than a reset.

Busy polling (``Spin``, opt-in: ``busy_poll_s``) keeps the loop polling for a short while after each request comes
in and each answer goes out, rather than sleeping in ``epoll_wait`` the moment it has nothing to do.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import signal
import socket
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

import httptools

from tensora.gateway.upstream import Reads, nodelay

log = logging.getLogger("tensora.gateway")

App = Callable[[dict[str, Any], Callable[[], Awaitable[dict[str, Any]]],
                Callable[[dict[str, Any]], Awaitable[None]]], Awaitable[None]]

_REASONS = {s.value: s.phrase.encode() for s in HTTPStatus}
_STATUS_LINES = {code: b"HTTP/1.1 %d %s\r\n" % (code, phrase) for code, phrase in _REASONS.items()}


_FIELD = b": ".join  # a header's line, without its CRLF

_ASGI = {"version": "3.0"}  # every request's scope["asgi"]: one dict, not one a request (an app reads it)
_LINGER_S = 1.0  # after a refusal: read and drop what the client still sends, then close


@dataclass(frozen=True)
class Limits:
    """What one client may hold of the server; the defaults are Envoy's where it has one."""

    max_header_bytes: int = 60 << 10  # request line and headers (Envoy: max_request_headers_kb 60)
    max_headers: int = 100  # Envoy: max_headers_count
    header_timeout_s: float = 10.0  # from a request's first byte to its last header (Envoy: request_headers_timeout)
    idle_timeout_s: float = 60.0  # a connection with no request in flight, or a body that stops coming
    max_body_bytes: int = 8 << 20
    max_connections: int = 10_000
    max_connections_per_client: int = 1_000  # from one client address: its share, so that one cannot take them all
    max_pipelined: int = 8  # requests parsed and waiting behind the one in flight, per connection
    write_buffer_bytes: int = 64 << 10  # response bytes a slow reader may leave waiting before reading stops
    retry_after_s: int = 1  # on the 503 beyond max_connections (or the client's share)


def _head_lines(status: int, headers: Any) -> tuple[list[bytes], bool]:
    """The status line and header lines of an answer, as the parts of one join; and whether it has a content-length.
    The gateway's headers (a list of tuples of bytes) are taken as typed, faster than the generic way (a ``map``
    of joins, then a join of those); any other iterable of pairs an ASGI app may send
    goes the generic way."""
    lines = [_status_line(status)]
    has_length = False
    if type(headers) is list:
        try:
            return _typed_lines(lines, headers)
        except TypeError:  # not all pairs are tuples of bytes: the generic way, from the start
            lines = [_status_line(status)]
    for k, v in headers:
        if k == b"content-length":
            has_length = True
        lines.append(_FIELD((k, v)) + b"\r\n")
    return lines, has_length


def _typed_lines(lines: list[bytes], headers: list[tuple[bytes, bytes]]) -> tuple[list[bytes], bool]:
    has_length = False
    for k, v in headers:
        if k == b"content-length":
            has_length = True
        lines.append(k)
        lines.append(b": ")
        lines.append(v)
        lines.append(b"\r\n")
    return lines, has_length


def _status_line(status: int) -> bytes:
    line = _STATUS_LINES.get(status)
    return line if line is not None else b"HTTP/1.1 %d Unknown\r\n" % status


class Spin:
    """Busy polling: for ``window_s`` after each ``poke`` the loop polls for I/O without sleeping (a callback is
    always ready, so libuv's poll waits 0), then sleeps as before. A sleeping CPU takes tens of microseconds to
    wake, most of all in a virtual machine (HAProxy's ``busy-polling`` for the same reason: "30 to 100
    microseconds observed"); the figures of the gateway's own are on the benchmarks page. The cost
    is CPU: up to ``window_s`` of one core after each request and each answer, nothing once traffic stops; it
    fills only time the loop would have slept, so one process never spins past one core. Off by default: under a
    CPU limit below one core (a Kubernetes pod's ``limits.cpu: 500m``) the spinning would be throttled."""

    __slots__ = ("loop", "on", "turns", "until", "window_s")

    def __init__(self, loop: asyncio.AbstractEventLoop, window_s: float) -> None:
        self.loop, self.window_s = loop, window_s
        self.until = 0.0
        self.on = False  # a turn is scheduled
        self.turns = 0  # loop turns spun, all told

    def poke(self) -> None:
        self.until = time.perf_counter() + self.window_s
        if not self.on:
            self.on = True
            self.loop.call_soon(self._turn)

    def _turn(self) -> None:
        self.turns += 1
        if time.perf_counter() < self.until:
            self.loop.call_soon(self._turn)
        else:
            self.on = False


class _Refuse(Exception):
    def __init__(self, status: int, message: bytes) -> None:
        super().__init__(status)
        self.status, self.message = status, message


class _Request:
    __slots__ = ("body", "headers", "keep_alive", "method", "refuse", "url")

    def __init__(self) -> None:
        self.url = b""
        self.headers: list[tuple[bytes, bytes]] = []
        self.body: list[bytes] = []
        self.method = b""
        self.keep_alive = True
        self.refuse: _Refuse | None = None  # not a request: the refusal to answer in its turn


class _Conn(asyncio.Protocol):
    def __init__(self, server: Server, per_host: dict[Any, int]) -> None:
        self.server = server
        self.per_host = per_host  # the open connections by client host of the listener this one came in on
        self.limits = server.limits
        self.reads = server.reads
        self.transport: asyncio.Transport | None = None
        self.peer: Any = None  # the client's address: the scope's "client", asked of the transport once
        self.host: Any = None  # the client's host, counted in ``per_host`` while this connection is open
        self.parser = httptools.HttpRequestParser(self)
        self.req = _Request()
        self.size = 0
        self.queue: deque[_Request] = deque()
        self.task: asyncio.Task[None] | None = None  # the connection's, from its first request (``_kick``)
        self.busy = False  # a request (or a refusal) is being answered
        self.wake: asyncio.Future[None] | None = None  # set while the task waits for the next request
        self.lost: asyncio.Future[None] | None = None
        self.closed = False
        self.head = 0  # bytes read of the head being read; -1 while reading a body
        self.length = -1  # the body's content-length; -1: none or chunked
        self.pending = b""  # read but not parsed: the queue was full
        self.deadline: float | None = None  # when ``expire`` runs (the server's sweep looks)
        self.done_reading = False  # a refusal is queued or sent: nothing more is parsed
        self.paused = False  # reading paused (a full queue, or a client that does not read)
        self.drain: asyncio.Future[None] | None = None  # set while the write buffer is over its mark

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        loop = self.server.loop
        if len(self.server.conns) >= self.limits.max_connections:
            self.done_reading = True
            self._reject(503, b"the gateway is at its connection limit", [b"retry-after: %d\r\n" %
                                                                          self.limits.retry_after_s])
            return
        self.peer = peer = transport.get_extra_info("peername")
        host = peer[0] if type(peer) is tuple else ""  # a unix socket's clients: one
        per_host = self.per_host
        held = per_host.get(host, 0)
        if held >= self.limits.max_connections_per_client:
            self.done_reading = True
            self._reject(503, b"this client is at its connection limit", [b"retry-after: %d\r\n" %
                                                                          self.limits.retry_after_s])
            return
        per_host[host] = held + 1
        self.host = host
        nodelay(transport)
        transport.set_write_buffer_limits(high=self.limits.write_buffer_bytes)  # type: ignore[attr-defined]
        self.lost = loop.create_future()
        self.deadline = self.server.now + self.limits.idle_timeout_s
        self.server.conns.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.deadline = None
        self.server.conns.discard(self)
        if self.host is not None:
            self._release()
        if self.lost is not None and not self.lost.done():
            self.lost.set_result(None)
        if self.drain is not None and not self.drain.done():
            self.drain.set_result(None)
        if self.task is not None and not self.task.done():
            self.task.cancel()  # the client is gone: stop the upstream work for it

    def _release(self) -> None:
        """Give the client's connection back to its share."""
        per_host = self.per_host
        left = per_host.get(self.host, 1) - 1
        if left > 0:
            per_host[self.host] = left
        else:
            per_host.pop(self.host, None)
        self.host = None

    def pause_writing(self) -> None:
        self.drain = self.server.loop.create_future()
        self._flow()

    def resume_writing(self) -> None:
        d, self.drain = self.drain, None
        if d is not None and not d.done():
            d.set_result(None)
        self._flow()

    def _flow(self) -> None:
        """Read only while the client takes its answers and the queue has room."""
        if self.pending and len(self.queue) < self.limits.max_pipelined and not self.done_reading:
            data, self.pending = self.pending, b""
            self._feed(data)
        pause = ((self.drain is not None or self.pending or len(self.queue) >= self.limits.max_pipelined)
                 and not self.done_reading)
        if pause != self.paused and self.transport is not None and not self.closed:
            self.paused = pause
            if pause:
                self.transport.pause_reading()
            else:
                self.transport.resume_reading()

    def data_received(self, data: bytes) -> None:
        self.reads.n += 1  # the upstream connections' liveness check asks the socket less for it (``_Conn.unused``)
        spin = self.server.spin
        if spin is not None:
            spin.poke()  # the upstream's answer comes soon: poll for it rather than sleep
        if self.done_reading:
            return  # refused: what still comes is dropped
        if self.pending:
            self.pending += data
            return
        self._feed(data)

    def _feed(self, data: bytes) -> None:
        """Parse ``data``; when it may hold more requests than the queue has room for, a message at a time
        (a head ends at its blank line, a body at its length), so that what follows a full queue waits
        unparsed in ``pending`` (reading paused) rather than queued."""
        i, n = 0, len(data)
        lim = self.limits
        if n + max(self.head, 0) <= lim.max_header_bytes and len(self.queue) + data.count(b"\r\n\r\n") < \
                lim.max_pipelined:  # no head in it can be too large, nor the queue fill: all at once
            if self.head >= 0:
                if self.head == 0:
                    self.deadline = self.server.now + lim.header_timeout_s
                self.head += n
            self._parse(data)
            return
        view = memoryview(data)
        while i < n:
            if self.done_reading:
                return
            if len(self.queue) >= self.limits.max_pipelined:
                self.pending = bytes(view[i:])
                self._flow()
                return
            if self.head >= 0:
                j = data.find(b"\r\n\r\n", i)
                end = n if j < 0 else j + 4
                if self.head == 0:  # a head begins: it has header_timeout_s to arrive whole
                    self.deadline = self.server.now + self.limits.header_timeout_s
                self.head += end - i
            else:
                end = n if self.length < 0 else min(n, i + max(1, self.length - self.size))
            self._parse(data if end - i == n else view[i:end])
            i = end

    def _parse(self, data: bytes | memoryview) -> None:
        try:
            self.parser.feed_data(data)
            if self.head > self.limits.max_header_bytes:  # still in the head after all of this
                raise _Refuse(431, b"the request line and headers are over %d bytes" % self.limits.max_header_bytes)
        except _Refuse as r:
            self._refuse(r)
        except httptools.HttpParserUpgrade:
            self._refuse(_Refuse(400, b"upgrades are not supported"))
        except httptools.HttpParserError as exc:
            why = exc.__context__  # a callback's own refusal, else the parser's
            self._refuse(why if isinstance(why, _Refuse) else _Refuse(400, b"malformed HTTP request"))

    def _refuse(self, r: _Refuse) -> None:
        """Parse nothing more; answer ``r`` after the requests already queued, then close."""
        self.done_reading = True
        self.deadline = None
        req = _Request()
        req.refuse = r
        self.queue.append(req)
        if self.paused and self.transport is not None:
            self.paused = False
            self.transport.resume_reading()  # drop what comes, rather than leave it unread (a reset)
        self._kick()

    def expire(self) -> None:
        """A deadline passed: an idle connection is closed; a head or body that stopped coming is a 408."""
        self.deadline = None
        if self.head == 0 and not self.busy and not self.queue:
            if self.transport is not None:
                self.transport.close()
        elif not self.done_reading:
            self._refuse(_Refuse(408, b"the request did not arrive in time"))

    def _reject(self, status: int, message: bytes, extra: list[bytes] | None = None) -> None:
        body = b'{"error":{"message":"' + message + b'","type":"invalid_request_error"}}'
        t = self.transport
        if t is not None and not self.closed:
            t.write(_status_line(status) + b"content-type: application/json\r\ncontent-length: %d\r\n"
                    b"connection: close\r\n%s\r\n" % (len(body), b"".join(extra or [])) + body)
            self.closed = True
            if t.can_write_eof():
                t.write_eof()  # the answer, then EOF; read on a moment so the client is not sent a reset
                self.server.loop.call_later(_LINGER_S, t.close)
            else:
                t.close()

    def _abort(self, wrote: bool) -> None:
        if not wrote:
            self._reject(500, b"internal gateway error")
        elif self.transport is not None:
            self.transport.close()  # a half-written response: the client sees the connection end

    # httptools callbacks
    def on_message_begin(self) -> None:
        self.req = _Request()
        self.size = 0
        self.length = -1

    def on_url(self, url: bytes) -> None:
        self.req.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        name = name.lower()
        self.req.headers.append((name, value))
        if name == b"content-length" and value.isdigit():
            self.length = int(value)
            if self.length > self.limits.max_body_bytes:
                raise _Refuse(413, b"the body is over %d bytes" % self.limits.max_body_bytes)  # before it is sent

    def on_headers_complete(self) -> None:
        if self.head > self.limits.max_header_bytes:  # exact: a large read is parsed a head at a time
            raise _Refuse(431, b"the request line and headers are over %d bytes" % self.limits.max_header_bytes)
        if len(self.req.headers) > self.limits.max_headers:  # counted here: the head's size bounds them meanwhile
            raise _Refuse(431, b"more than %d headers" % self.limits.max_headers)
        self.req.method = self.parser.get_method()
        self.req.keep_alive = self.parser.should_keep_alive()
        self.head = -1
        self.deadline = self.server.now + self.limits.idle_timeout_s  # for the body

    def on_body(self, body: bytes) -> None:
        self.size += len(body)
        if self.size > self.limits.max_body_bytes:
            raise _Refuse(413, b"the body is over %d bytes" % self.limits.max_body_bytes)
        self.req.body.append(body)
        self.deadline = self.server.now + self.limits.idle_timeout_s

    def on_message_complete(self) -> None:
        self.head = 0
        self.deadline = None
        self.queue.append(self.req)
        if len(self.queue) >= self.limits.max_pipelined:
            self._flow()
        self._kick()

    def _kick(self) -> None:
        """Something is queued: the connection's task takes it. One task a connection, made at its first request and
        waiting between requests, rather than one a request: a task's making (and its registration among all
        tasks) was a step of its own on the way of every request."""
        if self.busy:
            return  # it takes the queue in turn
        self.busy = True
        if self.task is None:
            self.task = self.server.loop.create_task(self._serve())
        elif self.wake is not None and not self.wake.done():
            self.wake.set_result(None)

    async def _serve(self) -> None:
        """The connection's requests, one at a time in their order; between them, idle until ``_kick``."""
        while not self.closed:
            if not self.queue:
                self.busy = False
                if self.head == 0 and self.deadline is None:
                    self.deadline = self.server.now + self.limits.idle_timeout_s
                self.wake = self.server.loop.create_future()
                await self.wake  # cancelled when the connection is lost
                self.wake = None
                continue
            req = self.queue.popleft()
            if req.refuse is not None:
                self.busy = False
                self._reject(req.refuse.status, req.refuse.message)
                return
            if self.paused or self.pending:
                self._flow()  # room in the queue: parse what waits, read again
            if not await self._run(req):
                return

    async def _run(self, req: _Request) -> bool:
        """Answer ``req``; whether the connection goes on to the next request."""
        path, _, query = req.url.partition(b"?")
        scope = {"type": "http", "asgi": _ASGI, "http_version": "1.1",
                 "method": req.method.decode("latin-1"), "path": path.decode("latin-1"), "raw_path": path,
                 "query_string": query, "headers": req.headers, "server": self.server.bound, "client": self.peer}
        body = req.body[0] if len(req.body) == 1 else b"".join(req.body)
        sent_body = False
        head: tuple[int, list[tuple[bytes, bytes]]] | None = None  # the status and headers, until the body's first part
        chunked = done = wrote = False

        async def receive() -> dict[str, Any]:
            nonlocal sent_body
            if not sent_body:
                sent_body = True
                return {"type": "http.request", "body": body, "more_body": False}
            assert self.lost is not None
            await self.lost
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            nonlocal head, chunked, done, wrote
            if self.closed or done:
                return
            t = self.transport
            assert t is not None
            if message["type"] == "http.response.start":
                head = (message["status"], message.get("headers", []))
                return
            data = message.get("body", b"")
            more = message.get("more_body", False)
            if head is not None:
                status, headers = head
                head, wrote = None, True
                lines, has_length = _head_lines(status, headers)
                if more:
                    if not has_length:
                        chunked = True
                        lines.append(b"transfer-encoding: chunked\r\n")
                elif not has_length:
                    lines.append(b"content-length: %d\r\n" % len(data))
                if not req.keep_alive:
                    lines.append(b"connection: close\r\n")
                lines.append(b"\r\n")
                if chunked:
                    lines += [b"%x\r\n%s\r\n" % (len(data), data) if data else b"", b"" if more else b"0\r\n\r\n"]
                else:
                    lines.append(data)
                t.write(b"".join(lines))
            elif chunked:
                t.write((b"%x\r\n%s\r\n" % (len(data), data) if data else b"") + (b"" if more else b"0\r\n\r\n"))
            elif data:
                t.write(data)
            if not more:
                done = True
                spin = self.server.spin
                if spin is not None:
                    spin.poke()  # and the client's next request
            if self.drain is not None:  # the client is not reading: hold the app until it does
                await self.drain

        try:
            await self.server.app(scope, receive, send)
        except asyncio.CancelledError:
            return False
        except Exception:
            log.exception("the gateway app failed on %s %s", scope["method"], scope["path"])
            self._abort(wrote)
            return False
        if not done and not self.closed:  # the app ended without finishing: do not leave it hanging
            self._abort(wrote)
            return False
        if not req.keep_alive and self.transport is not None:
            self.transport.close()
            return False
        return True


class Server:
    """The gateway's server on ``host:port``, and on ``sandbox_sock`` (a listening socket) when given: the local
    driver's sandboxes' listener, whose clients have shares of their own (``sandbox_per_host``)."""

    def __init__(self, app: App, host: str, port: int, *, limits: Limits | None = None, grace_s: float = 10.0,
                 own_process: bool = False, busy_poll_s: float = 0.0, sandbox_sock: socket.socket | None = None,
                 reads: Reads | None = None) -> None:
        self.app, self.host, self.port = app, host, port
        self.reads = reads if reads is not None else Reads()  # the app's (``proxy.Gateway.reads``): counted here too
        self.sandbox_sock = sandbox_sock
        self.own_process = own_process  # the process is this server's alone: its collector is tuned (``quiet_gc``)
        self.limits, self.grace_s = limits or Limits(), grace_s
        self.conns: set[_Conn] = set()
        self.per_host: dict[Any, int] = {}  # open connections by client host (``Limits.max_connections_per_client``)
        self.sandbox_per_host: dict[Any, int] = {}  # the same on the sandboxes' listener
        self.bound: tuple[str, int] | None = None
        self.loop: asyncio.AbstractEventLoop = None  # type: ignore[assignment]
        self.now = 0.0  # the loop's time at the last sweep: deadlines are a tick coarse, never a call per request
        self.busy_poll_s = busy_poll_s
        self.spin: Spin | None = None  # busy polling, when ``busy_poll_s`` (made with the loop)

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

    async def _sweep(self) -> None:
        """Connection deadlines, looked at a few times a second rather than a timer per request."""
        lim = self.limits
        tick = min(1.0, max(0.01, min(lim.header_timeout_s, lim.idle_timeout_s) / 10))
        while True:
            await asyncio.sleep(tick)
            self.now = now = self.loop.time()
            for c in [c for c in self.conns if c.deadline is not None and c.deadline <= now]:
                try:
                    c.expire()
                except Exception:  # one connection's trouble must not end the sweep for all
                    log.exception("closing an expired connection failed")
                    if c.transport is not None:
                        c.transport.abort()

    async def serve(self, stop: asyncio.Event | None = None) -> None:
        self.loop = asyncio.get_running_loop()
        self.now = self.loop.time()
        self.spin = Spin(self.loop, self.busy_poll_s) if self.busy_poll_s > 0 else None
        stop = stop or asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
                self.loop.add_signal_handler(sig, stop.set)
        inbox, life, outbox = await self._lifespan()
        server = await self.loop.create_server(lambda: _Conn(self, self.per_host), self.host, self.port,
                                               backlog=2048, reuse_address=True)
        self.bound = _bound(server)
        sandboxes = None
        if self.sandbox_sock is not None:
            sandboxes = await self.loop.create_server(lambda: _Conn(self, self.sandbox_per_host),
                                                      sock=self.sandbox_sock, backlog=2048)
        if self.own_process:
            quiet_gc()
        sweep = asyncio.create_task(self._sweep())
        stopped: BaseException | None = None
        try:
            await stop.wait()
        except BaseException as exc:  # cancelled: shut down all the same, then raise it
            stopped = exc  # out of the handler, as compiled code needs: test_gateway_compiled_rules
        sweep.cancel()
        server.close()
        if sandboxes is not None:
            sandboxes.close()
        await self._shut_down(inbox, life, outbox)
        if stopped is not None:
            raise stopped

    async def _shut_down(self, inbox: asyncio.Queue[dict[str, Any]], life: asyncio.Task[None],
                         outbox: asyncio.Queue[Any]) -> None:
        """Let the requests in flight end (up to ``grace_s``), close every connection, then the app's lifespan."""
        deadline = self.loop.time() + self.grace_s
        while any(c.busy for c in self.conns) and self.loop.time() < deadline:
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


def _bound(server: Any) -> tuple[str, int]:
    """The address a server listens on. ``Any``: uvloop's ``sockets`` is a list where asyncio's types say a tuple,
    which compiled code (mypyc) checks and refuses."""
    name = server.sockets[0].getsockname()
    return name[0], name[1]


def quiet_gc(gen0: int = 50_000) -> None:
    """For a process that is the server: the collector's pauses out of the tail of latency.

    Under load a full collection walked all the objects of start-up (pydantic, httpx, the route table), a pause
    long enough to be the whole tail latency (the benchmarks page). What start-up made is frozen
    (never scanned again), and the young generation collected every ``gen0`` net allocations rather than 700:
    a request leaves almost no cyclic garbage (what it allocates dies by reference counting), so collections
    find little, and fewer of them are most of their cost."""
    gc.collect()
    gc.freeze()
    _, g1, g2 = gc.get_threshold()
    gc.set_threshold(gen0, g1, g2)


def run(app: App, host: str, port: int, **kw: Any) -> None:
    try:
        import uvloop

        runner: Any = uvloop.run
    except ImportError:  # no uvloop (Windows): asyncio's own loop
        runner = asyncio.run
    runner(Server(app, host, port, own_process=True, **kw).serve())
