"""The control API's HTTP server: uvicorn, with the bounds a server shared by every tenant needs.

Every sandbox reaches the control API, so a hostile client must be able to slow only itself. uvicorn (0.55) has
an idle keep-alive timeout (``timeout_keep_alive``, armed only after a first answer) and ``limit_concurrency``
(a 503 without Retry-After, shared by all clients), and nothing else of this: no bound on the time to send a
request's head, none on its size or its header count (its httptools parser takes a head of any size), none on a
body that stops coming, no per-client share of the connections. :class:`Protocol` adds them to uvicorn's own
httptools protocol, as the gateway's server has them (``HttpLimits``; settings in ``ServeSettings``):

- the request line and headers over ``max_header_bytes``, or more than ``max_headers`` headers: 431;
- a head not whole ``header_timeout_s`` after its first byte: 408; a body that stops coming for
  ``idle_timeout_s`` while the app waits for it: 408; a connection with no request for ``idle_timeout_s``
  (a new one too): closed;
- more than ``max_connections`` open connections in this worker: 503 with Retry-After; more than
  ``max_connections_per_client`` from one client address on one listener: 503 with Retry-After, to that client
  only. The local driver's sandboxes come in on a listener of their own (``sandbox_port``, ``tensora.listeners``),
  from 127.0.0.1 as the host's clients do: counted by (address, listener port), they share that listener's share
  and never take the host's.
Bodies: the Guard (``api/limits.py``) answers 413 to a declared JSON body over ``max_body_bytes`` before it is
read; uploads (``PUT /v1/files/...``) stream through uvicorn's flow control (reading pauses while the app has
64 KiB unread) under the owner's storage quota.

Why uvicorn and not the gateway's own server (``gateway/server.py``, which bounds all this already): that server
is the gateway's hot path, compiled and benchmarked against vllm-router, and it holds each request body whole,
answers only plain HTTP/1.1, and runs one process on its own socket. The API needs streamed uploads, the whole
ASGI scope FastAPI and Starlette read (scheme, root_path, lifespan state), and ``tensora up``'s worker processes
under uvicorn's supervisor (one shared listening socket, a worker that dies restarted). Giving the gateway's
server those would add branches to every gateway request for the API's sake; the bounds here are per connection
and per head, on a path where a request costs milliseconds of database work. The cost: this subclass leans on
uvicorn's protocol (its parser callbacks, ``cycle``, ``flow``, the keep-alive timer); the tests of
``tests/e2e/test_api_http_limits.py`` run it against the installed uvicorn.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import resource
import sys
from dataclasses import dataclass
from typing import Any

import httptools
import orjson
import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from tensora import listeners
from tensora.api.errors import error_body

log = logging.getLogger("tensora.api")

_LINGER_S = 1.0  # after a refusal: read and drop what the client still sends, then close (not a reset)
_FD_RESERVE = 256  # descriptors beyond the connections: the database, files being uploaded, the wake socket


@dataclass(frozen=True, slots=True)
class HttpLimits:
    """What one client may hold of an API worker; the defaults are for a server shared by many tenants."""

    max_header_bytes: int = 32 << 10
    max_headers: int = 100
    header_timeout_s: float = 10.0
    idle_timeout_s: float = 30.0
    max_connections: int = 1024
    max_connections_per_client: int = 128
    retry_after_s: int = 1


class Config(uvicorn.Config):
    """uvicorn's Config serving with :class:`Protocol` under ``limits``. Each worker process gets its own copy (it
    is pickled to it), so ``per_host`` counts that worker's connections by (client address, listener port)."""

    def __init__(self, app: Any, *, limits: HttpLimits, **kw: Any) -> None:
        super().__init__(app, http=Protocol, ws="none", timeout_keep_alive=limits.idle_timeout_s,  # type: ignore[arg-type]
                         **kw)
        self.http_limits = limits
        self.per_host: dict[tuple[str, int], int] = {}


