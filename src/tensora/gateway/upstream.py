"""A small pooled HTTP/1.1 client for the gateway's upstreams, on asyncio protocols and httptools.

Written here rather than taken from httpx or aiohttp: this is the gateway's hot path, and both
cost several times the whole budget the gateway has per request (httpx about 300 us a request
on one core, aiohttp about 150 us) in machinery it does not need: it speaks HTTP/1.1 to
OpenAI-compatible servers (plain on loopback or a private network; TLS, certificate checked, to a
peer gateway's ``https://`` URL), sends one JSON body, and reads a JSON body or an SSE stream.
httptools (the parser under uvicorn) does the parsing, chunked transfer encoding included.

What an upstream sends is bounded: a whole body past ``max_body`` is an error, and a stream
whose reader lags stops being read (at ``_HIGH`` queued bytes) until it catches up.

Errors carry a short ``kind`` that X-Tensora-Attempts shows: connect_refused, connect_timeout,
reset (the connection died), timeout (no first byte / token in time), body_too_large.

A request is never sent twice behind the caller's back: it goes again on a fresh connection only when
the failure is known to come before the upstream read it (the kept-alive connection was closed before
the request was written, or the write failed at once). A reset after that may follow work the model
server did, so it is the backend's failure, for the walk to show and decide on.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import itertools
import math
import select
import socket
import ssl
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol
from urllib.parse import urlsplit

import httptools


class UpstreamError(Exception):
    def __init__(self, kind: str, detail: str = "") -> None:
        super().__init__(f"{kind}: {detail}" if detail else kind)
        self.kind = kind


class Reply(Protocol):
    """What the walk and the relay need of an upstream's answer: ``Response`` here, ``fakeupstream`` in tests."""

    status: int

    def header(self, name: bytes) -> bytes | None: ...

    async def read(self) -> bytes: ...

    def read_now(self) -> bytes | None:
        """The whole body when all of it is in already (no wait, so no timer to set); else None."""

    def ready(self) -> bool:
        """Is the next piece (or the end) in already, so that ``next_chunk`` returns without waiting?"""

    async def next_chunk(self) -> bytes | None: ...

    def release(self) -> None: ...


class Upstream(Protocol):
    """What the walk needs of the client to its upstreams (``Client``): one POST, answered once its head is in
    (or an ``UpstreamError``). ``meanwhile``, when given, is called once the request is written and before its
    answer is awaited: work that the answer waits for anyway is done while the upstream works on the request."""

    async def post(self, base_url: str, path: str, body: bytes, headers: list[tuple[str, str]],
                   head_timeout: float, meanwhile: Callable[[], None] | None = None) -> Reply: ...


_END = object()
_PEEK = int(socket.MSG_PEEK | socket.MSG_DONTWAIT)  # an int once, not the enum's ``|`` per request
_POLL = getattr(select, "poll", None)  # not on Windows: a peek there
_HIGH, _LOW = 256 << 10, 64 << 10  # body bytes queued unread: stop reading the upstream / read again


