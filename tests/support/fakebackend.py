"""A fast fake OpenAI-compatible backend, for fault injection and the gateway benchmark.

``python tests/support/fakebackend.py --port N --name r1 [--mode ok] [--chunks 20]``. It answers
``/v1/chat/completions`` and ``/v1/completions`` (JSON or SSE) and ``GET /v1/models``, and misbehaves
on purpose by mode: ``http_500``, ``http_503``, ``http_429``, ``http_400``, ``close`` (drops the
connection), ``stall_head`` (never answers), ``stall_after_headers`` (a 200 stream with no event),
``die_mid_stream`` (three content events, then the connection drops), ``stall_mid_stream`` (three
content events, then nothing while the connection stays open), ``no_done`` (a stream with no ``[DONE]``,
as transformers serve sends), ``hold_reset`` (reads the request, holds it ``hold_s`` seconds, then resets
the connection: work done, answer lost), ``close_idle`` (answers, then closes the kept-alive connection
at once, as a server with a short idle timeout does), ``down`` (503 to every ``/v1`` request,
``/v1/models`` too: a server whose engine is dead). With ``VLLM_API_KEY`` in its environment it answers
401 to a ``/v1`` request without ``Authorization: Bearer <that key>``, as vLLM does.
``POST /_mode {"mode": ...}`` changes the mode live, and may also give ``headers`` (added to an
``http_*`` answer, e.g. Retry-After), ``error`` (the error object it carries, e.g. a context-length 400),
``hold_s`` (default 0.3) and ``times`` (the mode serves that many completion requests, then ``ok``
again); ``GET /_stats`` counts requests (and probes: ``GET /v1/models``) and shows the last completion's
Authorization header and all its headers (what the gateway sent upstream); ``POST /v1/gateway/usage`` takes
usage batches (a sink for a gateway under benchmark) and other paths are 404. Raw asyncio and httptools: it must be much
faster than what it is put behind, or the benchmark measures it. Not part of the product: the gateway tests
(``gateway_harness``) and ``bench/gateway.py`` run it as a child process; it imports nothing from tensora.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import struct
import time
from typing import Any

import httptools
import orjson

MODES = ("ok", "http_500", "http_503", "http_429", "http_400", "close", "stall_head", "stall_after_headers",
         "die_mid_stream", "no_done", "down", "stall_mid_stream", "hold_reset", "close_idle")


class State:
    def __init__(self, name: str, mode: str, chunks: int, api_key: str | None = None) -> None:
        self.name, self.mode, self.chunks, self.api_key = name, mode, chunks, api_key
        self.requests = 0
        self.hold_s = 0.3  # hold_reset: how long a request is held before the reset
        self.left: int | None = None  # completion requests left in this mode before it turns ok (None: no end)
        self.authorization: str | None = None  # the last completion request's
        self.traceparent: str | None = None  # the last completion request's (W3C trace context)
        self.headers: dict[str, str] = {}  # extra headers of an http_* answer
        self.error: dict[str, Any] | None = None  # the error object of an http_* answer
        self.probes = 0  # GET /v1/models
        self.seen: list[tuple[str, str]] = []  # every header of the last completion request, as it came


def _json(status: int, obj: Any, extra: bytes = b"") -> bytes:
    body = orjson.dumps(obj)
    reason = {200: b"OK", 400: b"Bad Request", 401: b"Unauthorized", 404: b"Not Found", 429: b"Too Many Requests",
              500: b"Internal Server Error", 503: b"Service Unavailable"}.get(status, b"X")
    return (b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n%s\r\n"
            % (status, reason, len(body), extra)) + body


class _Proto(asyncio.Protocol):
    def __init__(self, state: State) -> None:
        self.state = state
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.url = b""
        self.body: list[bytes] = []
        self.authorization: bytes | None = None
        self.traceparent: bytes | None = None
        self.head: list[tuple[str, str]] = []
        self.tasks: set[asyncio.Task[None]] = set()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            if self.transport is not None:
                self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        for t in self.tasks:
            t.cancel()

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self.head.append((name.decode("latin-1"), value.decode("latin-1")))
        if name.lower() == b"authorization":
            self.authorization = value
        elif name.lower() == b"traceparent":
            self.traceparent = value

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        url, body, auth, tp, head = self.url, b"".join(self.body), self.authorization, self.traceparent, self.head
        self.url, self.body, self.authorization, self.traceparent, self.head = b"", [], None, None, []
        method = self.parser.get_method()
        t = asyncio.get_running_loop().create_task(self.handle(method, url, body, auth, tp, head))
        self.tasks.add(t)
        t.add_done_callback(self.tasks.discard)

    def reset(self) -> None:
        """Drop the connection with an RST, not a FIN."""
        if self.transport is not None:
            sock = self.transport.get_extra_info("socket")
            if sock is not None:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.transport.abort()

    def write(self, data: bytes) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(data)

    async def handle(self, method: bytes, url: bytes, body: bytes, auth: bytes | None = None,
                     traceparent: bytes | None = None, head: list[tuple[str, str]] | None = None) -> None:
        s = self.state
        if url == b"/_mode":
            knobs = orjson.loads(body)
            s.mode, s.headers, s.error = knobs["mode"], knobs.get("headers") or {}, knobs.get("error")
            s.hold_s, s.left = float(knobs.get("hold_s", 0.3)), knobs.get("times")
            self.write(_json(200, {"mode": s.mode}))
            return
        if url == b"/_stats":
            self.write(_json(200, {"requests": s.requests, "mode": s.mode, "name": s.name,
                                   "authorization": s.authorization, "probes": s.probes,
                                   "traceparent": s.traceparent, "headers": s.seen}))
            return
        if url.startswith(b"/v1/") and s.api_key and auth != b"Bearer " + s.api_key.encode():
            self.write(_json(401, {"error": "Unauthorized"}))
            return
        if url in (b"/health", b"/healthz"):
            self.write(_json(200, {"status": "ok"}))
            return
        if url.startswith(b"/v1/") and s.mode == "down":
            s.probes += url == b"/v1/models"
            s.requests += url != b"/v1/models"
            self.write(_json(503, {"error": {"message": f"{s.name} is down", "type": "server_error"}}))
            return
        if url == b"/v1/models":
            s.probes += 1
            self.write(_json(200, {"object": "list", "data": [{"id": s.name, "object": "model"}]}))
            return
        if url == b"/v1/gateway/usage":  # a usage sink for a gateway under benchmark: takes every batch
            n = len(orjson.loads(body).get("records", [])) if body else 0
            self.write(_json(200, {"received": n, "new": n}))
            return
        if not url.endswith((b"/chat/completions", b"/completions")):
            self.write(_json(404, {"error": {"message": "not found", "type": "invalid_request_error"}}))
            return
        s.requests += 1
        s.authorization = auth.decode("latin-1") if auth is not None else None
        s.traceparent = traceparent.decode("latin-1") if traceparent is not None else None
        s.seen = list(head or [])
        mode = s.mode
        if s.left is not None:
            s.left -= 1
            if s.left <= 0:
                s.mode, s.left = "ok", None
        if mode == "close":
            assert self.transport is not None
            self.transport.close()
            return
        if mode == "stall_head":
            await asyncio.sleep(3600)
            return
        if mode == "hold_reset":
            await asyncio.sleep(s.hold_s)
            self.reset()
            return
        if mode.startswith("http_"):
            code = int(mode[5:])
            error = s.error or {"message": f"{s.name} says {code}", "type": "server_error", "code": code}
            extra = b"".join(b"%s: %s\r\n" % (k.encode(), v.encode()) for k, v in s.headers.items())
            self.write(_json(code, {"error": error}, extra))
            return
        req = orjson.loads(body) if body else {}
        model = req.get("model", s.name)
        chat = url.endswith(b"/chat/completions")
        n = int(req.get("max_tokens") or s.chunks)
        n = min(n, s.chunks)
        created = int(time.time())
        if not req.get("stream"):
            text = " ".join(["tok"] * n)
            choice = ({"index": 0, "message": {"role": "assistant", "content": f"{s.name}: {text}"},
                       "finish_reason": "stop"} if chat else {"index": 0, "text": f"{s.name}: {text}",
                                                              "finish_reason": "stop"})
            self.write(_json(200, {"id": "cmpl-1", "object": "chat.completion" if chat else "text_completion",
                                   "created": created, "model": model, "choices": [choice],
                                   "usage": {"prompt_tokens": 7, "completion_tokens": n, "total_tokens": 7 + n}},
                             b"x-backend: " + s.name.encode() + b"\r\n"))
            if mode == "close_idle" and self.transport is not None:
                self.transport.close()
            return
        self.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n"
                   b"x-backend: " + s.name.encode() + b"\r\n\r\n")
        if mode == "stall_after_headers":
            await asyncio.sleep(3600)
            return
        obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(payload: bytes) -> None:
            ev = b"data: " + payload + b"\n\n"
            self.write(b"%x\r\n%s\r\n" % (len(ev), ev))

        def delta(content: str | None, finish: str | None = None, role: bool = False) -> bytes:
            if chat:
                d: dict[str, Any] = {"role": "assistant", "content": ""} if role else (
                    {"content": content} if content is not None else {})
                c: dict[str, Any] = {"index": 0, "delta": d, "finish_reason": finish}
            else:
                c = {"index": 0, "text": content or "", "finish_reason": finish}
            return orjson.dumps({"id": "cmpl-1", "object": obj, "created": created, "model": model, "choices": [c]})

        if chat:
            chunk(delta(None, role=True))
        for i in range(n):
            if mode == "stall_mid_stream" and i == 3:
                await asyncio.sleep(3600)
                return
            if mode == "die_mid_stream" and i == 3:
                await asyncio.sleep(0.01)
                assert self.transport is not None
                self.transport.close()
                return
            chunk(delta(f"{s.name}:{i} " if i == 0 else "tok "))
        chunk(delta(None, "stop"))
        opts = req.get("stream_options") or {}
        if opts.get("include_usage"):
            chunk(orjson.dumps({"id": "cmpl-1", "object": obj, "created": created, "model": model, "choices": [],
                                "usage": {"prompt_tokens": 7, "completion_tokens": n, "total_tokens": 7 + n}}))
        if mode != "no_done":
            chunk(b"[DONE]")
        self.write(b"0\r\n\r\n")


async def serve(port: int, name: str, mode: str, chunks: int, host: str = "127.0.0.1") -> None:
    state = State(name, mode, chunks, os.environ.get("VLLM_API_KEY"))
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: _Proto(state), host, port, backlog=1024)
    async with server:
        await server.serve_forever()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--name", default="fake")
    ap.add_argument("--mode", default="ok", choices=MODES)
    ap.add_argument("--chunks", type=int, default=20)
    a = ap.parse_args()
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    asyncio.run(serve(a.port, a.name, a.mode, a.chunks))


if __name__ == "__main__":
    main()
