"""The gateway's request path, and its edge: check the key, read the body, admit against the rate limits.

A raw ASGI app (no framework on the hot path: a request costs one JSON parse and one dump of
its body, and one per streamed event). Steps of a request:

1. authenticate (the key's digest against the route table; 401/403 in OpenAI's error shape);
2. read and check the body (``body.parse``: a 400 naming the field); resolve ``model`` to the caller's
   endpoint or a serverless model; the request becomes one ``call.Call``;
3. admit: one request and its token reservation against the per-minute windows of the key's owner,
   and of the key when it is held lower, in one step (429; 503 when Redis is down and fails closed; 400 for a
   request that reserves more than a whole minute allows, which waiting never admits);
4. walk the chain within one deadline budget (``walk``: tiers, breakers, retries, 429s, context length),
   each answer relayed whole or streamed (``relay``);
5. settle the token reservation; meter the usage.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import secrets
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import orjson

from tensora.gateway import idempotency
from tensora.gateway.body import Invalid, parse
from tensora.gateway.breaker import Breaker, State
from tensora.gateway.call import HOP, Call, Failed, Options, Receive, Scope, Send, Served, answer, error_body
from tensora.gateway.chain import Backend, ServedBy
from tensora.gateway.limits import Admission, Caller, Limiter, Quota, Refused
from tensora.gateway.metering import Meter
from tensora.gateway.metrics import NONE, GatewayMetrics
from tensora.gateway.probe import Prober
from tensora.gateway.relay import Relay
from tensora.gateway.routes import KeyRoute, RouteTable
from tensora.gateway.upstream import Client, Reads
from tensora.gateway.walk import Walk
from tensora.keys import apikeys

if TYPE_CHECKING:
    from tensora.telemetry.tracing import Tracing

log = logging.getLogger("tensora.gateway")

_PATHS = {"/v1/chat/completions": "/chat/completions", "/v1/completions": "/completions"}
_RID = re.compile(r"^[A-Za-z0-9._-]{1,64}$")


Hook = Callable[[], Awaitable[None]]


class Gateway:
    """One gateway: its route table, limits and meter, and all it keeps across requests (each backend's breaker,
    the upstream connections, the keys seen, the request ids' counter), made whole here and owned by it alone.

    ``idem``: Idempotency-Key honoured when set. ``metrics``: each answer counted when set (``metrics_listen``).
    ``tracing``: a span per request, and one per attempt, when set. ``probe_interval_s``: its ejected backends
    probed this often (``prober``, run by ``app.build``'s hooks) when set. ``on_startup`` / ``on_shutdown``: run by
    the ASGI lifespan, in order."""

    def __init__(self, options: Options, table: Callable[[], RouteTable], limiter: Limiter, meter: Meter | None,
                 *, idem: idempotency.Idempotency | None = None, metrics: GatewayMetrics | None = None,
                 tracing: Tracing | None = None, probe_interval_s: float | None = None,
                 on_startup: Sequence[Hook] = (), on_shutdown: Sequence[Hook] = (),
                 clock: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time) -> None:
        self.options = options
        self.table = table
        self.limiter = limiter
        self.meter = meter
        self.clock, self.wall = clock, wall
        self.reads = Reads()  # the loop's reads, counted by this gateway's server and its upstream connections
        self.client = Client(options.connect_timeout_s, options.max_upstream_body_bytes, reads=self.reads)
        self.walk = Walk(options, clock, self.client, Relay(options, clock), tracing)
        self._callers: dict[str, Caller] = {}  # by key id, for the route table's version below
        self._may_infer: dict[str, bool] = {}  # by key id, for that version too: whether it may call models
        self._callers_version: str | None = None
        self._keys: dict[bytes, str] = {}  # secret -> digest, for keys seen before (bounded)
        self._record_ids = record_ids()
        self._rid_prefix = "req_" + secrets.token_hex(8)  # this gateway's, random: ids of two gateways never meet
        self._rid_count = 0  # a native int: its increment is the cheapest counter there is
        self.idem = idem
        self.metrics = metrics
        self.tracing = tracing
        self.prober = Prober(self, probe_interval_s, options.connect_timeout_s) if probe_interval_s else None
        self.on_startup: list[Hook] = list(on_startup)
        self.on_shutdown: list[Hook] = list(on_shutdown)

    @property
    def breakers(self) -> dict[str, Breaker]:
        return self.walk.breakers

    @property
    def ejected(self) -> dict[str, Backend]:
        """The backends whose breakers opened: what ``probe.Prober`` probes."""
        return self.walk.ejected

    # -- ASGI -----------------------------------------------------------------------------

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        headers = RequestHeaders(scope["headers"])
        rid = self._request_id(headers)
        path, method = scope["path"], scope["method"]
        failed = False
        try:
            if path in _PATHS:
                if method != "POST":
                    await self._error(send, rid, 405, "use POST", "invalid_request_error")
                    return
                if self.tracing is None:
                    await self._infer_and_count(headers, receive, send, rid, _PATHS[path])
                else:
                    await self._traced(scope, headers, receive, send, rid, _PATHS[path], self.tracing)
            elif path == "/v1/models" and method == "GET":
                await self._models(headers, send, rid)
            elif path in ("/healthz", "/readyz"):
                await self._send(send, 200, orjson.dumps({"status": "ok", "routes": self.table().version}), rid)
            else:
                await self._error(send, rid, 404, f"no route {method} {path}", "invalid_request_error",
                                  "not_found")
        except Exception:  # a bug: answer as OpenAI would rather than drop the connection
            log.exception("gateway request %s failed", rid)
            failed = True  # answered out of the handler, as compiled code needs: test_gateway_compiled_rules
        if failed:
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
        await answer(send, status, body, rid, self.options.region, headers)

    async def _error(self, send: Send, rid: str, status: int, message: str, type_: str, code: str | None = None,
                     param: str | None = None, headers: list[tuple[bytes, bytes]] | None = None) -> None:
        await self._send(send, status, error_body(message, type_, code, param), rid, headers)

    def _request_id(self, headers: RequestHeaders) -> str:
        """The X-Request-Id echoed to the client: its own when sane (1-64 of ``[A-Za-z0-9._-]``), else this
        gateway's random prefix and its counter. Only a label: usage records carry an id of their own."""
        given = headers.rid
        if given is not None:
            rid = given.decode("latin-1")
            if _RID.match(rid):
                return rid
        self._rid_count += 1
        return self._rid_prefix + str(self._rid_count)

    # -- step 1: who is calling -------------------------------------------------------------

    def _calling_key(self, headers: RequestHeaders, table: RouteTable) -> KeyRoute | tuple[int, str, str]:
        auth = headers.auth
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
        self._fresh(table)
        allowed = self._may_infer.get(key.id)
        if allowed is None:  # apikeys' rule runs as interpreted Python: once per key and route table
            allowed = self._may_infer[key.id] = apikeys.allows(key.scopes, "inference")
        if not allowed:
            return 403, "this key lacks the 'inference' scope", "insufficient_scope"
        return key

    async def _caller(self, headers: RequestHeaders, send: Send, rid: str, table: RouteTable) -> KeyRoute | None:
        """The calling key, or None once the 401/403 is sent."""
        key = self._calling_key(headers, table)
        if isinstance(key, KeyRoute):
            return key
        status, message, code = key
        await self._error(send, rid, status, message, "invalid_request_error", code)
        return None

    async def _models(self, headers: RequestHeaders, send: Send, rid: str) -> None:
        table = self.table()
        key = await self._caller(headers, send, rid, table)
        if key is None:
            return
        data = [{"id": e.name, "object": "model", "created": 0,
                 "owned_by": "tensora-serverless" if e.serverless else e.owner} for e in table.visible(key.owner)]
        await self._send(send, 200, orjson.dumps({"object": "list", "data": data}), rid)

    # -- steps 2-5 ----------------------------------------------------------------------------

    async def _traced(self, scope: Scope, headers: RequestHeaders, receive: Receive, send: Send, rid: str,
                      path: str, tracing: Tracing) -> None:
        """``_infer_and_count`` in a span of its own (the caller's ``traceparent`` its parent): the attempts are its
        children."""
        status = [0]

        def sent(msg: dict[str, Any]) -> Awaitable[None]:
            if msg["type"] == "http.response.start":
                status[0] = msg["status"]
            return send(msg)

        with tracing.request("gateway.request", scope["headers"], {"http.route": path,
                                                                    "tensora.request_id": rid}) as span:
            call = await self._infer_and_count(headers, receive, sent, rid, path)
            span.set_attribute("http.response.status_code", status[0])
            if call is not None:
                span.set_attribute("tensora.endpoint", f"{call.endpoint.owner}/{call.endpoint.name}")
                span.set_attribute("tensora.stream", call.stream)
                span.set_attribute("tensora.attempts", len(call.attempts))
                if call.served is not None:
                    span.set_attribute("tensora.served_by", str(call.served.served_by))

    async def _infer_and_count(self, headers: RequestHeaders, receive: Receive, send: Send, rid: str,
                               path: str) -> Call | None:
        """Steps 2-5; with metrics on, the answer's status and when its head went out are noted on the way."""
        m = self.metrics
        if m is None:
            return await self._infer(headers, receive, send, rid, path)
        clock = self.clock
        start = clock()
        head: list[Any] = [0, None]  # status, when the head went out

        def sent(msg: dict[str, Any]) -> Awaitable[None]:  # no coroutine of its own: send's is awaited
            if msg["type"] == "http.response.start":
                head[0], head[1] = msg["status"], clock()
            return send(msg)

        call = await self._infer(headers, receive, sent, rid, path)
        served = call.served if call is not None else None
        b = served.backend if served is not None else None
        m.served(f"{call.endpoint.owner}/{call.endpoint.name}" if call is not None else NONE,
                 NONE if b is None else "peer" if b.peer else b.served_by,
                 served.served_by if served is not None else NONE, head[0],
                 call is not None and call.stream, start, head[1], clock(), call.attempts if call else [])
        return call

    async def _infer(self, headers: RequestHeaders, receive: Receive, send: Send, rid: str, path: str) -> Call | None:
        """Steps 2-5; the call once made (what the metrics label it by), else None."""
        table = self.table()
        key = await self._caller(headers, send, rid, table)
        if key is None:
            return None
        raw = await _read_body(receive, self.options.max_body_bytes)
        if raw is None:
            await self._error(send, rid, 413, f"the body is over {self.options.max_body_bytes} bytes",
                              "invalid_request_error")
            return None
        try:
            parsed: Any = orjson.loads(raw)
        except orjson.JSONDecodeError:
            parsed = None
        ask = parse(parsed, self.options.default_max_tokens)
        if isinstance(ask, Invalid):
            await self._error(send, rid, 400, ask.message, "invalid_request_error", ask.code, ask.param)
            return None
        endpoint = table.resolve(key.owner, ask.model)
        if endpoint is None:
            await self._error(send, rid, 404, f"The model '{ask.model}' does not exist or you do not have access "
                              "to it.", "invalid_request_error", "model_not_found", "model")
            return None
        call = Call(send, rid, path, key, table, endpoint, ask.obj, ask.stream, ask.include_usage, ask.reserve,
                    headers.auth or b"", headers.hop, least=ask.least)
        idem = self.idem
        ik = headers.idem if idem is not None else None
        if idem is None or ik is None:
            call.served = await self._serve(call)
        else:  # replayed, refused, or served once and kept
            head = [(b"x-request-id", rid.encode()), (b"x-tensora-region", self.options.region.encode())]

            async def serve(s: Send) -> Served | None:
                call.served = await self._serve(replace(call, send=s))
                return call.served

            await idem.run(send, head, key.id, path, ik, ask.obj, serve, lambda: self._count(send, rid, key, table),
                           key.owner)
        return call

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
            if self.metrics is not None:
                self.metrics.refused(key.owner, "too_large")
            # never admitted, however long the client waits: a 400 (a 429 is one the openai client retries)
            await self._error(send, rid, 400, f"this request reserves {reserve} tokens (prompt + max_tokens x n), "
                              f"more than {_whose(caller, tpm)} allows in a whole minute, "
                              "so it can never be admitted: lower max_tokens", "invalid_request_error",
                              "max_tokens_over_limit", "max_tokens")
            return None
        adm = await self.limiter.admit(caller, reserve, self.wall())
        if not adm.ok:
            await self._refuse(send, rid, adm)
            return None
        call.admission = adm

        # step 4: the chain; the reservation settled whatever happens. Not with a ``finally``: compiled (mypyc), the
        # end of one re-raises the exception the thread holds, which after the ``await`` in it may be another
        # request's, one its code caught (seen: a Redis error ``settle`` had caught, raised again here as a 500).
        served: Served | None = None
        failed: BaseException | None = None
        try:
            served = await self.walk.run(call)
        except BaseException as exc:  # a cancel too: raised again once the tokens are settled
            failed = exc
        used = served.prompt_tokens + served.completion_tokens if served is not None else 0
        await self.limiter.settle(adm, used)
        if failed is not None:
            raise failed
        if served is not None and self.meter is not None:
            b = served.backend
            product = ("cross-region" if b.peer else "serverless" if served.served_by == ServedBy.SERVERLESS
                       else "fallback-model" if served.served_by == ServedBy.FALLBACK_MODEL else "endpoint")
            self.meter.records.add({  # the id is ours and unguessable; the client's X-Request-Id is only stored beside
                "id": next(self._record_ids), "client_request_id": rid, "at": self.wall(), "owner": key.owner,
                "key_id": key.id, "endpoint": endpoint.name,
                "endpoint_id": endpoint.id, "product": product, "answered_by": b.endpoint_id, "model": b.model,
                "served_by": served.served_by, "region": served.region, "prompt_tokens": served.prompt_tokens,
                "completion_tokens": served.completion_tokens, "status": served.status})
        return served

    def _caller_limits(self, key: KeyRoute, table: RouteTable) -> Caller:
        """The windows ``key``'s requests count against, kept until the route table changes: its owner's
        (from the table, else this gateway's defaults), and its own when it is held lower than those."""
        self._fresh(table)
        found = self._callers.get(key.id)
        if found is None:
            o = table.owners.get(key.owner)
            owner = Quota(o.rpm, o.tpm) if o is not None else Quota(self.options.rpm, self.options.tpm)
            own = Quota(min(key.rpm or owner.rpm, owner.rpm), min(key.tpm or owner.tpm, owner.tpm))
            found = self._callers[key.id] = Caller(key.owner, owner, key.id, None if own == owner else own)
        return found

    def _fresh(self, table: RouteTable) -> None:
        """What is kept by key id (``_callers``, ``_may_infer``) holds for one route table's version."""
        if table.version != self._callers_version:
            self._callers.clear()
            self._may_infer.clear()
            self._callers_version = table.version

    async def _refuse(self, send: Send, rid: str, adm: Admission) -> None:
        """A 429 naming the window that refused, or a 503 when the limits cannot be checked (fail closed)."""
        if self.metrics is not None:
            self.metrics.refused(adm.caller.owner if adm.caller is not None else NONE, str(adm.reason))
        if adm.reason is Refused.UNAVAILABLE:
            retry = str(self.options.retry_after_s).encode()
            await self._error(send, rid, 503, "rate limits cannot be checked now (their store is unreachable); "
                              f"retry after {self.options.retry_after_s} s", "server_error", "rate_limiter_unavailable",
                              headers=[(b"retry-after", retry)])
            return
        q = dict(adm.caller.windows).get(adm.scope, adm.quota) if adm.caller is not None else adm.quota
        limit = q.rpm if adm.reason is Refused.REQUESTS else q.tpm
        whose = "this key's own limit" if adm.scope == "key" else "shared by all of this owner's keys"
        await self._error(send, rid, 429, f"Rate limit reached for {adm.reason} per minute: limit {limit}, {whose};"
                          f" retry after {adm.retry_after} s", str(adm.reason), "rate_limit_exceeded",
                          headers=[(b"retry-after", str(adm.retry_after).encode()), *adm.headers()])


def _whose(caller: Caller, tpm: int) -> str:
    """Whose ``tokens_per_minute`` is ``tpm``: the key's own when it is held lower, else its owner's."""
    if caller.quota.tpm != tpm:
        return f"this key's own tokens_per_minute ({tpm})"
    return f"the owner's tokens_per_minute ({tpm}, shared by all its keys)"


_WANTED = {b"authorization": 0, b"x-request-id": 1, HOP: 2, idempotency.HEADER: 3}  # name -> its slot below


class RequestHeaders:
    """The request headers the gateway reads, found in one pass over them, the first of each name (rather than a
    scan of all headers for each name it reads: that scan cost more than anything else of the headers)."""

    __slots__ = ("auth", "hop", "idem", "rid")

    def __init__(self, headers: Any) -> None:  # the scope's: any iterable of pairs, as ASGI allows
        self.auth: bytes | None = None  # Authorization
        self.rid: bytes | None = None  # X-Request-Id
        self.hop = False  # X-Tensora-Hop: sent by a peer gateway
        self.idem: bytes | None = None  # Idempotency-Key
        for k, v in headers:
            i = _WANTED.get(k, -1)
            if i < 0:
                continue
            if i == 0:
                if self.auth is None:
                    self.auth = v
            elif i == 1:
                if self.rid is None:
                    self.rid = v
            elif i == 2:
                self.hop = True
            elif self.idem is None:
                self.idem = v


def record_ids(batch: int = 256) -> Iterator[str]:
    """Usage record ids: 128 random bits each, from the OS's generator, drawn ``batch`` at a time (not a
    ``getrandom`` call per request); as unguessable as one draw each."""
    while True:
        pool = os.urandom(16 * batch).hex()
        for i in range(0, len(pool), 32):
            yield pool[i:i + 32]


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


__all__ = ["HOP", "Call", "Failed", "Gateway", "Options", "Served", "State", "error_body"]