def peer_url_problem(url: str) -> str | None:
    """Why a peer gateway's URL is unsafe to send a caller's key to, or None: ``https`` anywhere,
    plain ``http`` only to loopback (the key would cross the network in clear text)."""
    u = urlsplit(url)
    if u.scheme not in ("http", "https"):
        return f"the scheme must be http or https, not {u.scheme or 'none'!r}"
    if not u.hostname:
        return "it names no host"
    if u.scheme == "http" and not _loopback(u.hostname):
        return (f"plain http to {u.hostname} would send callers' API keys unencrypted: use https "
                "(plain http is allowed to loopback only)")
    return None


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class Response:
    """One response: its head, then its body chunk by chunk (``chunks``) or whole (``read``)."""

    __slots__ = ("_done", "_queue", "_queued", "_waiter", "conn", "head", "headers", "max_body", "status")

    def __init__(self, conn: _Conn, max_body: int) -> None:
        self.conn = conn
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.head: asyncio.Future[None] = conn.loop.create_future()
        self.max_body = max_body
        self._queue: deque[Any] = deque()
        self._queued = 0  # body bytes in _queue
        self._waiter: asyncio.Future[None] | None = None
        self._done = False

    def _push(self, item: Any) -> None:
        self._queue.append(item)
        if isinstance(item, bytes):
            self._queued += len(item)
            if self._queued > _HIGH:
                self.conn.pause()
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    async def next_chunk(self) -> bytes | None:
        """The next piece of the body as it came off the wire; None at its end."""
        while not self._queue:
            self._waiter = self.conn.loop.create_future()
            await self._waiter
            self._waiter = None
        item = self._queue.popleft()
        if item is _END:
            self._done = True
            return None
        if isinstance(item, BaseException):
            raise item
        self._queued -= len(item)
        if self._queued < _LOW:
            self.conn.resume()
        return item  # type: ignore[no-any-return]

    async def read(self) -> bytes:
        """The whole body; ``body_too_large`` past ``max_body`` bytes (the connection is dropped)."""
        parts = []
        size = 0
        while (chunk := await self.next_chunk()) is not None:
            size += len(chunk)
            if size > self.max_body:
                self.conn.close()
                raise UpstreamError("body_too_large", f"over {self.max_body} bytes")
            parts.append(chunk)
        return b"".join(parts)

    def ready(self) -> bool:
        return bool(self._queue)

    def read_now(self) -> bytes | None:
        q = self._queue
        if not q or q[-1] is not _END or self._queued > self.max_body:
            return None  # not all in (or over the bound: ``read`` says so)
        if len(q) == 2:  # most answers: one piece, then the end
            if type(q[0]) is not bytes:
                return None  # an error: ``read`` raises it
        elif any(not isinstance(item, bytes) for item in itertools.islice(q, len(q) - 1)):
            return None
        self._queue = deque()
        self._queued, self._done = 0, True
        self.conn.resume()  # a large body paused reading (``_HIGH``): the connection goes back to its pool readable
        return q[0] if len(q) == 2 else b"".join(itertools.islice(q, len(q) - 1))

    def header(self, name: bytes) -> bytes | None:
        for k, v in self.headers:
            if k.lower() == name:
                return v
        return None

    def release(self) -> None:
        """Done with it: the connection goes back to its pool if the response was read whole."""
        self.conn.finish(self._done)


def nodelay(transport: asyncio.BaseTransport) -> None:
    """Small writes go out at once (no Nagle): a request or an SSE event must not wait for an ACK."""
    sock = transport.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class Reads:
    """How many reads the event loop has handed on (a client's request, an upstream's answer), all told: a count that
    moves only in the loop's I/O phase, which handles every event that came before it. See ``_Conn.unused``.
    One per gateway (``proxy.Gateway.reads``), counted by its server and by its upstream connections."""

    __slots__ = ("n",)

    def __init__(self) -> None:
        self.n = 0


