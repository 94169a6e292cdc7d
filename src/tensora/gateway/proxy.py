"""The gateway's request path: check the key, admit against the rate limits, walk the chain.

A raw ASGI app (no framework on the hot path: a request costs one JSON parse and one dump of
its body, and one per streamed event). Steps of a request:

1. authenticate (the key's digest against the route table; 401/403 in OpenAI's error shape);
2. read and check the body (``body.parse``: a 400 naming the field); resolve ``model`` to the caller's
   endpoint or a serverless model;
3. admit: one request and its token reservation against the per-minute windows of the key's owner,
   and of the key when it is held lower, in one step (429; 503 when Redis is down and fails closed);
4. plan the chain (``chain.plan``: pure) and walk it within one deadline budget; every attempt
   has a time-to-first-token deadline, and a failure before the first token moves on (a 5xx or a
   reset from the only backend of its tier is tried once more there first, after a short jittered
   delay, when the deadline leaves room); after it, a stream with no event for ``stream_idle_s``
   ends with the error event, as the backend's failure;
5. answer with what really served it (headers, and ``model`` in the body); settle the token
   reservation; meter the usage. Nothing left to try: 503 with Retry-After.
"""

from __future__ import annotations

import asyncio
import contextlib
import email.utils
import itertools
import logging
import math
import random
import re
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import Any

import orjson

from tensora import apikeys
from tensora.gateway import chain, idempotency, sse
from tensora.gateway.body import Invalid, parse
from tensora.gateway.breaker import Breaker, Policy, State
from tensora.gateway.chain import Backend, Peer, ServedBy
from tensora.gateway.limits import Admission, Caller, Limiter, Quota, Refused
from tensora.gateway.metering import Meter
from tensora.gateway.routes import EndpointRoute, KeyRoute, RouteTable
from tensora.gateway.upstream import Client, Response, UpstreamError

log = logging.getLogger("tensora.gateway")

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]

_PATHS = {"/v1/chat/completions": "/chat/completions", "/v1/completions": "/completions"}
_JSON = (b"content-type", b"application/json")
_SSE = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]
_RID = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
HOP = b"x-tensora-hop"


@dataclass
class Options:
    region: str = "local"
    ttft_s: float = 30.0  # per attempt: until the first token (streams) or the response head
    deadline_s: float = 120.0  # per request, all attempts together
    stream_idle_s: float = 30.0  # after the first token: the longest a stream may go without an event
    retry_delay_s: float = 0.1  # before the one retry of a tier's only backend (jittered 0.5x-1.5x)
    retry_room_s: float = 1.0  # the retry goes only when this much of the deadline is left after the delay
    connect_timeout_s: float = 2.0
    retry_after_s: int = 5  # a 503 with no breaker to wait for
    rpm: int = 600  # an owner's limits (all its keys together) when the route table does not list the owner
    tpm: int = 1_000_000
    default_max_tokens: int = 256  # reserved when a request gives no max_tokens
    max_body_bytes: int = 8 << 20
    max_upstream_body_bytes: int = 32 << 20  # a model server's whole answer: 502 beyond
    max_sse_event_bytes: int = 1 << 20  # one event of its stream: the stream ends with an error event beyond
    breaker: Policy = field(default_factory=Policy)
    rate_limit_backoff_s: float = 1.0  # a backend's 429 without Retry-After: skip it this long (x0.5-1.5)
    peers: tuple[Peer, ...] = ()


@dataclass(slots=True)
class Call:
    """One request on its way: what every step of the walk and the relay needs of it, made once in ``_infer``
    rather than handed down through each signature. ``attempts`` grows as the walk goes (X-Tensora-Attempts);
    ``deadline`` is set when the walk starts."""

    send: Send
    rid: str
    path: str  # upstream: /chat/completions or /completions
    key: KeyRoute
    table: RouteTable  # the route table as the request found it
    endpoint: EndpointRoute
    body: dict[str, Any]  # as it came; passed upstream with ``model`` replaced
    stream: bool
    client_usage: bool  # a stream whose client asked for the usage chunk
    reserve: int  # tokens reserved at admission
    auth: bytes  # the caller's Authorization, for a peer gateway only
    hopped: bool  # came from a peer gateway: no peers again
    limit_headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    deadline: float = 0.0
    attempts: list[str] = field(default_factory=list)


