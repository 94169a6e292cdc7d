"""The control API under trouble, over real HTTP: PostgreSQL down and back, SQLite locked,
too many requests in flight, shutdown, oversize bodies. Each answer is quick and in the one
error shape; every 503 carries Retry-After; nothing is a 500; everything recovers."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import sqlite3
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest

from tensora import serve
from tensora.store import workloads as workloads_repo
from tensora.store.db import Database
from tests.support.services import LiveServer, PgCluster, serving
from tests.support.stack import Stack, stack

NB: dict[str, Any] = {"kind": "notebook", "name": "nb-1", "gpu_class": "l40s-48gb"}


def assert_503(r: httpx.Response) -> None:
    assert r.status_code == 503, (r.request.url.path, r.status_code, r.text)
    assert int(r.headers["Retry-After"]) >= 1, r.headers
    err = r.json()["error"]
    assert set(err) == {"type", "message", "field"} and err["type"] == "service_unavailable", err


def client(live: LiveServer, s: Stack, key: str | None = None) -> httpx.Client:
    return httpx.Client(base_url=live.url, headers=s.headers(key or s.alice), timeout=30)


def poll(call: Callable[[], httpx.Response], until: Callable[[httpx.Response], bool], deadline_s: float = 30,
         allowed: tuple[int, ...] = (503,)) -> httpx.Response:
    """Call until ``until(response)``; meanwhile only ``allowed`` statuses (503s with Retry-After)."""
    deadline = time.monotonic() + deadline_s
    while True:
        r = call()
        if until(r):
            return r
        assert r.status_code in allowed, (r.status_code, r.text)
        if r.status_code == 503:
            assert_503(r)
        assert time.monotonic() < deadline, f"still {r.status_code} after {deadline_s}s: {r.text}"
        time.sleep(0.1)


def workload_count(s: Stack) -> int:
    with s.services.db.read() as conn:
        return len(workloads_repo.list_workloads(conn, None, None, None, 1000, None))


@pytest.fixture
def make(tmp_path: Path) -> Iterator[Callable[..., Stack]]:
    """``make(db_url, **app_kw)``: a stack whose store is closed when the test ends, pass or fail."""
    made: list[Stack] = []

    def build(db_url: str, **kw: Any) -> Stack:
        made.append(stack(db_url, tmp_path, **kw))
        return made[-1]

    yield build
    for s in made:
        s.services.db.dispose()


@pytest.fixture
def busy_timeout(monkeypatch: pytest.MonkeyPatch) -> Callable[[int], None]:
    """Build the next stacks with this SQLite busy timeout (ms): serve.build opens Database(url)."""
    def set_timeout(ms: int) -> None:
        monkeypatch.setattr(serve, "Database", functools.partial(Database, busy_timeout_ms=ms))
    return set_timeout


@contextlib.contextmanager
def write_lock(db_url: str) -> Iterator[None]:
    """Block every write to the workloads table from another connection (reads still work)."""
    if "://" not in db_url:  # SQLite: take the database's write lock
        conn = sqlite3.connect(db_url, isolation_level=None)
        try:
            conn.execute("BEGIN IMMEDIATE")
            yield
            conn.execute("ROLLBACK")
        finally:
            conn.close()
    else:  # PostgreSQL: EXCLUSIVE blocks INSERT/UPDATE/DELETE, not SELECT
        with psycopg.connect(db_url) as pg:
            pg.execute("LOCK TABLE workloads IN EXCLUSIVE MODE")
            yield
            pg.rollback()


# -- PostgreSQL down and back -----------------------------------------------------------

@pytest.fixture(scope="module")
def own_pg() -> Iterator[PgCluster]:
    """A server of this module's own: the test stops it (the session's server is shared)."""
    try:
        cluster = PgCluster().start()
    except RuntimeError as exc:
        if os.environ.get("TENSORA_TEST_PG_URL"):
            pytest.skip(f"needs a local PostgreSQL to stop and start: {exc}")
        raise
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.mark.postgresql
@pytest.mark.timeout(120)  # an answer that waits on the store hangs: a failure, not a wait
def test_postgres_down_answers_503_quickly_and_recovers(own_pg: PgCluster, make: Callable[..., Stack]) -> None:
    s = make(own_pg.new_database())
    with serving(s.app) as live, client(live, s) as c:
        assert c.post("/v1/workloads", json={**NB, "gpu_class": "a100-80gb"}).status_code == 201
        assert c.get("/readyz").status_code == 200
        own_pg.pg_stop()
        try:
            down = {
                "create": c.post("/v1/workloads", json={**NB, "name": "nb-2"}),
                "create with a key": c.post("/v1/workloads", json={**NB, "name": "nb-3"},
                                             headers={"Idempotency-Key": "during-outage"}),
                "list": c.get("/v1/workloads"),
                "ready": c.get("/readyz"),
                "new key, uncached": c.get("/v1/workloads", headers=s.headers(s.bob)),
            }
            health = c.get("/healthz")
        finally:
            own_pg.pg_start()
        for name, r in down.items():
            assert r.status_code != 500, name
            assert_503(r)
        assert health.status_code == 200

        created = poll(lambda: c.post("/v1/workloads", json={**NB, "name": "nb-3"},
                                      headers={"Idempotency-Key": "during-outage"}),
                       lambda r: r.status_code == 201)
        assert created.headers.get("Idempotent-Replayed") is None, "a 503 must not be stored for replay"
        poll(lambda: c.get("/readyz"), lambda r: r.status_code == 200)
        assert c.get("/v1/workloads").status_code == 200
        wid = created.json()["id"]
        placed = poll(lambda: c.get(f"/v1/workloads/{wid}"), lambda r: r.json()["state"] != "queued",
                      deadline_s=20, allowed=(200,))
    assert placed.json()["placed_class"] is not None, "the controller must survive the outage and place it"
    assert workload_count(s) == 2


# -- SQLite locked ----------------------------------------------------------------------

@pytest.mark.timeout(60)  # a write that waits on the lock hangs: a failure, not a wait
def test_sqlite_locked_writes_answer_503(tmp_path: Path, make: Callable[..., Stack],
                                         busy_timeout: Callable[[int], None]) -> None:
    busy_timeout(200)
    path = str(tmp_path / "t.db")
    s = make(path, run_controller=False)
    with serving(s.app) as live, client(live, s) as c:
        with write_lock(path):
            plain = c.post("/v1/workloads", json=NB)
            keyed = c.post("/v1/workloads", json=NB, headers={"Idempotency-Key": "locked"})
            listed = c.get("/v1/workloads")  # WAL: reads do not wait for the writer
        after = c.post("/v1/workloads", json=NB, headers={"Idempotency-Key": "locked"})
    assert_503(plain)
    assert_503(keyed)
    assert listed.status_code == 200 and listed.json()["data"] == []
    assert after.status_code == 201 and after.headers.get("Idempotent-Replayed") is None
    assert workload_count(s) == 1


# -- in-flight bound --------------------------------------------------------------------

IN_FLIGHT = 3


def test_in_flight_bound_answers_503_at_once(db_url: str, make: Callable[..., Stack],
                                             busy_timeout: Callable[[int], None]) -> None:
    busy_timeout(30_000)  # SQLite: the blocked writers wait for the lock, not fail
    s = make(db_url, run_controller=False, max_in_flight=IN_FLIGHT)
    guard = s.app
    with serving(s.app) as live, client(live, s) as c, ThreadPoolExecutor(IN_FLIGHT) as pool:
        with write_lock(db_url):
            blocked = [pool.submit(c.post, "/v1/workloads", json={**NB, "name": f"nb-{i}"})
                       for i in range(IN_FLIGHT)]
            deadline = time.monotonic() + 10
            while guard.in_flight < IN_FLIGHT:
                assert time.monotonic() < deadline, f"only {guard.in_flight} requests got in"
                time.sleep(0.01)
            refused = [c.get("/v1/workloads"), c.post("/v1/workloads", json=NB), c.get("/readyz")]
            health = c.get("/healthz")
            still_blocked = [not f.done() for f in blocked]  # the lock is held until after this line
        done = [f.result(timeout=20) for f in blocked]
        afterwards = c.get("/v1/workloads")
    for r in refused:
        assert_503(r)
        assert "in flight" in r.json()["error"]["message"]
    assert health.status_code == 200, "/healthz is exempt from the bound"
    # answered while every held request still waited on the lock: at once, not queued behind them
    assert all(still_blocked), "the held requests must still be waiting on the lock"
    assert [r.status_code for r in done] == [201] * IN_FLIGHT
    assert afterwards.status_code == 200 and len(afterwards.json()["data"]) == IN_FLIGHT
    assert guard.in_flight == 0


# -- draining ---------------------------------------------------------------------------

def test_draining_answers_503(tmp_path: Path, make: Callable[..., Stack]) -> None:
    """The flag the lifespan sets on shutdown, set by hand on a live server."""
    s = make(str(tmp_path / "t.db"))
    with serving(s.app) as live, client(live, s) as c:
        s.app.draining = True
        refused = [c.get("/v1/workloads"), c.post("/v1/workloads", json=NB), c.get("/readyz")]
        health = c.get("/healthz")
        s.app.draining = False
        back = c.get("/v1/workloads")
    for r in refused:
        assert_503(r)
        assert "shutting down" in r.json()["error"]["message"]
    assert health.status_code == 200
    assert back.status_code == 200
    assert workload_count(s) == 0


def test_real_shutdown_finishes_in_flight_requests_then_drains(tmp_path: Path, make: Callable[..., Stack],
                                                               busy_timeout: Callable[[int], None]) -> None:
    """Through uvicorn's real shutdown: new connections are refused at once, a request in
    flight still completes, and only then does the lifespan set ``draining`` (so the 503 is
    what the app answers to anything that still reaches it, checked in-process)."""
    busy_timeout(30_000)
    path = str(tmp_path / "t.db")
    s = make(path)
    with serving(s.app) as live, client(live, s) as c, ThreadPoolExecutor(1) as pool:
        with write_lock(path):
            pending = pool.submit(c.post, "/v1/workloads", json=NB)
            deadline = time.monotonic() + 10
            while s.app.in_flight < 1:
                assert time.monotonic() < deadline
                time.sleep(0.01)
            live.server.should_exit = True
            deadline = time.monotonic() + 10
            while True:
                try:
                    httpx.get(live.url + "/healthz", timeout=1)
                except httpx.TransportError:
                    break
                assert time.monotonic() < deadline, "the server kept accepting connections"
                time.sleep(0.02)
            draining_while_in_flight = s.app.draining
        finished = pending.result(timeout=20)
        live.thread.join(timeout=15)
        assert not live.thread.is_alive()
    assert finished.status_code == 201, finished.text
    assert not draining_while_in_flight, "the lifespan runs only after in-flight requests finish"
    assert s.app.draining

    async def after_shutdown() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=s.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://tensora", headers=s.headers(s.alice)) as ac:
            return [await ac.get("/v1/workloads"), await ac.get("/healthz")]

    import asyncio

    refused, health = asyncio.run(after_shutdown())
    assert_503(refused)
    assert refused.headers["Retry-After"] == "2"
    assert health.status_code == 200


# -- oversize bodies --------------------------------------------------------------------

LIMIT = 4096


def _body(pad: int, name: str = NB["name"]) -> bytes:
    """A create body padded with JSON whitespace (every spec key is checked: no free-form room in it)."""
    return (json.dumps({**NB, "name": name}) + " " * pad).encode()


def _chunks(data: bytes, size: int = 512) -> Iterator[bytes]:
    for i in range(0, len(data), size):
        yield data[i:i + size]


def test_oversize_bodies_are_refused(tmp_path: Path, make: Callable[..., Stack]) -> None:
    s = make(str(tmp_path / "t.db"), run_controller=False, max_body_bytes=LIMIT)
    json_type = {"content-type": "application/json"}
    big, small, other = _body(LIMIT + 100), _body(100), _body(100, "other")
    with serving(s.app) as live, client(live, s) as c:
        declared = c.post("/v1/workloads", content=big, headers=json_type)
        chunked = c.post("/v1/workloads", content=_chunks(big), headers=json_type)
        chunked_small = c.post("/v1/workloads", content=_chunks(small), headers=json_type)
        declared_small = c.post("/v1/workloads", content=other, headers=json_type)
    assert "content-length" not in chunked.request.headers
    assert chunked.request.headers["transfer-encoding"] == "chunked"
    for r in (declared, chunked):
        assert r.status_code == 413, r.text
        assert r.json()["error"]["type"] == "payload_too_large"
        assert str(LIMIT) in r.json()["error"]["message"]
    assert chunked_small.status_code == 201, chunked_small.text
    assert chunked_small.json()["name"] == NB["name"]
    assert declared_small.status_code == 201
    assert workload_count(s) == 2