class _Conn(asyncio.Protocol):
    def __init__(self, pool: Pool, loop: asyncio.AbstractEventLoop, sock: socket.socket | None = None) -> None:
        self.pool = pool
        self.loop = loop
        self.reads = pool.reads  # the loop's reads, as its client counts them (``unused``)
        self.sock = sock  # ours, for the liveness check before a kept-alive connection is used again
        self.poll: Any = None  # on the socket, made once: ``unused`` asks it rather than peeks
        if sock is not None and _POLL is not None:
            self.poll = _POLL()
            self.poll.register(sock, select.POLLIN)  # data or EOF; an error or a hangup is always reported
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.resp: Response | None = None
        self.closed = False
        self.reused = False
        self.complete = False
        self.keep_alive = False
        self.paused = False
        self.idle_at = -1  # ``reads.n`` when it went back to its pool; -1: ask the socket (``unused``)
        # uvloop (libuv) runs a turn's ready callbacks before its poll, and that poll's I/O all at once; asyncio's own
        # loop queues the I/O after the callbacks already scheduled, so a count that moved says less there
        self.reads_first = type(loop).__module__.startswith("uvloop")

    def pause(self) -> None:
        if not self.paused and self.transport is not None and not self.closed:
            self.paused = True
            self.transport.pause_reading()

    def resume(self) -> None:
        if self.paused and self.transport is not None and not self.closed:
            self.paused = False
            self.transport.resume_reading()

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        nodelay(transport)

    def data_received(self, data: bytes) -> None:
        self.reads.n += 1
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(UpstreamError("bad_response", str(exc)))
            self.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.resp is not None and not self.complete:
            self._fail(UpstreamError("reset", "the upstream closed the connection"))

    # httptools callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        assert self.resp is not None
        self.resp.headers.append((name, value))

    def on_headers_complete(self) -> None:
        r = self.resp
        assert r is not None
        r.status = self.parser.get_status_code()
        self.keep_alive = self.parser.should_keep_alive()  # read here: the parser resets at the message end
        if not r.head.done():
            r.head.set_result(None)

    def on_body(self, body: bytes) -> None:
        if self.resp is not None:
            self.resp._push(body)

    def on_message_complete(self) -> None:
        self.complete = True
        if self.resp is not None:
            self.resp._push(_END)

    def _fail(self, exc: UpstreamError) -> None:
        r = self.resp
        if r is None:
            return
        if not r.head.done():
            r.head.set_exception(exc)
            r.head.exception()  # retrieved: nobody may be awaiting it any more
        else:
            r._push(exc)

    def send(self, data: bytes, max_body: int) -> Response:
        self.resp = Response(self, max_body)
        self.complete = False
        assert self.transport is not None
        self.transport.write(data)
        return self.resp

    def unused(self) -> bool:
        """Is this idle connection still open, with nothing unasked-for waiting on it? A close the upstream sent
        while it idled may not have reached ``connection_lost`` yet, and a request written to it would fail in a
        way that cannot be told from a failure after its work.

        On uvloop, when the loop has handed on a read since this connection went idle (``reads`` moved),
        its I/O phase has run since, and that phase handles every ready event: a close, or an answer nobody
        asked for (on which the connection closes itself), that came before it is known here already (closed, or
        closing). Only what came in the microseconds since is not, as with the syscall below, which only asks a
        little later. So the socket is asked only when nothing was read since (a connection taken again in the
        same turn of the loop, under load), on another loop, or while its reading is paused: one non-blocking
        ``poll`` (a third of a peek's cost: no exception when it is quiet), or a peek where there is no
        ``poll``. A syscall less on the way of a request that finds its connection idle since a turn before."""
        if self.closed or self.sock is None or self.transport is None or self.transport.is_closing():
            return False
        if self.idle_at >= 0 and self.idle_at != self.reads.n and not self.paused:
            return True
        if self.poll is not None:
            return not self.poll.poll(0)  # no event: open, and quiet; else closed (EOF), reset, or unasked bytes
        try:
            self.sock.recv(1, _PEEK)
        except BlockingIOError:
            return True  # open, and quiet
        except OSError:
            pass
        return False  # closed (b""), reset, or bytes nobody asked for

    def finish(self, whole: bool) -> None:
        keep = whole and self.complete and not self.closed and self.keep_alive
        self.resp = None
        if keep:  # its parser, at a message's end, is ready for the next one: kept (a new one a request showed)
            self.reused = True
            self.idle_at = self.reads.n if self.reads_first else -1
            self.pool.put(self)
        else:
            self.close()

    def close(self, abort: bool = False) -> None:
        if self.transport is not None and not self.closed:
            self.closed = True
            if abort:  # at shutdown: no TLS goodbye that needs the loop to run on
                self.transport.abort()
            else:
                self.transport.close()