class Failed(Exception):
    """An attempt that did not work out; the chain moves on. ``retry_s``: the backend's 429 said when to
    come back; ``reply``: the answer to pass through should nothing be left to try (a context error)."""

    def __init__(self, kind: str, *, breaker: bool = True, retry_s: float | None = None,
                 reply: tuple[list[tuple[bytes, bytes]], bytes, Served] | None = None) -> None:
        super().__init__(kind)
        self.kind, self.breaker, self.retry_s, self.reply = kind, breaker, retry_s, reply


def error_body(message: str, type_: str, code: str | None = None, param: str | None = None) -> bytes:
    return orjson.dumps({"error": {"message": message, "type": type_, "param": param, "code": code}})


@dataclass(slots=True)
class Served:
    backend: Backend
    served_by: str
    region: str
    prompt_tokens: int = 0
    completion_tokens: int = 0
    status: int = 200
    broken: str | None = None  # failed after the head went out (a stream cut short): the backend's failure


class Gateway:
    def __init__(self, options: Options, table: Callable[[], RouteTable], limiter: Limiter, meter: Meter | None,
                 *, clock: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time) -> None:
        self.o = options
        self.table = table
        self.limiter = limiter
        self.meter = meter
        self.clock, self.wall = clock, wall
        self.client = Client(options.connect_timeout_s, options.max_upstream_body_bytes)
        self.breakers: dict[str, Breaker] = {}
        self.ejected: dict[str, Backend] = {}  # whose breakers opened: what ``probe.Prober`` probes
        self._turn = 0
        self._tiers_cache: dict[tuple[str, bool], list[list[Backend]]] = {}
        self._tiers_version: str | None = None
        self._callers: dict[str, Caller] = {}  # by key id, for the route table's version below
        self._callers_version: str | None = None
        self._keys: dict[bytes, str] = {}  # secret -> digest, for keys seen before (bounded)
        self.idem: idempotency.Idempotency | None = None  # Idempotency-Key honoured when set
        self.on_startup: list[Callable[[], Awaitable[None]]] = []
        self.on_shutdown: list[Callable[[], Awaitable[None]]] = []

    # -- ASGI -----------------------------------------------------------------------------

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        rid = _request_id(scope)
        path, method = scope["path"], scope["method"]
        try:
            if path in _PATHS:
                if method != "POST":
                    await self._error(send, rid, 405, "use POST", "invalid_request_error")
                    return
                await self._infer(scope, receive, send, rid, _PATHS[path])
            elif path == "/v1/models" and method == "GET":
                await self._models(scope, send, rid)
            elif path in ("/healthz", "/readyz"):
                await self._send(send, 200, orjson.dumps({"status": "ok", "routes": self.table().version}), rid)
            else:
                await self._error(send, rid, 404, f"no route {method} {path}", "invalid_request_error",
                                  "not_found")
        except Exception:  # a bug: answer as OpenAI would rather than drop the connection
            log.exception("gateway request %s failed", rid)
            with contextlib.suppress(Exception):
                await self._error(send, rid, 500, "internal gateway error", "server_error")

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            msg = await receive()
            if msg["type"] == "lifespan.startup":
                for fn in self.on_startup:
                    await fn()
                await send({"type": "lifespan.startup.complete"})
            elif msg["type"] == "lifespan.shutdown":
                for fn in self.on_shutdown:
                    with contextlib.suppress(Exception):
                        await fn()
                self.client.close()
                with contextlib.suppress(Exception):
                    await self.limiter.close()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _send(self, send: Send, status: int, body: bytes, rid: str,
                    headers: list[tuple[bytes, bytes]] | None = None) -> None:
        h = [_JSON, (b"content-length", str(len(body)).encode()), (b"x-request-id", rid.encode()),
             (b"x-tensora-region", self.o.region.encode())]
        await send({"type": "http.response.start", "status": status, "headers": h + (headers or [])})
        await send({"type": "http.response.body", "body": body})

    async def _error(self, send: Send, rid: str, status: int, message: str, type_: str, code: str | None = None,
                     param: str | None = None, headers: list[tuple[bytes, bytes]] | None = None) -> None:
        await self._send(send, status, error_body(message, type_, code, param), rid, headers)

    # -- step 1: who is calling -------------------------------------------------------------

    def _key(self, scope: Scope, table: RouteTable) -> KeyRoute | tuple[int, str, str]:
        auth = _header(scope, b"authorization")
        if auth is None or auth[:7].lower() != b"bearer ":
            return 401, "missing API key: send Authorization: Bearer <key>", "invalid_api_key"
        raw = auth[7:].strip()
        digest = self._keys.get(raw)
        if digest is None:  # checksum and digest once per key, not per request
            secret = raw.decode("latin-1")
            if not apikeys.well_formed(secret):
                return 401, "Incorrect API key provided", "invalid_api_key"
            digest = apikeys.digest(secret)
            if len(self._keys) >= 10_000:
                self._keys.clear()
            self._keys[raw] = digest
        key = table.keys.get(digest)  # a digest of a random secret: its lookup leaks nothing
        if key is None:
            return 401, "Incorrect API key provided", "invalid_api_key"
        if not apikeys.allows(key.scopes, "inference"):
            return 403, "this key lacks the 'inference' scope", "insufficient_scope"
        return key

    async def _caller(self, scope: Scope, send: Send, rid: str, table: RouteTable) -> KeyRoute | None:
        """The calling key, or None once the 401/403 is sent."""
        key = self._key(scope, table)
        if isinstance(key, KeyRoute):
            return key
        status, message, code = key
        await self._error(send, rid, status, message, "invalid_request_error", code)
        return None

    async def _models(self, scope: Scope, send: Send, rid: str) -> None:
        table = self.table()
        key = await self._caller(scope, send, rid, table)
        if key is None:
            return
        data = [{"id": e.name, "object": "model", "created": 0,
                 "owned_by": "tensora-serverless" if e.serverless else e.owner} for e in table.visible(key.owner)]
        await self._send(send, 200, orjson.dumps({"object": "list", "data": data}), rid)

    # -- steps 2-5 ----------------------------------------------------------------------------

    async def _infer(self, scope: Scope, receive: Receive, send: Send, rid: str, path: str) -> None:
        table = self.table()
        key = await self._caller(scope, send, rid, table)
        if key is None:
            return
        raw = await _read_body(receive, self.o.max_body_bytes)
        if raw is None:
            await self._error(send, rid, 413, f"the body is over {self.o.max_body_bytes} bytes",
                              "invalid_request_error")
            return
        try:
            parsed: Any = orjson.loads(raw)
        except orjson.JSONDecodeError:
            parsed = None
        ask = parse(parsed, self.o.default_max_tokens)
        if isinstance(ask, Invalid):
            await self._error(send, rid, 400, ask.message, "invalid_request_error", ask.code, ask.param)
            return
        endpoint = table.resolve(key.owner, ask.model)
        if endpoint is None:
            await self._error(send, rid, 404, f"The model '{ask.model}' does not exist or you do not have access "
                              "to it.", "invalid_request_error", "model_not_found", "model")
            return
        call = Call(send, rid, path, key, table, endpoint, ask.obj, ask.stream, ask.include_usage, ask.reserve,
                    _header(scope, b"authorization") or b"", _header(scope, HOP) is not None)
        idem = self.idem
        ik = _header(scope, idempotency.HEADER) if idem is not None else None
        if idem is None or ik is None:
            await self._serve(call)
        else:  # replayed, refused, or served once and kept
            head = [(b"x-request-id", rid.encode()), (b"x-tensora-region", self.o.region.encode())]
            await idem.run(send, head, key.id, path, ik, ask.obj, lambda s: self._serve(replace(call, send=s)),
                           lambda: self._count(send, rid, key, table))

    async def _count(self, send: Send, rid: str, key: KeyRoute, table: RouteTable) -> bool:
        """A replay (or a 409/422 of Idempotency-Key) is a request against the caller's limits, with no tokens:
        else replays would be free to flood. False once the 429 is sent."""
        adm = await self.limiter.admit(self._caller_limits(key, table), 0, self.wall())
        if not adm.ok:
            await self._refuse(send, rid, adm)
        return adm.ok

    async def _serve(self, call: Call) -> Served | None:
        # step 3: admission, tokens reserved in the owner's windows (and the key's, when held lower)
        send, rid, key, endpoint = call.send, call.rid, call.key, call.endpoint
        caller = self._caller_limits(key, call.table)
        reserve = call.reserve
        tpm = caller.key_quota.tpm if caller.key_quota is not None else caller.quota.tpm
        if reserve > tpm:
            await self._error(send, rid, 429, f"this request reserves {reserve} tokens (prompt + max_tokens x n), "
                              f"more than the {tpm} per minute {_whose(caller, tpm)}: lower max_tokens", "tokens",
                              "rate_limit_exceeded", "max_tokens")
            return None
        adm = await self.limiter.admit(caller, reserve, self.wall())
        if not adm.ok:
            await self._refuse(send, rid, adm)
            return None
        call.limit_headers = adm.headers()

        # step 4: the chain
        served: Served | None = None
        try:
            served = await self._walk(call)
        finally:
            used = served.prompt_tokens + served.completion_tokens if served is not None else 0
            await self.limiter.settle(adm, used)
        if served is not None and self.meter is not None:
            b = served.backend
            product = ("cross-region" if b.peer else "serverless" if served.served_by == ServedBy.SERVERLESS
                       else "fallback-model" if served.served_by == ServedBy.FALLBACK_MODEL else "endpoint")
            self.meter.record({  # the id is ours and unguessable; the client's X-Request-Id is only stored beside
                "id": secrets.token_hex(16), "client_request_id": rid, "at": self.wall(), "owner": key.owner,
                "key_id": key.id, "endpoint": endpoint.name,
                "endpoint_id": endpoint.id, "product": product, "answered_by": b.endpoint_id, "model": b.model,
                "served_by": served.served_by, "region": served.region, "prompt_tokens": served.prompt_tokens,
                "completion_tokens": served.completion_tokens, "status": served.status})
        return served

    def _caller_limits(self, key: KeyRoute, table: RouteTable) -> Caller:
        """The windows ``key``'s requests count against, kept until the route table changes: its owner's
        (from the table, else this gateway's defaults), and its own when it is held lower than those."""
        if table.version != self._callers_version:
            self._callers.clear()
            self._callers_version = table.version
        found = self._callers.get(key.id)
        if found is None:
            o = table.owners.get(key.owner)
            owner = Quota(o.rpm, o.tpm) if o is not None else Quota(self.o.rpm, self.o.tpm)
            own = Quota(min(key.rpm or owner.rpm, owner.rpm), min(key.tpm or owner.tpm, owner.tpm))
            found = self._callers[key.id] = Caller(key.owner, owner, key.id, None if own == owner else own)
        return found

    async def _refuse(self, send: Send, rid: str, adm: Admission) -> None:
        """A 429 naming the window that refused, or a 503 when the limits cannot be checked (fail closed)."""
        if adm.reason is Refused.UNAVAILABLE:
            retry = str(self.o.retry_after_s).encode()
            await self._error(send, rid, 503, "rate limits cannot be checked now (their store is unreachable); "
                              f"retry after {self.o.retry_after_s} s", "server_error", "rate_limiter_unavailable",
                              headers=[(b"retry-after", retry)])
            return
        q = dict(adm.caller.windows).get(adm.scope, adm.quota) if adm.caller is not None else adm.quota
        limit = q.rpm if adm.reason is Refused.REQUESTS else q.tpm
        whose = "this key's own limit" if adm.scope == "key" else "shared by all of this owner's keys"
        await self._error(send, rid, 429, f"Rate limit reached for {adm.reason} per minute: limit {limit}, {whose};"
                          f" retry after {adm.retry_after} s", str(adm.reason), "rate_limit_exceeded",
                          headers=[(b"retry-after", str(adm.retry_after).encode()), *adm.headers()])

    def _tiers(self, endpoint: EndpointRoute, table: RouteTable, hopped: bool) -> list[list[Backend]]:
        """``chain.tiers`` for this endpoint, kept until the route table changes."""
        if table.version != self._tiers_version:
            self._tiers_cache.clear()
            self._tiers_version = table.version
        key = (endpoint.id, hopped)
        found = self._tiers_cache.get(key)
        if found is None:
            found = self._tiers_cache[key] = chain.tiers(endpoint, table, self.o.peers, hopped=hopped)
        return found

    def _breaker(self, key: str) -> Breaker:
        b = self.breakers.get(key)
        if b is None:
            b = self.breakers[key] = Breaker(self.o.breaker)
        return b

    def _open_until(self, now: float) -> Callable[[str], float | None]:
        def open_until(key: str) -> float | None:
            b = self.breakers.get(key)
            return b.retry_at(now) if b is not None else None
        return open_until

    def _limited_until(self, now: float) -> Callable[[str], float | None]:
        def limited_until(key: str) -> float | None:
            b = self.breakers.get(key)
            return b.limited_until(now) if b is not None else None
        return limited_until

    def _failed(self, b: Backend, breaker: Breaker, f: Failed, hints: list[float]) -> None:
        """Tell the backend's breaker how the attempt went. A 429 makes it skipped until its Retry-After
        (bounded by the breaker's ``max_s``), or for a short jittered backoff when it gave none; a peer's
        429 is about this caller's own limits there, so it is only remembered for this answer."""
        now = self.clock()
        if f.breaker:
            breaker.failure(now)
            if breaker.open_until is not None:
                self.ejected[b.key] = b
        elif f.kind == "http_429":
            wait = f.retry_s if f.retry_s is not None else self.o.rate_limit_backoff_s * (0.5 + random.random())
            until = now + min(wait, self.o.breaker.max_s)
            hints.append(until)
            if b.peer:
                breaker.release()
            else:
                breaker.rate_limited(until)
        else:
            breaker.release()

    async def _walk(self, call: Call) -> Served | None:
        start = self.clock()
        deadline = call.deadline = start + self.o.deadline_s
        self._turn += 1
        tiers = self._tiers(call.endpoint, call.table, call.hopped)
        plan = chain.order(tiers, self._open_until(start), self._turn, self._limited_until(start))
        attempts = call.attempts
        attempts += [f"{b.key}:breaker_open" for b in plan.skipped]  # skipped at once, nothing sent
        attempts += [f"{b.key}:rate_limited" for b in plan.limited]
        todo, i = list(plan.attempts), 0
        hints: list[float] = []  # when the 429s of this request said to come back
        while i < len(todo):
            b = todo[i]
            i += 1
            now = self.clock()
            if now >= deadline:
                attempts.append(f"{b.key}:deadline")
                break
            breaker = self._breaker(b.key)
            if not breaker.allow(now):  # opened or rate limited meanwhile, or half-open with its one probe out
                attempts.append(f"{b.key}:{'rate_limited' if breaker.limited_until(now) else 'breaker_open'}")
                continue
            ttft = min(b.ttft_s or self.o.ttft_s, deadline - now)
            try:
                served = await self._attempt(call, b, ttft, alone=_alone(tiers, b))
            except Failed as f:
                attempts.append(f"{b.key}:{f.kind}")
                self._failed(b, breaker, f, hints)
                if f.reply is not None:  # too long for this model: only the fallback models are left
                    todo, i = chain.longer_context(todo[i:], b), 0
                    if not todo:  # none: the model server's own 400, as it said it
                        return await self._pass(call, *f.reply)
                continue
            if served.broken:  # a stream that stalled or dropped after its first token
                breaker.failure(self.clock())
                if breaker.open_until is not None:
                    self.ejected[b.key] = b
            else:
                breaker.success(self.clock())
            return served
        now = self.clock()
        soonest = [t for t in (self.breakers[b.key].retry_at(now) or self.breakers[b.key].limited_until(now)
                               for b in (*plan.attempts, *plan.skipped, *plan.limited) if b.key in self.breakers)
                   if t is not None] + [t for t in hints if t > now]
        wait = min(soonest) - now if soonest else float(self.o.retry_after_s)
        retry = max(1, math.ceil(wait))
        what = "no replica of it is ready" if not attempts else "every backend failed or is cooling down"
        await self._error(call.send, call.rid, 503, f"{call.endpoint.name} cannot serve now: {what}; retry after "
                          f"{retry} s",
                          "server_error", "service_unavailable", headers=[
                              (b"retry-after", str(retry).encode()), (b"retry-after-ms", b"%d" % max(1, wait * 1000)),
                              (b"x-tensora-fallback", b"false"), (b"x-tensora-attempts", ",".join(attempts).encode()),
                              *call.limit_headers])
        return None

    async def _pass(self, call: Call, headers: list[tuple[bytes, bytes]], data: bytes, served: Served) -> Served:
        """Pass a backend's client error through unchanged (its status and body), with the whole trail."""
        trail = (b"x-tensora-attempts", ",".join(call.attempts).encode())
        await call.send({"type": "http.response.start", "status": served.status, "headers": [
            _JSON, (b"content-length", str(len(data)).encode()), (b"x-request-id", call.rid.encode()),
            (b"x-tensora-region", served.region.encode()),
            *(trail if k == b"x-tensora-attempts" else (k, v) for k, v in headers)]})
        await call.send({"type": "http.response.body", "body": data})
        return served

    async def _attempt(self, call: Call, b: Backend, ttft: float, *, alone: bool = False) -> Served:
        """One backend; when it is its tier's only one, a 5xx or a reset gets one more try of it after a
        short jittered delay (a restart or a dropped connection often clears in that time), both in
        X-Tensora-Attempts. Not a 4xx, not a timeout, not when the deadline leaves no room."""
        try:
            return await self._once(call, b, ttft)
        except Failed as f:
            if not (alone and (f.kind == "reset" or f.kind.startswith("http_5"))):
                raise
            delay = self.o.retry_delay_s * random.uniform(0.5, 1.5)
            now = self.clock()
            if call.deadline - now - delay < self.o.retry_room_s:
                raise
            breaker = self._breaker(b.key)
            breaker.failure(now)  # the first try counts; the retry's outcome is the walk's to record
            if breaker.open_until is not None:
                self.ejected[b.key] = b  # probed until it answers again
            if not breaker.allow(now):  # that failure opened it (or ended its probe): no retry
                raise Failed(f.kind, breaker=False) from None
            call.attempts.append(f"{b.key}:{f.kind}")
        await asyncio.sleep(delay)
        return await self._once(call, b, min(ttft, call.deadline - self.clock()))

    async def _once(self, call: Call, b: Backend, ttft: float) -> Served:
        body = call.body
        up = dict(body)
        up["model"] = b.upstream_model
        headers = [("x-request-id", call.rid)]
        if b.peer:  # a peer gateway checks the caller's own key
            headers += [("authorization", call.auth.decode("latin-1")), (HOP.decode(), self.o.region)]
        elif b.api_key:  # a replica gets its own key, never the caller's
            headers.append(("authorization", f"Bearer {b.api_key}"))
        if call.stream:
            opts = body.get("stream_options")
            up["stream_options"] = {**(opts if isinstance(opts, dict) else {}), "include_usage": True}
        first_by = self.clock() + ttft
        try:
            resp = await self.client.post(b.base_url, call.path, orjson.dumps(up), headers, ttft)
        except UpstreamError as exc:
            raise Failed(exc.kind) from None
        try:
            if resp.status != 200:
                return await self._not_ok(call, b, resp)
            if call.stream:
                return await self._stream(call, b, resp, first_by, b.stream_idle_s or self.o.stream_idle_s)
            return await self._whole(call, b, resp)
        finally:
            resp.release()

    def _headers(self, call: Call, b: Backend, resp: Response, ok: str) -> tuple[list[tuple[bytes, bytes]], str, str]:
        served_by, region = b.served_by.value, b.region
        if b.peer:  # the peer says what served it there
            served_by = (resp.header(b"x-tensora-served-by") or b"replica").decode("latin-1")
            region = (resp.header(b"x-tensora-region") or b.region.encode()).decode("latin-1")
        fallback = b.peer or b.served_by is not ServedBy.REPLICA
        trail = ",".join([*call.attempts, f"{b.key}:{ok}"])
        return [(b"x-tensora-served-by", served_by.encode()),
                (b"x-tensora-fallback", b"true" if fallback else b"false"),
                (b"x-tensora-attempts", trail.encode()), *call.limit_headers], served_by, region

    async def _not_ok(self, call: Call, b: Backend, resp: Response) -> Served:
        status = resp.status
        # what is passed on should its body not come (slow, dropped, or past max_upstream_body_bytes)
        data = error_body(f"the model server answered {status} with a body that could not be read",
                          "invalid_request_error" if status < 500 else "server_error", f"upstream_{status}")
        with contextlib.suppress(Exception):
            async with asyncio.timeout(max(0.0, min(call.deadline - self.clock(), 2.0))):
                data = await resp.read()
        if status >= 500:
            raise Failed(f"http_{status}")
        if status == 429:  # busy, not broken: move on, without counting against its breaker
            raise Failed("http_429", breaker=False, retry_s=retry_after(resp.header))
        # a client error (400, 422...): the same request fails everywhere; pass it through as is, unless
        # it is too long for this model, and a fallback model may take it
        headers, served_by, region = self._headers(call, b, resp, f"http_{status}")
        served = Served(b, served_by, region, status=status)
        if status == 400 and context_exceeded(data):
            raise Failed("context_length_exceeded", breaker=False, reply=(headers, data, served))
        call.attempts.append(f"{b.key}:http_{status}")
        return await self._pass(call, headers, data, served)

    async def _whole(self, call: Call, b: Backend, resp: Response) -> Served:
        try:
            async with asyncio.timeout(max(0.0, call.deadline - self.clock())):
                data = await resp.read()
        except TimeoutError:
            raise Failed("timeout") from None
        except UpstreamError as exc:
            if exc.kind == "body_too_large":  # as large from any replica of the model: no other tier
                await self._error(call.send, call.rid, 502, "the model server's answer is over "
                                  f"{self.o.max_upstream_body_bytes} bytes", "server_error", "upstream_too_large",
                                  headers=self._headers(call, b, resp, exc.kind)[0])
                return Served(b, b.served_by.value, b.region, status=502)
            raise Failed(exc.kind) from None
        try:
            obj = orjson.loads(data)
        except orjson.JSONDecodeError:
            raise Failed("bad_response") from None
        if not isinstance(obj, dict):
            raise Failed("bad_response")
        obj["model"] = b.model
        usage = obj.get("usage")
        if not isinstance(usage, dict):
            usage = {}
        headers, served_by, region = self._headers(call, b, resp, "ok")
        out = orjson.dumps(obj)
        send = call.send
        await send({"type": "http.response.start", "status": 200, "headers": [
            _JSON, (b"content-length", str(len(out)).encode()), (b"x-request-id", call.rid.encode()),
            (b"x-tensora-region", region.encode()), *headers]})
        await send({"type": "http.response.body", "body": out})
        return Served(b, served_by, region, _int(usage.get("prompt_tokens")), _int(usage.get("completion_tokens")))

    async def _stream(self, call: Call, b: Backend, resp: Response, first_by: float, idle_s: float) -> Served:
        """Hold the status until the first content event: a failure before it moves on (a real
        503 or 429 later, never a 200 with an empty stream); a failure after it ends the stream
        with an error event, never splicing another model's output in. After it, an event must come
        every ``idle_s`` (comments do not count): a stalled model server is not held to the deadline."""
        send, client_usage, deadline = call.send, call.client_usage, call.deadline
        events = sse.Events(self.o.max_sse_event_bytes)
        held: list[bytes] = []
        sending = False  # the head is out: from here a failure ends the stream with an error event
        served = Served(b, b.served_by.value, b.region)
        content = counted = 0
        done = False
        idle_by = deadline
        while not done:
            try:
                async with asyncio.timeout(max(0.0, (idle_by if sending else first_by) - self.clock())):
                    chunk = await resp.next_chunk()
                payloads = events.feed(chunk) if chunk is not None else events.tail()
            except (TimeoutError, UpstreamError) as exc:
                kind = exc.kind if isinstance(exc, UpstreamError) else "timeout"
                if not sending:
                    raise Failed(kind) from None
                if kind == "timeout" and idle_by < deadline:
                    kind = "stream_idle"
                log.warning("stream %s from %s ended early: %s", call.rid, b.key, kind)
                await send({"type": "http.response.body", "body": sse.event(error_body(
                    f"the model server failed mid-stream ({kind}); the answer is incomplete", "server_error",
                    "upstream_failed")) + sse.event(sse.DONE), "more_body": False})
                served.status, served.broken = 502, kind
                served.completion_tokens = served.completion_tokens or counted
                return served
            if chunk is None:
                done = True
            out: list[bytes] = []
            if payloads:
                idle_by = min(deadline, self.clock() + idle_s)
            for p in payloads:
                if p == sse.DONE:
                    done = True
                    break
                try:
                    obj = orjson.loads(p)
                except orjson.JSONDecodeError:
                    continue
                if not isinstance(obj, dict):
                    continue
                if "error" in obj and not sending:
                    raise Failed("stream_error")
                usage, choices = obj.get("usage"), obj.get("choices")
                if isinstance(usage, dict):  # what the gateway asked for (alone, or on the last chunk)
                    served.prompt_tokens = _int(usage.get("prompt_tokens"))
                    served.completion_tokens = _int(usage.get("completion_tokens"))
                if not client_usage and "usage" in obj:  # the client did not ask: it never sees it
                    if not choices:
                        continue
                    del obj["usage"]
                if "model" in obj:
                    obj["model"] = b.model
                has = _has_content(choices)
                content |= has
                counted += has
                out.append(sse.event(orjson.dumps(obj)))
            if done:
                out.append(sse.event(sse.DONE))  # always, even when the runtime leaves it out
            if not sending:
                held += out
                if not (content or done):
                    continue
                headers, served.served_by, served.region = self._headers(call, b, resp, "ok")
                await send({"type": "http.response.start", "status": 200, "headers": [
                    *_SSE, (b"x-request-id", call.rid.encode()), (b"x-tensora-region", served.region.encode()),
                    *headers]})
                sending, out, held = True, held, []
            if out or done:
                await send({"type": "http.response.body", "body": b"".join(out), "more_body": not done})
        served.completion_tokens = served.completion_tokens or counted
        return served


