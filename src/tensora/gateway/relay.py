"""The relay: a backend's answer on its way to the client, whole or streamed.

A whole answer is read (within the request's deadline, bounded by ``max_upstream_body_bytes``), its ``model`` set
to what the client asked for, and sent on with what really served it (X-Tensora-* headers). A stream's status is
held until its first content event, so that a failure before it is the walk's to move on from (``Failed``); after
it, a failure or a stall ends the stream with an error event and ``[DONE]``, never splicing another model's output in.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import orjson

from tensora.gateway import sse
from tensora.gateway.call import JSON, Call, Failed, Headers, Options, Served, answer, error_body
from tensora.gateway.chain import Backend, ServedBy
from tensora.gateway.upstream import Reply, UpstreamError

log = logging.getLogger("tensora.gateway")

_SSE = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]


def _what_served(b: Backend, served_by: str, trail: str) -> Headers:
    """X-Tensora-Served-By, -Fallback and -Attempts of an answer ``b`` gave (``trail``: the attempts, its own last)."""
    fallback = b.peer or b.served_by is not ServedBy.REPLICA
    return [(b"x-tensora-served-by", served_by.encode()), (b"x-tensora-fallback", b"true" if fallback else b"false"),
            (b"x-tensora-attempts", trail.encode())]


class Relay:
    """Sends a backend's answer on; each call returns what served it (``Served``), or raises ``Failed`` while the
    client has seen nothing yet."""

    def __init__(self, options: Options, clock: Callable[[], float]) -> None:
        self.options, self.clock = options, clock
        self._fixed: dict[str, tuple[Backend, Headers]] = {}  # by backend key: see ``_ok``

    def headers(self, call: Call, b: Backend, resp: Reply | None, ok: str) -> tuple[Headers, str, str]:
        served_by: str = b.served_by  # a StrEnum is its value (``.value`` runs interpreted Python)
        region = b.region
        if b.peer:  # the peer says what served it there
            assert resp is not None
            served_by = (resp.header(b"x-tensora-served-by") or b"replica").decode("latin-1")
            region = (resp.header(b"x-tensora-region") or b.region.encode()).decode("latin-1")
        trail = ",".join([*call.attempts, f"{b.key}:{ok}"])
        return [*_what_served(b, served_by, trail), *call.limit_headers()], served_by, region

    def prepare(self, call: Call, b: Backend) -> None:
        """While ``b`` works on the request (``Upstream.post``'s ``meanwhile``): the headers of its answer should it
        be a success, all but the content type and length, so that the answer goes on sooner once it is in. Not for
        a peer gateway: what served the request there is in its answer."""
        call.ready = None if b.peer else (b, self._success_headers(call, b, None)[0])

    def _success_headers(self, call: Call, b: Backend, resp: Reply | None) -> tuple[Headers, str, str]:
        """The headers of a success from ``b`` after its content type (and length), what served it, and where."""
        ready = call.ready
        if ready is not None and ready[0] is b:  # made while it was awaited (``prepare``)
            return ready[1], b.served_by, b.region
        if not b.peer and not call.attempts:  # the first backend answered: its headers, but the id and limits, kept
            fixed = self._fixed.get(b.key)
            if fixed is None or fixed[0] is not b:
                fixed = self._fixed_success_headers(b)
            return [(b"x-request-id", call.rid.encode()), *fixed[1], *call.limit_headers()], b.served_by, b.region
        headers, served_by, region = self.headers(call, b, resp, "ok")
        return [(b"x-request-id", call.rid.encode()), (b"x-tensora-region", region.encode()), *headers], \
            served_by, region

    def _fixed_success_headers(self, b: Backend) -> tuple[Backend, Headers]:
        """What ``_ok`` answers for a success of ``b`` at the first attempt, between the request id and the limits:
        the same every time, made once (by backend: one that changes in the route table is a new one)."""
        if len(self._fixed) >= 10_000:  # replicas come and go: bounded
            self._fixed.clear()
        fixed = self._fixed[b.key] = (b, [(b"x-tensora-region", b.region.encode()),
                                          *_what_served(b, b.served_by, f"{b.key}:ok")])
        return fixed

    async def pass_through(self, call: Call, headers: Headers, data: bytes, served: Served) -> Served:
        """Pass a backend's client error through unchanged (its status and body), with the whole trail."""
        trail = (b"x-tensora-attempts", ",".join(call.attempts).encode())
        await call.send({"type": "http.response.start", "status": served.status, "headers": [
            JSON, (b"content-length", str(len(data)).encode()), (b"x-request-id", call.rid.encode()),
            (b"x-tensora-region", served.region.encode()),
            *(trail if k == b"x-tensora-attempts" else (k, v) for k, v in headers)]})
        await call.send({"type": "http.response.body", "body": data})
        return served

    async def whole(self, call: Call, b: Backend, resp: Reply) -> Served:
        try:
            data = resp.read_now()  # a small answer is usually in with its head: no timer for it
            if data is None:
                async with asyncio.timeout(max(0.0, call.deadline - self.clock())):
                    data = await resp.read()
        except TimeoutError:
            raise Failed("timeout") from None
        except UpstreamError as exc:
            if exc.kind != "body_too_large":
                raise Failed(exc.kind) from None
            data = None  # answered below, out of the handler, as compiled code needs: test_gateway_compiled_rules
        if data is None:  # as large from any replica of the model: no other tier
            await answer(call.send, 502, error_body(
                f"the model server's answer is over {self.options.max_upstream_body_bytes} bytes", "server_error",
                "upstream_too_large"), call.rid, self.options.region, self.headers(call, b, resp, "body_too_large")[0])
            return Served(b, b.served_by, b.region, status=502)
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
        headers, served_by, region = self._success_headers(call, b, resp)
        out = orjson.dumps(obj)
        send = call.send
        await send({"type": "http.response.start", "status": 200, "headers": [
            JSON, (b"content-length", b"%d" % len(out)), *headers]})
        await send({"type": "http.response.body", "body": out})
        return Served(b, served_by, region, _token_count(usage.get("prompt_tokens")),
                      _token_count(usage.get("completion_tokens")))

    async def stream(self, call: Call, b: Backend, resp: Reply, first_by: float, idle_s: float) -> Served:
        """Hold the status until the first content event: a failure before it moves on (a real
        503 or 429 later, never a 200 with an empty stream); a failure after it ends the stream
        with an error event, never splicing another model's output in. After it, an event must come
        every ``idle_s`` (comments do not count): a stalled model server is not held to the deadline."""
        send, client_usage, deadline = call.send, call.client_usage, call.deadline
        events = sse.Events(self.options.max_sse_event_bytes)
        held: list[bytes] = []
        sending = False  # the head is out: from here a failure ends the stream with an error event
        served = Served(b, b.served_by, b.region)
        content = counted = 0
        done = False
        idle_by = deadline
        while not done:
            ended: str | None = None  # why the upstream stream failed, if it did
            try:
                if resp.ready():  # in already (most events of a stream): no timer to set and cancel
                    chunk = await resp.next_chunk()
                else:
                    async with asyncio.timeout(max(0.0, (idle_by if sending else first_by) - self.clock())):
                        chunk = await resp.next_chunk()
                payloads = events.feed(chunk) if chunk is not None else events.tail()
            except (TimeoutError, UpstreamError) as exc:
                ended = exc.kind if isinstance(exc, UpstreamError) else "timeout"
                if not sending:
                    raise Failed(ended) from None
            if ended is not None:  # out of the handler, as compiled code needs: test_gateway_compiled_rules
                kind = "stream_idle" if ended == "timeout" and idle_by < deadline else ended
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
                    served.prompt_tokens = _token_count(usage.get("prompt_tokens"))
                    served.completion_tokens = _token_count(usage.get("completion_tokens"))
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
                headers, served.served_by, served.region = self._success_headers(call, b, resp)
                await send({"type": "http.response.start", "status": 200, "headers": [*_SSE, *headers]})
                sending, out, held = True, held, []
            if out or done:
                await send({"type": "http.response.body", "body": b"".join(out), "more_body": not done})
        served.completion_tokens = served.completion_tokens or counted
        return served


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


def _token_count(v: Any) -> int:
    """A usage field's count: a non-negative int, else 0 (a model server's odd answer meters nothing)."""
    return v if isinstance(v, int) and v >= 0 else 0
