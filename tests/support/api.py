"""The control API served over real HTTP for a test: ``api`` (a fixture: a stack on ``db_url``, its controller
driven by hand), and what its tests share (a real safetensors model, a created workload, a workload settled
in a state, the one error shape)."""

from __future__ import annotations

import contextlib
import datetime as dt
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from safetensors.numpy import save_file
from sqlalchemy import text

from tests.support import services
from tests.support.stack import Stack, stack

WRITTEN_TABLES = ("workloads", "events", "replicas", "usage_segments", "idempotency_records")


@dataclass
class Api:
    """A stack served over HTTP. ``as_(key)``: a client sending that key; ``cycle()``: one
    controller cycle (the server runs no controller thread of its own)."""

    stack: Stack
    url: str
    tmp: Path
    _clients: list[httpx.Client] = field(default_factory=list)

    def as_(self, key: str | None) -> httpx.Client:
        headers = self.stack.headers(key) if key is not None else {}
        client = httpx.Client(base_url=self.url, headers=headers, timeout=10)
        self._clients.append(client)
        return client

    def cycle(self, n: int = 1) -> None:
        for _ in range(n):
            self.stack.controller.run_once()

    def rows(self) -> dict[str, int]:
        with self.stack.services.db.read() as conn:
            return {t: int(conn.execute(text(f"SELECT count(*) FROM {t}")).scalar_one()) for t in WRITTEN_TABLES}

    def close(self) -> None:
        for c in self._clients:
            c.close()
        self.stack.services.db.dispose()


@contextlib.contextmanager
def serving_api(db_url: str, tmp: Path) -> Iterator[Api]:
    """A stack on the store at ``db_url`` served over HTTP, its controller driven by hand; closed after."""
    s = stack(db_url, tmp, run_controller=False)
    with services.serving(s.app) as live:
        a = Api(s, live.url, tmp)
        try:
            yield a
        finally:
            a.close()


@pytest.fixture
def api(db_url: str, tmp_path: Path) -> Iterator[Api]:
    with serving_api(db_url, tmp_path) as a:
        yield a


def tiny_model(where: Path, name: str = "tiny.safetensors") -> tuple[Path, int]:
    """A real safetensors file; returns its path and its parameter count."""
    tensors: dict[str, np.ndarray[Any, Any]] = {"embed": np.zeros((8, 4), dtype=np.float16),
                                                "head": np.ones((4,), dtype=np.float32)}
    path = where / name
    save_file(tensors, str(path))
    return path, sum(int(t.size) for t in tensors.values())


def own_model(api: Api, client: httpx.Client, name: str = "tiny.safetensors") -> tuple[str, int]:
    """A real safetensors file uploaded to the client's files as ``name``: returns the name (what
    ``model`` takes) and its parameter count."""
    path, params = tiny_model(api.tmp, "upload-" + name.replace("/", "-"))
    r = client.put(f"/v1/files/{name}", content=path.read_bytes())
    assert r.status_code in (200, 201), r.text
    return name, params


def iso(ts: float) -> str:
    return dt.datetime.fromtimestamp(ts, dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def created(client: httpx.Client, **body: Any) -> dict[str, Any]:
    r = client.post("/v1/workloads", json=body)
    assert r.status_code == 201, r.text
    out: dict[str, Any] = r.json()
    return out


def settle(api: Api, client: httpx.Client, wid: str, state: str, cycles: int = 6) -> dict[str, Any]:
    """Run controller cycles until the workload reads back in ``state`` (bounded)."""
    for _ in range(cycles):
        w: dict[str, Any] = client.get(f"/v1/workloads/{wid}").json()
        if w["state"] == state:
            return w
        api.cycle()
    w = client.get(f"/v1/workloads/{wid}").json()
    assert w["state"] == state, w
    return w


def assert_error(r: httpx.Response, status: int, field: str | None = None) -> dict[str, Any]:
    """The one error shape; returns the error object."""
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"type", "message", "field"}, body
    err: dict[str, Any] = body["error"]
    assert isinstance(err["type"], str) and err["type"]
    assert isinstance(err["message"], str) and err["message"]
    assert err["field"] == field, err
    return err