_CONTEXT = re.compile(rb"maximum context length|maximum model length|context_length_exceeded", re.I)


def context_exceeded(data: bytes) -> bool:
    """Does a backend's 400 say the request is longer than the model's context? OpenAI says it with
    ``code: context_length_exceeded``; vLLM only in its message ("This model's maximum context length
    is 4096 tokens...", or V1's "...is longer than the maximum model length of 4096")."""
    if _CONTEXT.search(data) is None:  # cheap first: most 400s are something else
        return False
    try:
        err = orjson.loads(data)
    except orjson.JSONDecodeError:
        return False
    if isinstance(err, dict) and isinstance(err.get("error"), dict):
        err = err["error"]  # OpenAI's shape, and vLLM's since 0.8; before, vLLM's fields were at the top
    if not isinstance(err, dict):
        return False
    if err.get("code") == "context_length_exceeded":
        return True
    message = err.get("message")
    return isinstance(message, str) and _CONTEXT.search(message.encode()) is not None


def retry_after(header: Callable[[bytes], bytes | None]) -> float | None:
    """Seconds a backend's 429 asks to wait: ``retry-after-ms`` (OpenAI's, finer), else ``Retry-After`` in
    seconds or as an HTTP date; None when it says nothing usable."""
    ms = header(b"retry-after-ms")
    if ms is not None:
        with contextlib.suppress(ValueError):
            v = float(ms) / 1000
            if math.isfinite(v) and v >= 0:
                return v
    raw = header(b"retry-after")
    if raw is None:
        return None
    text = raw.decode("latin-1").strip()
    with contextlib.suppress(ValueError):
        v = float(text)
        return v if math.isfinite(v) and v >= 0 else None
    with contextlib.suppress(TypeError, ValueError, IndexError):
        when = email.utils.parsedate_to_datetime(text)
        return max(0.0, when.timestamp() - time.time())
    return None


