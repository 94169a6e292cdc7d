"""Metering keyed by the server, tried as a hostile tenant would: the real gateway (``gateway.app.build``, its
spool and sender) in front of a fake model server, sending usage to the real control API on SQLite and
PostgreSQL. The client's ``X-Request-Id`` is echoed and stored beside the record, never its key: repeating
it, guessing another request's, or a gateway resending a batch after a crash neither loses nor doubles a
request. Then a property: whatever ids a client sends, requests metered == requests answered."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import func, select

from tensora.api.auth import create_key
from tensora.gateway.app import GatewaySettings, build
from tensora.gateway.limits import MemoryLimiter
from tensora.gateway.metering import Meter
from tensora.gateway.proxy import Gateway, Options
from tensora.keys import apikeys
from tensora.store import routes as routes_repo
from tensora.store import usage as usage_repo
from tensora.store import workloads as workloads_repo
from tensora.store.db import Database
from tensora.store.tables import T
from tests.support import services
from tests.support.gateway_harness import Backends, backends_fixture, chat, make_table, replica, serving
from tests.support.stack import Stack, stack

pytestmark = pytest.mark.timeout(180)


backends = backends_fixture(["r1"])


class Plane:
    """The control API served, alice's and bob's inference keys, and one endpoint of each on the fake backend."""

    def __init__(self, st: Stack, url: str, keys: dict[str, str]) -> None:
        self.st, self.url, self.keys = st, url, keys

    def metered(self, owner: str) -> int:
        with self.st.services.db.read() as conn:
            return sum(r.requests for r in usage_repo.token_usage(conn, owner, 0, None))

    def records(self, owner: str) -> list[dict[str, Any]]:
        with self.st.services.db.read() as conn:
            return [dict(r) for r in conn.execute(select(T).where(T.c.owner == owner)).mappings()]


@pytest.fixture
def plane(db_url: str, tmp_path: Path, backends: Backends) -> Iterator[Plane]:
    st = stack(db_url, tmp_path / "api", run_controller=False)
    with st.services.db.write() as conn:
        keys = {o: create_key(conn, o, "app", ["inference"], st.clock.now())[0] for o in ("alice", "bob")}
    with services.serving(st.app) as live:
        ids = []
        for owner in ("alice", "bob"):
            tok = st.alice if owner == "alice" else st.bob
            r = httpx.post(f"{live.url}/v1/workloads", headers=st.headers(tok), timeout=10,
                           json={"kind": "endpoint", "name": "my-llm", "gpu_class": "cpu-1c-4g",
                                 "model_params": "1B"})
            assert r.status_code == 201, r.text
            ids.append(r.json()["id"])
        st.controller.run_once()
        st.controller.run_once()
        with st.services.db.write() as conn:
            for r in workloads_repo.replicas_of(conn, ids):
                workloads_repo.update_replica(conn, r.id, {"url": backends.url("r1")})
        try:
            yield Plane(st, live.url, keys)
        finally:
            st.services.db.dispose()


def gateway_of(plane: Plane, data: Path) -> Gateway:
    data.mkdir(parents=True, exist_ok=True)
    (data / "admin-key").write_text(plane.st.admin)
    return build(GatewaySettings(data_dir=data, control_url=plane.url, poll_s=0.05, usage_flush_s=0.05,
                                 startup_grace_s=0))


def wait_routes(gw_url: str, key: str) -> None:
    deadline = time.monotonic() + 15
    while httpx.get(f"{gw_url}/models", headers={"Authorization": f"Bearer {key}"}, timeout=5).json().get(
            "data") in (None, []):
        assert time.monotonic() < deadline, "the gateway never got its routes"
        time.sleep(0.05)


def ask(gw_url: str, key: str, rid: str | None = None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}", **({"X-Request-Id": rid} if rid is not None else {})}
    r = httpx.post(f"{gw_url}/chat/completions", json=chat(), headers=headers, timeout=30)
    assert r.status_code == 200, r.text
    return r


def settle(plane: Plane, want: dict[str, int]) -> None:
    """Wait until the usage of each owner reaches ``want``; then a moment more: nothing else may arrive."""
    deadline = time.monotonic() + 15
    while any(plane.metered(o) < n for o, n in want.items()) and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.3)
    assert {o: plane.metered(o) for o in want} == want


def test_the_same_request_id_sent_three_times_meters_three_requests(plane: Plane, tmp_path: Path) -> None:
    with serving(gateway_of(plane, tmp_path / "gw")) as gw:
        wait_routes(gw, plane.keys["alice"])
        echoed = [ask(gw, plane.keys["alice"], "order-42").headers["x-request-id"] for _ in range(3)]
        assert echoed == ["order-42"] * 3  # echoed as today
        settle(plane, {"alice": 3})
    recs = plane.records("alice")
    assert [r["client_request_id"] for r in recs] == ["order-42"] * 3
    assert len({r["id"] for r in recs}) == 3 and all(r["id"] != "order-42" for r in recs)


def test_guessing_or_reusing_another_tenants_request_id_erases_nothing(plane: Plane, tmp_path: Path) -> None:
    alice, bob = plane.keys["alice"], plane.keys["bob"]
    with serving(gateway_of(plane, tmp_path / "gw")) as gw:
        wait_routes(gw, alice)
        seen = ask(gw, alice).headers["x-request-id"]  # the gateway made this one
        settle(plane, {"alice": 1})
        ask(gw, bob, seen)  # bob reuses alice's id: free usage for bob if ids were the client's
        # ... and predicts alice's next one (as a counter after a per-process prefix would allow)
        head, _, tail = seen.rpartition("_")
        guesses = [f"{head}_{int(tail, 16) + i:x}" for i in range(1, 4)]
        for g in guesses:
            ask(gw, bob, g)
        for _ in range(3):
            ask(gw, alice)
        settle(plane, {"alice": 4, "bob": 4})
    assert all(len(r["id"]) >= 32 for r in plane.records("alice") + plane.records("bob"))


def test_a_batch_resent_after_a_crash_is_counted_once(plane: Plane, tmp_path: Path) -> None:
    """The control API took the batch, the answer was lost (the gateway died): the next gateway on the same
    spool sends it again, with the same ids."""
    posted: list[int] = []

    async def send_then_die(records: list[bytes]) -> bool:
        async with httpx.AsyncClient() as c:
            r = await c.post(f"{plane.url}/v1/gateway/usage", content=b'{"records":[' + b",".join(records) + b"]}",
                             headers={"Authorization": f"Bearer {plane.st.admin}", "Content-Type": "application/json"})
        posted.append(r.json()["new"])
        if len(posted) == 1:
            raise ConnectionResetError("the answer was lost")
        return r.status_code == 200

    spool = tmp_path / "spool"
    first = Meter(spool, send_then_die)
    gw = Gateway(Options(), lambda: table_for(plane), MemoryLimiter(), first)
    with serving(gw) as url:
        for _ in range(3):
            ask(url, plane.keys["alice"], "same")
    asyncio.run(first.flush())  # taken by the API, but the gateway never hears so: kept
    assert posted == [3] and first.batches()
    again = Meter(spool, send_then_die)  # the restarted gateway
    asyncio.run(again.flush())
    assert posted == [3, 0] and again.batches() == [] and again.sent == 3
    assert plane.metered("alice") == 3


def table_for(plane: Plane) -> Any:
    with plane.st.services.db.read() as conn:
        eps = routes_repo.serving_endpoints(conn, "local")
        reps = workloads_repo.replicas_of(conn, [e.id for e in eps])
    keys = {plane.keys["alice"]: ("alice", ["inference"])}
    return make_table([{"id": e.id, "name": e.name, "owner": e.owner,
                        "replicas": [replica(r.id, r.url) for r in reps if r.workload_id == e.id]}
                       for e in eps if e.owner == "alice"], keys)


# -- the property: in process, the gateway app and the fake backend ----------------------------------------

KEY = apikeys.generate()
RIDS = st.one_of(st.none(), st.text(max_size=80), st.sampled_from(["", "x" * 64, "x" * 65, "a b", "req_1", "same"]),
                 st.binary(max_size=100))


@pytest.fixture(scope="module")
def inproc(backends: Backends, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Gateway, Meter, Database]]:
    db = Database(str(tmp_path_factory.mktemp("db") / "t.db"))
    db.migrate()

    async def send(records: list[bytes]) -> bool:
        from tensora.api.schemas import UsageBatch

        batch = UsageBatch.model_validate({"records": [orjson.loads(x) for x in records]})
        rows = [r.model_dump() for r in batch.records]
        with db.write() as conn:
            usage_repo.insert_token_usage(conn, rows)
        return True

    meter = Meter(tmp_path_factory.mktemp("spool"), send)
    table = make_table([{"id": "wl_1", "name": "my-llm", "owner": "alice",
                         "replicas": [replica("r1", backends.url("r1"))]}], {KEY: ("alice", ["inference"])})
    gw = Gateway(Options(rpm=10**9, tpm=10**12), lambda: table, MemoryLimiter(), meter)
    try:
        yield gw, meter, db
    finally:
        meter.close()
        db.dispose()


async def call(gw: Gateway, rid: bytes | None) -> tuple[int, bytes | None]:
    body = httpx.Request("POST", "http://x", json=chat()).content
    headers = [(b"authorization", f"Bearer {KEY}".encode()), (b"content-type", b"application/json")]
    if rid is not None:
        headers.append((b"x-request-id", rid))
    scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions", "headers": headers,
             "query_string": b"", "client": ("127.0.0.1", 1)}
    sent: list[dict[str, Any]] = []
    fed = False

    async def receive() -> dict[str, Any]:
        nonlocal fed
        if fed:
            await asyncio.sleep(3600)
        fed = True
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(msg: dict[str, Any]) -> None:
        sent.append(msg)

    await gw(scope, receive, send)
    start = next(m for m in sent if m["type"] == "http.response.start")
    echoed = dict(start["headers"]).get(b"x-request-id")
    return start["status"], echoed


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rids=st.lists(RIDS, min_size=1, max_size=6))
def test_metered_requests_equal_requests_answered_whatever_the_client_ids(
        inproc: tuple[Gateway, Meter, Database], rids: list[str | bytes | None]) -> None:
    gw, meter, db = inproc
    with db.read() as conn:
        before = conn.execute(select(func.count()).select_from(T)).scalar_one()

    async def run() -> list[tuple[int, bytes | None]]:
        out = [await call(gw, r.encode("utf-8", "surrogatepass") if isinstance(r, str) else r) for r in rids]
        await meter.flush()
        gw.client.close()  # its connections belong to this event loop
        return out

    answers = asyncio.run(run())
    answered = sum(1 for status, _ in answers if status == 200)
    with db.read() as conn:
        rows = conn.execute(select(T.c.client_request_id).order_by(T.c.at)).scalars().all()
    assert len(rows) - before == answered == len(rids)
    echoed = sorted(e.decode() for _, e in answers if e is not None)
    assert sorted(rows[before:]) == echoed  # stored as it was echoed: the client's when sane, else the gateway's