class _Refuse(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(status)
        self.status, self.message = status, message


class Protocol(HttpToolsProtocol):
    """uvicorn's httptools protocol, bounded as the module says."""

    def __init__(self, config: Config, server_state: Any, app_state: dict[str, Any],
                 _loop: asyncio.AbstractEventLoop | None = None) -> None:
        super().__init__(config, server_state, app_state, _loop)
        self.limits: HttpLimits = config.http_limits
        self.per_host = config.per_host
        self.host: tuple[str, int] | None = None  # (address, listener port), in ``per_host`` while open
        self.head = 0  # bytes read of the head being read; -1 while a body is read
        self.head_size = 0  # the head's request line and headers, as parsed
        self.timer: asyncio.TimerHandle | None = None  # the head's or the body's deadline
        self.body_at = 0.0  # when the body last came
        self.refused = False  # answered with a refusal: nothing more is read

    # connections
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        lim = self.limits
        # a client is its address on the listener it came in on: sandboxes reach this server from 127.0.0.1 too,
        # on their own listener (``tensora.listeners``)
        host = (self.client[0] if self.client else "", (self.server[1] or 0) if self.server else 0)
        if len(self.connections) > lim.max_connections:
            self.connections.discard(self)
            self._refuse(_Refuse(503, "the server is at its connection limit; retry"), retry=True)
            return
        held = self.per_host.get(host, 0)
        if held >= lim.max_connections_per_client:
            self.connections.discard(self)
            self._refuse(_Refuse(503, "this client is at its connection limit; retry"), retry=True)
            return
        self.per_host[host] = held + 1
        self.host = host
        # a connection that never sends a request is idle from the start (uvicorn arms this after an answer)
        self.timeout_keep_alive_task = self.loop.call_later(lim.idle_timeout_s, self.timeout_keep_alive_handler)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        if self.host is not None:
            left = self.per_host.get(self.host, 1) - 1
            if left > 0:
                self.per_host[self.host] = left
            else:
                self.per_host.pop(self.host, None)
            self.host = None
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self.refused:
            return  # what still comes after a refusal is dropped
        self._unset_keepalive_if_required()
        if self.head >= 0:
            if self.head == 0:  # a head begins: it has header_timeout_s to arrive whole
                self._arm(self.limits.header_timeout_s, self._head_late)
            self.head += len(data)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            return  # the API serves no websockets (``ws="none"``): the request is answered as HTTP/1.1, unlogged
        except httptools.HttpParserError as exc:
            why = exc.__context__  # a callback's refusal, else the parser's own
            if isinstance(why, _Refuse):
                self._refuse(why)
            else:
                self._refuse(_Refuse(400, "malformed HTTP request"))
            return
        # still in a head after all of this: every byte counted since it began was the head's
        if self.head > self.limits.max_header_bytes:
            self._refuse(self._too_large())

    # parser callbacks
    def on_message_begin(self) -> None:
        super().on_message_begin()
        self.head_size = 0

    def on_url(self, url: bytes) -> None:
        super().on_url(url)
        self._grow(len(url))

    def on_header(self, name: bytes, value: bytes) -> None:
        if len(self.headers) >= self.limits.max_headers:
            raise _Refuse(431, f"more than {self.limits.max_headers} headers")
        self._grow(len(name) + len(value) + 4)
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self.head = -1
        self._disarm()
        super().on_headers_complete()
        if not self.parser.should_upgrade():
            self.body_at = self.loop.time()
            self._arm(self.limits.idle_timeout_s, self._body_late)

    def on_body(self, body: bytes) -> None:
        self.body_at = self.loop.time()
        super().on_body(body)

    def on_message_complete(self) -> None:
        self.head = 0
        self._disarm()
        super().on_message_complete()

    # bounds
    def _grow(self, n: int) -> None:
        self.head_size += n
        if self.head_size > self.limits.max_header_bytes:
            raise self._too_large()

    def _too_large(self) -> _Refuse:
        return _Refuse(431, f"the request line and headers are over {self.limits.max_header_bytes} bytes")

    def _arm(self, after_s: float, then: Any) -> None:
        self._disarm()
        self.timer = self.loop.call_later(after_s, then)

    def _disarm(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def _head_late(self) -> None:
        self.timer = None
        if self.head >= 0 and not self.refused:
            self._refuse(_Refuse(408, "the request's headers did not arrive in time"))

    def _body_late(self) -> None:
        """The body's deadline: a 408 when it stopped coming for ``idle_timeout_s`` while it was awaited."""
        self.timer = None
        if self.head >= 0 or self.refused or self.cycle is None or not self.cycle.more_body:
            return
        if self.cycle.response_complete:  # answered without it (a 413, a 401): nobody waits for the rest
            self.transport.close()
            return
        quiet = self.loop.time() - self.body_at
        # reading paused by the server, or a client waiting for its 100 Continue: no stall of the client's
        held = self.flow.read_paused or self.cycle.waiting_for_100_continue
        if held or quiet < self.limits.idle_timeout_s:
            self._arm(self.limits.idle_timeout_s - (0 if held else quiet), self._body_late)
            return
        self._refuse(_Refuse(408, "the request's body stopped coming"))

    def _refuse(self, r: _Refuse, *, retry: bool = False) -> None:
        """Answer ``r`` (unless an answer has begun: then just close), read nothing more, close after a linger."""
        if self.refused:
            return
        self.refused = True
        self._disarm()
        self._unset_keepalive_if_required()
        t = self.transport
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            if cycle.response_started:
                t.close()  # a half-written answer: the client sees the connection end
                return
            cycle.disconnected = True  # the app's request ends: its receive says so, its send writes nothing
            cycle.message_event.set()
        body = orjson.dumps(error_body(_TYPES.get(r.status, "invalid_request"), r.message))
        head = [b"HTTP/1.1 %d %s\r\n" % (r.status, _PHRASES[r.status]), b"content-type: application/json\r\n",
                b"content-length: %d\r\n" % len(body), b"connection: close\r\n"]
        if retry:
            head.append(b"retry-after: %d\r\n" % self.limits.retry_after_s)
        t.write(b"".join(head) + b"\r\n" + body)
        if self.flow is not None:
            self.flow.resume_reading()  # drop what comes, rather than leave it unread (a reset)
        if t.can_write_eof():
            t.write_eof()
            self.loop.call_later(_LINGER_S, t.close)
        else:
            t.close()


_PHRASES = {400: b"Bad Request", 408: b"Request Timeout", 431: b"Request Header Fields Too Large",
            503: b"Service Unavailable"}
_TYPES = {408: "request_timeout", 431: "request_header_fields_too_large", 503: "service_unavailable"}


def make_room(limits: HttpLimits) -> None:
    """Raise this process's soft limit on open files toward its hard limit, so that ``max_connections`` are
    refused with a 503 by the server rather than by the kernel (a failing ``accept``); says so when it cannot."""
    need = limits.max_connections + _FD_RESERVE
    with contextlib.suppress(ValueError, OSError):
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft != resource.RLIM_INFINITY and soft < need:
            want = need if hard == resource.RLIM_INFINITY else min(need, hard)
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            if want < need:
                log.warning("open files are limited to %d: fewer than max_connections (%d) + %d; lower "
                            "max_connections or raise the limit", want, limits.max_connections, _FD_RESERVE)


def run(app: Any, limits: HttpLimits, *, sandbox_port: int | None = None, **kw: Any) -> None:
    """Serve ``app`` in this process until SIGTERM/SIGINT (uvicorn's graceful stop); exit 3 if it never started.
    ``sandbox_port``: also on 127.0.0.1:<sandbox_port>, the sandboxes' listener (``tensora.listeners``; bound
    first, so that a port that cannot be bound stops the start with a ConfigError naming the setting)."""
    make_room(limits)
    config = Config(app, limits=limits, **kw)
    server = uvicorn.Server(config)
    if sandbox_port is None:
        server.run()
    else:
        sandboxes = listeners.listen(sandbox_port, "sandbox_port", config.backlog)
        server.run(sockets=[config.bind_socket(), sandboxes])
    if not server.started:
        sys.exit(3)