def _alone(tiers: list[list[Backend]], b: Backend) -> bool:
    """Is ``b`` the only backend of its tier? A peer gateway never is: it makes its own retries."""
    return not b.peer and any(len(t) == 1 and t[0].key == b.key for t in tiers)


def _has_content(choices: Any) -> int:
    if not isinstance(choices, list):
        return 0
    for c in choices:
        if not isinstance(c, dict):
            continue
        if c.get("finish_reason") or c.get("text"):
            return 1
        delta = c.get("delta")
        if isinstance(delta, dict) and (delta.get("content") or delta.get("tool_calls")
                                        or delta.get("reasoning_content")):
            return 1
    return 0


def _whose(caller: Caller, tpm: int) -> str:
    return "this key may use" if caller.quota.tpm != tpm else "this owner's keys may use together"


def _int(v: Any) -> int:
    return v if isinstance(v, int) and v >= 0 else 0


def _header(scope: Scope, name: bytes) -> bytes | None:
    for k, v in scope["headers"]:
        if k == name:
            return v  # type: ignore[no-any-return]
    return None


_RID_PREFIX = "req_" + secrets.token_hex(8)
_rid_counter = itertools.count(1)


def _request_id(scope: Scope) -> str:
    """The X-Request-Id echoed to the client: its own when sane (1-64 of ``[A-Za-z0-9._-]``), else this
    process's random prefix and a counter. Only a label: usage records carry an id of their own."""
    given = _header(scope, b"x-request-id")
    if given is not None:
        rid = given.decode("latin-1")
        if _RID.match(rid):
            return rid
    return f"{_RID_PREFIX}{next(_rid_counter):x}"


async def _read_body(receive: Receive, limit: int) -> bytes | None:
    parts: list[bytes] = []
    size = 0
    while True:
        msg = await receive()
        chunk = msg.get("body", b"")
        size += len(chunk)
        if size > limit:
            return None
        parts.append(chunk)
        if not msg.get("more_body"):
            return parts[0] if len(parts) == 1 else b"".join(parts)


__all__ = ["Failed", "Gateway", "Options", "State"]