class Pool:
    """Idle keep-alive connections to one host:port."""

    def __init__(self, host: str, port: int, max_idle: int = 256, tls: ssl.SSLContext | None = None,
                 reads: Reads | None = None) -> None:
        self.host, self.port, self.max_idle, self.tls = host, port, max_idle, tls
        self.reads = reads if reads is not None else Reads()  # its client's (``_Conn.unused``)
        self.idle: deque[_Conn] = deque()
        self.addr: tuple[int, Any] | None = None

    def put(self, conn: _Conn) -> None:
        if len(self.idle) < self.max_idle:
            self.idle.append(conn)
        else:
            conn.close()

    def take(self) -> _Conn | None:
        while self.idle:
            conn = self.idle.pop()
            if conn.unused():
                return conn
            conn.close()
        return None

    async def connect(self, timeout: float) -> _Conn:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(timeout):
                if self.addr is None:  # resolved once: a lookup per connection would run in a thread pool
                    infos = await loop.getaddrinfo(self.host, self.port, type=socket.SOCK_STREAM)
                    self.addr = (infos[0][0], infos[0][4])
                family, addr = self.addr
                sock = socket.socket(family, socket.SOCK_STREAM)
                sock.setblocking(False)
                try:
                    await loop.sock_connect(sock, addr)
                except BaseException:
                    sock.close()
                    raise
                tls: dict[str, Any] = {"ssl": self.tls, "server_hostname": self.host} if self.tls else {}
                _, conn = await loop.create_connection(lambda: _Conn(self, loop, sock), sock=sock, **tls)
        except TimeoutError:
            raise UpstreamError("connect_timeout", f"{self.host}:{self.port}") from None
        except ConnectionRefusedError:
            raise UpstreamError("connect_refused", f"{self.host}:{self.port}") from None
        except ssl.SSLError as exc:  # an unverifiable certificate among them: nothing was sent
            raise UpstreamError("tls_error", getattr(exc, "reason", None) or str(exc)) from None
        except OSError as exc:
            raise UpstreamError("connect_error", str(exc)) from None
        return conn

    def close(self) -> None:
        while self.idle:
            self.idle.pop().close(abort=True)


class Lateness:
    """The response heads awaited, each with the loop time it is late at: one loop timer, at the earliest of them,
    rather than one per request (a ``call_later`` and its ``cancel`` were the costliest step left of a request,
    and nearly every one was cancelled). A late head gets ``TimeoutError``; the timer, once it has gone off,
    is set again at the earliest still awaited."""

    def __init__(self) -> None:
        self.due: dict[asyncio.Future[None], float] = {}
        self.loop: asyncio.AbstractEventLoop | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.at = math.inf  # when ``timer`` goes off

    def add(self, loop: asyncio.AbstractEventLoop, head: asyncio.Future[None], timeout: float) -> None:
        if loop is not self.loop:  # a client used on another loop (tests): what the last one awaited is gone
            self.due, self.loop, self.timer, self.at = {}, loop, None, math.inf
        at = loop.time() + timeout
        self.due[head] = at
        if at < self.at:
            self._arm(loop, at)

    def remove(self, head: asyncio.Future[None]) -> None:
        self.due.pop(head, None)

    def _arm(self, loop: asyncio.AbstractEventLoop, at: float) -> None:
        if self.timer is not None:
            self.timer.cancel()
        self.at = at
        self.timer = loop.call_at(at, self._fire, loop)

    def _fire(self, loop: asyncio.AbstractEventLoop) -> None:
        self.timer, self.at = None, math.inf
        now = loop.time()
        for head in [h for h, at in self.due.items() if at <= now]:
            del self.due[head]
            if not head.done():
                head.set_exception(TimeoutError())
        if self.due:
            self._arm(loop, min(self.due.values()))


