"""The walk: a request's way down the chain (``chain.tiers``, ordered by ``chain.order``) within one deadline.

Every attempt has a time-to-first-token deadline, and a failure before the first token moves on: a 5xx or a reset
from the only backend of its tier is tried once more there first, after a short jittered delay, when the deadline
leaves room; a 429 skips that backend until its Retry-After, without counting against its breaker; a 400 saying
the prompt is over the model's context goes to the fallback models only (a larger known context first); a
request known to be over a model's context (its config.json's) is not sent to it at all; any other 4xx is
passed through. Each backend's breaker hears how it went.
Nothing left to try: 503 with the soonest Retry-After.
"""

from __future__ import annotations

import asyncio
import contextlib
import email.utils
import math
import random
import re
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import orjson

from tensora.gateway import chain
from tensora.gateway.breaker import Breaker
from tensora.gateway.call import HOP, Call, Failed, Options, Served, answer, error_body
from tensora.gateway.chain import Backend
from tensora.gateway.relay import Relay
from tensora.gateway.routes import EndpointRoute, RouteTable
from tensora.gateway.upstream import Reply, Upstream, UpstreamError

if TYPE_CHECKING:
    from tensora.telemetry.tracing import Tracing


class Walk:
    """The chain's state across requests: each backend's breaker, the ejected backends (what ``probe.Prober``
    probes), the round-robin turn, and the tiers of each endpoint for the route table's version."""

    def __init__(self, options: Options, clock: Callable[[], float], client: Upstream, relay: Relay,
                 tracing: Tracing | None = None) -> None:
        self.options, self.clock, self.client, self.relay = options, clock, client, relay
        self.breakers: dict[str, Breaker] = {}
        self.ejected: dict[str, Backend] = {}  # whose breakers opened: what ``probe.Prober`` probes
        self._turn = 0
        self._tiers_cache: dict[tuple[str, bool], _Tiers] = {}
        self._tiers_version: str | None = None
        self.tracing = tracing  # a span per attempt when set (``tracing``)

    def _tiers(self, endpoint: EndpointRoute, table: RouteTable, hopped: bool) -> _Tiers:
        """``chain.tiers`` for this endpoint, kept until the route table changes."""
        if table.version != self._tiers_version:
            self._tiers_cache.clear()
            self._tiers_version = table.version
            self._forget(table)
        key = (endpoint.id, hopped)
        found = self._tiers_cache.get(key)
        if found is None:
            found = self._tiers_cache[key] = _Tiers(chain.tiers(endpoint, table, self.options.peers, hopped=hopped))
        return found

    def _plan(self, t: _Tiers, now: float) -> chain.Plan:
        """``chain.order`` of these tiers for this turn. While none of their backends' breakers is open or holds
        a 429's wait running (``clear``), that is the rotation alone, made once per turn of the cycle (``t.plans``)."""
        if t.plans and t.clear(self.breakers, now):
            return t.plans[self._turn % len(t.plans)]
        return chain.order(t.tiers, self._open_until(now), self._turn, self._limited_until(now))

    def _forget(self, table: RouteTable) -> None:
        """The breakers of backends gone from the route table go with them: else every replica that ever was
        keeps its state for the gateway's life (and one that comes back under its name would find it)."""
        known = {f"{e.name}/{r.id}" for e in table.endpoints for r in e.replicas}
        known.update(f"peer:{p.region}" for p in self.options.peers)
        for key in [k for k in self.breakers if k not in known]:
            del self.breakers[key]
            self.ejected.pop(key, None)

    def _breaker(self, key: str) -> Breaker:
        b = self.breakers.get(key)
        if b is None:
            b = self.breakers[key] = Breaker(self.options.breaker)
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
            wait = f.retry_s if f.retry_s is not None else self.options.rate_limit_backoff_s * (0.5 + random.random())
            until = now + min(wait, self.options.breaker.max_s)
            hints.append(until)
            if b.peer:
                breaker.release()
            else:
                breaker.rate_limited(until)
        else:
            breaker.release()

    async def run(self, call: Call) -> Served | None:
        """Answer ``call`` from the first backend that can; None once the 503 is sent."""
        start = self.clock()
        deadline = call.deadline = start + self.options.deadline_s
        self._turn += 1
        tiers = self._tiers(call.endpoint, call.table, call.hopped)
        plan = self._plan(tiers, start)
        attempts = call.attempts
        if plan.skipped or plan.limited:
            attempts += [f"{b.key}:breaker_open" for b in plan.skipped]  # skipped at once, nothing sent
            attempts += [f"{b.key}:rate_limited" for b in plan.limited]
        todo, small = chain.too_small(plan.attempts, call.least) if tiers.sized else (plan.attempts, ())
        if small:  # known too small for this request: not sent, a fallback model may take it
            attempts += [f"{b.key}:context_too_small" for b in small]
            if not todo:
                await answer(call.send, 400, error_body(
                    f"this request needs at least {call.least} tokens (the prompt and max_tokens), more than the "
                    f"context of {call.endpoint.name} and of every fallback model that could take it (largest: "
                    f"{max(b.context or 0 for b in small)})", "invalid_request_error", "context_length_exceeded",
                    "messages"), call.rid, self.options.region, [
                    (b"x-tensora-fallback", b"false"), (b"x-tensora-attempts", ",".join(attempts).encode()),
                    *call.limit_headers()])
                return None
        i = 0
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
            ttft = min(b.ttft_s or self.options.ttft_s, deadline - now)
            alone = not b.peer and b.key in tiers.alone
            failed: Failed | None = None
            try:
                if alone or self.tracing is not None:
                    served = await self._attempt(call, b, ttft, alone=alone)
                else:  # no retry to make here, no span: ``_once``'s work alone
                    served = await self._send(call, b, ttft, ())
            except Failed as f:
                failed = f  # out of the handler, as compiled code needs: test_gateway_compiled_rules
            if failed is not None:
                attempts.append(f"{b.key}:{failed.kind}")
                self._failed(b, breaker, failed, hints)
                if failed.reply is not None:  # too long for this model: only the fallback models are left
                    todo, i = chain.longer_context(todo[i:], b), 0
                    if not todo:  # none: the model server's own 400, as it said it
                        return await self.relay.pass_through(call, *failed.reply)
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
        wait = min(soonest) - now if soonest else float(self.options.retry_after_s)
        retry = max(1, math.ceil(wait))
        what = "no replica of it is ready" if not attempts else "every backend failed or is cooling down"
        await answer(call.send, 503, error_body(f"{call.endpoint.name} cannot serve now: {what}; retry after {retry} s",
                                                "server_error", "service_unavailable"), call.rid, self.options.region, [
            (b"retry-after", str(retry).encode()), (b"retry-after-ms", b"%d" % max(1, wait * 1000)),
            (b"x-tensora-fallback", b"false"), (b"x-tensora-attempts", ",".join(attempts).encode()),
            *call.limit_headers()])
        return None

    async def _attempt(self, call: Call, b: Backend, ttft: float, *, alone: bool = False) -> Served:
        """One backend; when it is its tier's only one, a 5xx or a reset gets one more try of it after a
        short jittered delay (a restart or a dropped connection often clears in that time), both in
        X-Tensora-Attempts. Not a 4xx, not a timeout, not when the deadline leaves no room."""
        try:
            return await self._once(call, b, ttft)
        except Failed as f:
            if not (alone and (f.kind == "reset" or f.kind.startswith("http_5"))):
                raise
            delay = self.options.retry_delay_s * random.uniform(0.5, 1.5)
            now = self.clock()
            if call.deadline - now - delay < self.options.retry_room_s:
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
        """One try of ``b``, in a span of its own when traced. The walk calls ``_send`` itself when there is
        neither a span nor a retry to make: two coroutines less on the way of nearly every request."""
        tracing = self.tracing
        if tracing is None:
            return await self._send(call, b, ttft, ())
        with tracing.span("gateway.attempt", {"tensora.tier": "peer" if b.peer else b.served_by.value,
                                              "tensora.backend": b.key}, client=True) as span:
            try:
                served = await self._send(call, b, ttft, tracing.headers())
            except Failed as f:
                span.set_attribute("tensora.outcome", f.kind)
                raise
            span.set_attribute("tensora.outcome", "ok" if served.status == 200 else f"http_{served.status}")
            return served

    async def _send(self, call: Call, b: Backend, ttft: float, trace: tuple[()] | list[tuple[str, str]]) -> Served:
        body = call.body
        up = dict(body)
        up["model"] = b.upstream_model
        headers = [("x-request-id", call.rid), *trace]
        if b.peer:  # a peer gateway checks the caller's own key
            headers += [("authorization", call.auth.decode("latin-1")), (HOP.decode(), self.options.region)]
        elif b.api_key:  # a replica gets its own key, never the caller's
            headers.append(("authorization", f"Bearer {b.api_key}"))
        if call.stream:
            opts = body.get("stream_options")
            up["stream_options"] = {**(opts if isinstance(opts, dict) else {}), "include_usage": True}
        first_by = self.clock() + ttft
        call.ready = None  # the answer headers of an attempt before this one, if any: not this one's
        try:
            resp = await self.client.post(b.base_url, call.path, orjson.dumps(up), headers, ttft,
                                          lambda: self.relay.prepare(call, b))
        except UpstreamError as exc:
            raise Failed(exc.kind) from None
        try:
            if resp.status != 200:
                return await self._not_ok(call, b, resp)
            if call.stream:
                return await self.relay.stream(call, b, resp, first_by, b.stream_idle_s or self.options.stream_idle_s)
            return await self.relay.whole(call, b, resp)
        finally:
            resp.release()

    async def _not_ok(self, call: Call, b: Backend, resp: Reply) -> Served:
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
        headers, served_by, region = self.relay.headers(call, b, resp, f"http_{status}")
        served = Served(b, served_by, region, status=status)
        if status == 400 and context_exceeded(data):
            raise Failed("context_length_exceeded", breaker=False, reply=(headers, data, served))
        call.attempts.append(f"{b.key}:http_{status}")
        return await self.relay.pass_through(call, headers, data, served)


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


