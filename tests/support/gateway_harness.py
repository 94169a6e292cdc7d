"""Real processes for the gateway tests: fake OpenAI backends that misbehave on demand, and gateways
served by uvicorn on loopback (in a thread, so a test can hand them a route table and a fake clock)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import httpx
import pytest
import uvicorn

from tensora.gateway.proxy import Gateway
from tensora.gateway.routedoc import EndpointDoc, KeyDoc, OwnerDoc, RouteDocument
from tensora.gateway.routes import RouteTable, table_from_json
from tensora.keys import apikeys
from tests.support.services import free_port

FAKEBACKEND = str(Path(__file__).resolve().parent / "fakebackend.py")


class Backends:
    """Fake OpenAI servers by name, each a child process on its own port; ``api_keys``: name -> the key that
    one requires (in its environment, as vLLM's ``VLLM_API_KEY``)."""

    def __init__(self, names: list[str], api_keys: dict[str, str] | None = None) -> None:
        self.ports = {n: free_port() for n in names}
        keys = api_keys or {}
        env = {k: v for k, v in os.environ.items() if k != "VLLM_API_KEY"}
        self.procs = {n: subprocess.Popen([sys.executable, FAKEBACKEND, "--port", str(p),
                                           "--name", n, "--chunks", "8"],
                                          env=env | ({"VLLM_API_KEY": keys[n]} if n in keys else {}))
                      for n, p in self.ports.items()}
        deadline = time.monotonic() + 30
        for n, p in self.ports.items():
            while True:
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(f"http://127.0.0.1:{p}/_stats", timeout=1).status_code == 200:
                        break
                assert self.procs[n].poll() is None, f"fake backend {n} died"
                assert time.monotonic() < deadline, f"fake backend {n} did not start"
                time.sleep(0.05)

    def url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.ports[name]}/v1"

    def mode(self, name: str, mode: str, **knobs: Any) -> None:
        """``knobs``: ``headers`` (added to an ``http_*`` answer), ``error`` (the error object it carries),
        ``hold_s`` (``hold_reset``), ``times`` (completion requests in this mode before it is ``ok`` again)."""
        r = httpx.post(f"http://127.0.0.1:{self.ports[name]}/_mode", json={"mode": mode, **knobs}, timeout=5)
        assert r.status_code == 200

    def requests(self, name: str) -> int:
        return int(httpx.get(f"http://127.0.0.1:{self.ports[name]}/_stats", timeout=5).json()["requests"])

    def authorization(self, name: str) -> str | None:
        """The Authorization header of the last completion request it got (None: there was none)."""
        value: str | None = httpx.get(f"http://127.0.0.1:{self.ports[name]}/_stats", timeout=5).json()["authorization"]
        return value

    def traceparent(self, name: str) -> str | None:
        """The W3C traceparent header of the last completion request it got (None: there was none)."""
        value: str | None = httpx.get(f"http://127.0.0.1:{self.ports[name]}/_stats", timeout=5).json()["traceparent"]
        return value

    def headers(self, name: str) -> list[tuple[str, str]]:
        """Every header of the last completion request it got, as (name, value) in the order they came."""
        seen = httpx.get(f"http://127.0.0.1:{self.ports[name]}/_stats", timeout=5).json()["headers"]
        return [(str(k), str(v)) for k, v in seen]

    def probes(self, name: str) -> int:
        """How many GET /v1/models it got."""
        return int(httpx.get(f"http://127.0.0.1:{self.ports[name]}/_stats", timeout=5).json()["probes"])

    def reset(self) -> None:
        for n in self.ports:
            self.mode(n, "ok")

    def close(self) -> None:
        for p in self.procs.values():
            p.terminate()
        for p in self.procs.values():
            p.wait(10)


def backends_fixture(names: list[str], **kw: Any) -> Any:
    """A module's ``backends`` fixture: these fake backends started once for the module, stopped after it."""

    @pytest.fixture(scope="module")
    def backends() -> Iterator[Backends]:
        b = Backends(names, **kw)
        try:
            yield b
        finally:
            b.close()

    return backends


def replica(rid: str, url: str, cpu: bool = False, model: str = "/models/m", api_key: str | None = None
            ) -> dict[str, Any]:
    return {"id": rid, "url": url, "cls": "cpu-4c-16g" if cpu else "l40s-48gb", "cpu": cpu, "upstream_model": model,
            **({"api_key": api_key} if api_key else {})}


def make_table(endpoints: list[dict[str, Any]], keys: dict[str, tuple[str, list[str]]], region: str = "local",
               limits: dict[str, tuple[int | None, int | None]] | None = None,
               owners: dict[str, tuple[int, int]] | None = None) -> RouteTable:
    """``keys``: secret -> (owner, scopes); ``limits``: secret -> the key's (rpm, tpm); ``owners``: owner ->
    (rpm, tpm), as the control API's ``owners`` list gives them."""
    limits = limits or {}
    rows = [KeyDoc(id=f"key_{i}", digest=apikeys.digest(k), owner=o, scopes=s,
                   rpm=limits.get(k, (None, None))[0], tpm=limits.get(k, (None, None))[1])
            for i, (k, (o, s)) in enumerate(keys.items())]
    # each endpoint as a test names it, over these defaults: what it leaves out, a test does not look at
    eps = [cast(EndpointDoc, {"region": region, "model": "/models/m", "cpu_fallback": False, **e}) for e in endpoints]
    owner_rows = [OwnerDoc(owner=o, requests_per_minute=r, tokens_per_minute=t) for o, (r, t) in (owners or {}).items()]
    return table_from_json(RouteDocument(version=str(time.monotonic()), region=region, endpoints=eps, keys=rows,
                                         owners=owner_rows))


@contextlib.contextmanager
def serving(gw: Gateway) -> Iterator[str]:
    """Serve ``gw`` on a free loopback port; yields its base URL (ending in /v1)."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(gw, host="127.0.0.1", port=port, loop="uvloop", http="httptools",
                                           log_level="error", lifespan="on", access_log=False))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the gateway did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        server.should_exit = True
        thread.join(15)


def chat(stream: bool = False, **kw: Any) -> dict[str, Any]:
    return {"model": "my-llm", "messages": [{"role": "user", "content": "hello"}], "stream": stream, **kw}


def sse_payloads(text: str) -> list[str]:
    return [line[6:] for line in text.split("\n") if line.startswith("data: ")]


@contextlib.contextmanager
def serving_own(app: Any, limits: Any = None) -> Iterator[Any]:
    """Serve ``app`` with the gateway's own server (gateway/server.py, with ``limits``) on a free loopback
    port, in a thread with its own loop; yields the Server (``.port``, ``.conns``, ``.loop``)."""
    import asyncio

    from tensora.gateway.server import Server

    server = Server(app, "127.0.0.1", free_port(), limits=limits, grace_s=2)
    stop: list[asyncio.Event] = []
    loop = asyncio.new_event_loop()

    def run() -> None:
        asyncio.set_event_loop(loop)
        stop.append(asyncio.Event())
        loop.run_until_complete(server.serve(stop[0]))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while server.bound is None:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.02)
    try:
        yield server
    finally:
        loop.call_soon_threadsafe(stop[0].set)
        thread.join(15)
        loop.close()