class Client:
    """POSTs JSON to upstreams, pooling a connection set per host:port."""

    def __init__(self, connect_timeout: float = 2.0, max_body: int = 32 << 20,
                 tls: ssl.SSLContext | None = None, reads: Reads | None = None) -> None:
        self.connect_timeout, self.max_body = connect_timeout, max_body
        self.reads = reads if reads is not None else Reads()  # the loop's reads, shared by its pools' connections
        self.tls = tls  # for https:// upstreams; None: the system's trusted CAs, certificates checked
        self.pools: dict[tuple[str, str, int], Pool] = {}
        self._bases: dict[str, tuple[Pool, str, str]] = {}
        self._heads: dict[tuple[str, str], tuple[Pool, bytes]] = {}  # (base URL, path) -> its pool, its head's start
        self.lateness = Lateness()

    def _pool(self, base_url: str) -> tuple[Pool, str, str]:
        found = self._bases.get(base_url)
        if found is not None:
            return found
        u = urlsplit(base_url)
        https = u.scheme == "https"
        host, port = u.hostname or "127.0.0.1", u.port or (443 if https else 80)
        pool = self.pools.get((u.scheme, host, port))
        if pool is None:
            if https and self.tls is None:
                self.tls = ssl.create_default_context()
            pool = self.pools[(u.scheme, host, port)] = Pool(host, port, tls=self.tls if https else None,
                                                             reads=self.reads)
        found = self._bases[base_url] = (pool, f"{host}:{port}", u.path.rstrip("/"))
        return found

    def _head(self, base_url: str, path: str) -> tuple[Pool, bytes]:
        """The pool for ``base_url``, and what every request to ``path`` there begins with, up to its length:
        made once, not per request."""
        found = self._heads.get((base_url, path))
        if found is None:
            pool, hostport, prefix = self._pool(base_url)
            found = self._heads[(base_url, path)] = (pool, (
                f"POST {prefix}{path} HTTP/1.1\r\nhost: {hostport}\r\ncontent-type: application/json\r\n"
                "content-length: ").encode("latin-1"))
        return found

    async def post(self, base_url: str, path: str, body: bytes, headers: list[tuple[str, str]],
                   head_timeout: float, meanwhile: Callable[[], None] | None = None) -> Response:
        """Send; return once the response head is in (within ``head_timeout``). ``meanwhile``: see ``Upstream``."""
        pool, head = self._head(base_url, path)
        extra = "".join([f"{k}: {v}\r\n" for k, v in headers]).encode("latin-1")
        data = b"%s%d\r\n%s\r\n%s" % (head, len(body), extra, body)
        while True:  # ends: each turn takes an idle connection off the pool, or makes the last, fresh one
            conn = pool.take()  # open and quiet when taken (see ``_Conn.unused``)
            fresh = conn is None
            if conn is None:
                conn = await pool.connect(min(self.connect_timeout, head_timeout))
            resp = conn.send(data, self.max_body)
            if conn.closed or conn.transport is None or conn.transport.is_closing():
                conn.close()  # the write failed at once: nothing reached the upstream
                if fresh:
                    raise UpstreamError("reset", "the upstream closed the connection")
                continue
            self.lateness.add(conn.loop, resp.head, head_timeout)  # not asyncio.timeout, nor a timer each: see Lateness
            try:
                if meanwhile is not None:
                    meanwhile()
                await resp.head
            except TimeoutError:
                conn.close()
                raise UpstreamError("timeout", "no response in time") from None
            except UpstreamError:
                conn.close()  # after the request went out: maybe read and worked on, never sent again here
                raise
            except BaseException:
                conn.close()  # cancelled (the client left), or ``meanwhile`` failed: its answer is never read
                raise
            finally:
                self.lateness.remove(resp.head)
            return resp

    def close(self) -> None:
        for pool in self.pools.values():
            with contextlib.suppress(Exception):
                pool.close()
        self.pools.clear()
        self._bases.clear()
        self._heads.clear()
