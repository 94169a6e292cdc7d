"""Pure ASGI middleware in front of every route: request ids, body size, in-flight bound, draining.

Written by hand rather than with Starlette's BaseHTTPMiddleware, which wraps every
response body in an extra task and stream (a cost on each request for nothing we need).
"""

from __future__ import annotations

import secrets
from typing import Any

import orjson

from tensora.api import metrics
from tensora.api.errors import error_body

Scope = dict[str, Any]

_EXEMPT = ("/healthz",)
_STREAMED = ("/v1/files/",)
"""PUT routes that read their body as a stream and bound it themselves: an upload's limit is the
owner's remaining storage quota, not ``max_body_bytes`` (which is for JSON bodies)."""


class Guard:
    """``max_in_flight`` requests at once, bodies up to ``max_body_bytes``, 503 while draining."""

    def __init__(self, app: Any, max_in_flight: int = 256, max_body_bytes: int = 1 << 20) -> None:
        self.app = app
        self.max_in_flight = max_in_flight
        self.max_body_bytes = max_body_bytes
        self.in_flight = 0
        self.draining = False

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        rid = headers.get(b"x-request-id", b"").decode("latin-1")[:64] or "req_" + secrets.token_hex(8)
        extra = [(b"x-request-id", rid.encode())]
        path = scope.get("path", "")
        if path not in _EXEMPT:
            if self.draining:
                metrics.unavailable("draining")
                await _reply(send, 503, "service_unavailable", "the server is shutting down; retry", extra, 2)
                return
            if self.in_flight >= self.max_in_flight:
                metrics.unavailable("overloaded")
                await _reply(send, 503, "service_unavailable", "too many requests in flight; retry", extra, 1)
                return
        length = headers.get(b"content-length")
        streamed = scope.get("method") == "PUT" and path.startswith(_STREAMED)  # neither limited nor buffered here
        if not streamed and length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            await _reply(send, 413, "payload_too_large",
                         f"the body is larger than {self.max_body_bytes} bytes", extra)
            return
        if not streamed and length is None and scope.get("method") in ("POST", "PUT", "PATCH"):
            # A body without Content-Length (chunked): read it here, up to the limit, then replay it.
            chunks, size, more = [], 0, True
            while more:
                message = await receive()
                if message["type"] != "http.request":
                    return
                chunks.append(message.get("body", b""))
                size += len(chunks[-1])
                more = message.get("more_body", False)
                if size > self.max_body_bytes:
                    await _reply(send, 413, "payload_too_large",
                                 f"the body is larger than {self.max_body_bytes} bytes", extra)
                    return
            body, sent, original = b"".join(chunks), False, receive

            async def replay() -> Any:
                nonlocal sent
                if sent:
                    return await original()
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}

            receive = replay

        async def send_with_id(message: Any) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), *extra]
            await send(message)

        self.in_flight += 1
        try:
            await self.app(scope, receive, send_with_id)
        finally:
            self.in_flight -= 1


async def _reply(send: Any, status: int, type_: str, message: str, extra: list[tuple[bytes, bytes]],
                 retry_after: int | None = None) -> None:
    body = orjson.dumps(error_body(type_, message))
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *extra]
    if retry_after is not None:
        headers.append((b"retry-after", str(retry_after).encode()))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
