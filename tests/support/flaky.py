"""A fault-injecting HTTP proxy for the SDK's retry tests: the fake is the point.

It sits in front of a real control API and answers each request by the next step of its
script: pass it on, drop the connection before or after passing it on (the answer is lost on
the way back), answer a canned status with headers, or stall. Every request it sees is
recorded (method, path, headers), so a test counts attempts and compares Idempotency-Keys.
Each connection serves one request (``Connection: close``), so a drop is never confused with a
stale pooled connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import h11
import httpx
import orjson

from tests.support.services import free_port


@dataclass(frozen=True)
class Step:
    """``action``: pass | drop (before the upstream sees it) | lost (upstream answered; answer dropped) |
    status (``status``, ``headers``, ``body``) | stall (``seconds``, then drop)."""

    action: str
    status: int = 200
    headers: dict[str, str] = field(default_factory=dict)
    body: Any = None
    seconds: float = 0.0


PASS = Step("pass")
DROP = Step("drop")
LOST = Step("lost")


def status(code: int, body: Any = None, **headers: str) -> Step:
    return Step("status", code, {k.replace("_", "-"): v for k, v in headers.items()},
                body if body is not None else {"error": {"type": "injected", "message": f"injected {code}"}})


def stall(seconds: float) -> Step:
    return Step("stall", seconds=seconds)


@dataclass(frozen=True)
class Seen:
    method: str
    path: str
    headers: dict[str, str]


class FlakyProxy:
    """``FlakyProxy(upstream_url, [steps...])``; after the script runs out, every request passes."""

    def __init__(self, upstream: str | None, script: list[Step] | None = None) -> None:
        self.upstream = upstream
        self.script = list(script or [])
        self.seen: list[Seen] = []
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._server: asyncio.Server | None = None
        self._lock = threading.Lock()

    def then(self, *steps: Step) -> FlakyProxy:
        with self._lock:
            self.script.extend(steps)
        return self

    def _next(self) -> Step:
        with self._lock:
            return self.script.pop(0) if self.script else PASS

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._server = self._loop.run_until_complete(asyncio.start_server(self._serve, "127.0.0.1", self.port))
        self._ready.set()
        self._loop.run_forever()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            request = await self._read(reader)
            if request is None:
                return
            method, target, headers, body = request
            self.seen.append(Seen(method, target.split("?")[0], headers))
            step = self._next()
            if step.action == "drop":
                return
            if step.action == "stall":
                await asyncio.sleep(step.seconds)
                return
            if step.action == "status":
                payload = orjson.dumps(step.body)
                await self._write(writer, step.status, {"content-type": "application/json", **step.headers}, payload)
                return
            assert self.upstream is not None, "this proxy has no upstream to pass requests to"
            async with httpx.AsyncClient(base_url=self.upstream, timeout=30) as client:
                fwd = {k: v for k, v in headers.items() if k not in ("host", "content-length", "connection")}
                r = await client.request(method, target, headers=fwd, content=body)
            if step.action == "lost":
                return
            out = {k: v for k, v in r.headers.items() if k not in ("content-length", "connection",
                                                                   "transfer-encoding", "content-encoding")}
            await self._write(writer, r.status_code, out, r.content)
        finally:
            with contextlib.suppress(Exception):
                writer.close()
                await writer.wait_closed()

    @staticmethod
    async def _read(reader: asyncio.StreamReader) -> tuple[str, str, dict[str, str], bytes] | None:
        conn = h11.Connection(h11.SERVER)
        method = target = ""
        headers: dict[str, str] = {}
        body = b""
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                data = await reader.read(65536)
                if not data:
                    return None
                conn.receive_data(data)
            elif isinstance(event, h11.Request):
                method, target = event.method.decode(), event.target.decode()
                headers = {k.decode().lower(): v.decode() for k, v in event.headers}
            elif isinstance(event, h11.Data):
                body += bytes(event.data)
            elif isinstance(event, h11.EndOfMessage):
                return method, target, headers, body
            else:
                return None

    @staticmethod
    async def _write(writer: asyncio.StreamWriter, code: int, headers: dict[str, str], body: bytes) -> None:
        head = [f"HTTP/1.1 {code} X", f"content-length: {len(body)}", "connection: close"]
        head += [f"{k}: {v}" for k, v in headers.items()]
        writer.write(("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body)
        await writer.drain()

    def __enter__(self) -> FlakyProxy:
        self._thread.start()
        self._ready.wait(10)
        return self

    def __exit__(self, *exc: object) -> None:
        async def _close() -> None:
            if self._server is not None:
                self._server.close()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:  # stalled connections
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            if self._server is not None:
                await self._server.wait_closed()

        asyncio.run_coroutine_threadsafe(_close(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()


@contextlib.contextmanager
def flaky(upstream: str | None, *steps: Step) -> Iterator[FlakyProxy]:
    with FlakyProxy(upstream, list(steps)) as proxy:
        yield proxy