class _Tiers:
    """An endpoint's tiers (``chain.tiers``) and what the walk reads of them on every request, made once:
    every backend's key, the keys alone in a tier (``_attempt``: a peer gateway never is, it makes its own
    retries), whether any has a known context (``sized``: else ``chain.too_small`` has nothing to rule out), and
    ``chain.order``'s plan for each turn of the rotation while no breaker is open or limited."""

    __slots__ = ("alone", "keys", "plans", "sized", "tiers")

    _MAX_PLANS = 64  # turns in a cycle of the rotation worth keeping a plan each for

    def __init__(self, tiers: list[list[Backend]]) -> None:
        self.tiers = tiers
        self.keys = tuple(b.key for t in tiers for b in t)
        self.alone = frozenset(t[0].key for t in tiers if len(t) == 1)
        self.sized = any(b.context is not None for t in tiers for b in t)  # ``chain.too_small`` can rule one out
        cycle = math.lcm(1, *(len(t) for t in tiers[:-1] if t))  # the last tier (peers) is not rotated
        self.plans = [chain.order(tiers, _never, turn) for turn in range(cycle)] if cycle <= self._MAX_PLANS else []

    def clear(self, breakers: dict[str, Breaker], now: float) -> bool:
        """Would ``chain.order`` skip none of these backends now (``Breaker.skipped``)?"""
        for k in self.keys:
            b = breakers.get(k)
            if b is not None and b.skipped(now):
                return False
        return True


def _never(key: str) -> float | None:
    return None
