"""Per-owner rates of the control API's costly calls, over real HTTP on SQLite and PostgreSQL, as a churning
tenant tries them: workload creates (and restarts), deletes and file uploads past the owner's limit are 429 with
Retry-After and write nothing, while another owner goes on; an admin overrides the limits per owner; and the
count is the store's, so a second API process (or a restarted one) on the same database sees it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import text

from tensora.config.quotas import Limits
from tensora.control.housekeeping import housekeep
from tensora.store import rates as rates_repo
from tensora.store.db import Database
from tests.support import services
from tests.support.api import Api, assert_error, created
from tests.support.api import api as api  # the fixture, imported under its name
from tests.support.stack import stack

NB: dict[str, Any] = {"kind": "notebook", "name": "nb", "gpu_class": "cpu-1c-4g"}


def workload_rows(api: Api, owner: str) -> int:
    with api.stack.services.db.read() as conn:
        return int(conn.execute(text("SELECT count(*) FROM workloads WHERE owner = :o"), {"o": owner}).scalar_one())


def limit(api: Api, owner: str, **limits: int) -> None:
    r = api.as_(api.stack.admin).put(f"/v1/owners/{owner}", json={"limits": limits})
    assert r.status_code == 200, r.text


def assert_rate_limited(r: httpx.Response, field: str, retry_after: int) -> None:
    err = assert_error(r, 429)
    assert err["type"] == "rate_limited" and f"limits.{field}" in err["message"], err
    assert r.headers["Retry-After"] == str(retry_after)


def test_the_121st_create_and_delete_in_a_minute_are_429_while_another_owner_goes_on(api: Api) -> None:
    alice, bob = api.as_(api.stack.alice), api.as_(api.stack.bob)
    assert (Limits().creates_per_minute, Limits().deletes_per_minute) == (120, 120)
    first = created(alice, **NB)["id"]
    for i in range(119):  # churn: create and delete, all in the same (fake) second
        wid = created(alice, **{**NB, "name": f"nb-{i}"})["id"]
        assert alice.delete(f"/v1/workloads/{wid}").status_code == 204
    assert alice.delete(f"/v1/workloads/{first}").status_code == 204  # the 120th delete
    rows = workload_rows(api, "alice")
    assert_rate_limited(alice.post("/v1/workloads", json={**NB, "name": "one-more"}), "creates_per_minute", 60)
    assert_rate_limited(alice.delete(f"/v1/workloads/{first}"), "deletes_per_minute", 60)
    assert workload_rows(api, "alice") == rows  # nothing written
    assert bob.post("/v1/workloads", json=NB).status_code == 201  # another owner is not slowed
    api.stack.clock.advance(30)
    assert_rate_limited(alice.post("/v1/workloads", json=NB), "creates_per_minute", 30)
    api.stack.clock.advance(30)  # the first calls left the window
    assert alice.post("/v1/workloads", json=NB).status_code == 201


def test_an_admin_sets_an_owners_rates_and_restarts_count_as_creates(api: Api) -> None:
    alice, bob = api.as_(api.stack.alice), api.as_(api.stack.bob)
    limit(api, "alice", creates_per_minute=2, deletes_per_minute=1)
    o = alice.get("/v1/owners/alice").json()
    assert (o["limits"]["creates_per_minute"], o["limits"]["deletes_per_minute"]) == (2, 1)
    assert "limits.creates_per_minute" in o["overridden"]
    wid = created(alice, **NB)["id"]
    assert alice.post(f"/v1/workloads/{wid}/restart").status_code in (200, 409)  # the second create-like call
    assert_rate_limited(alice.post(f"/v1/workloads/{wid}/restart"), "creates_per_minute", 60)
    assert_rate_limited(alice.post("/v1/workloads", json={**NB, "name": "nb2"}), "creates_per_minute", 60)
    assert alice.delete(f"/v1/workloads/{wid}").status_code == 204
    assert_rate_limited(alice.delete(f"/v1/workloads/{wid}"), "deletes_per_minute", 60)
    for i in range(3):  # bob keeps the defaults
        assert bob.post("/v1/workloads", json={**NB, "name": f"nb-{i}"}).status_code == 201
    limit(api, "alice", creates_per_minute=None)  # type: ignore[arg-type]  # back to the default
    assert alice.post("/v1/workloads", json={**NB, "name": "nb3"}).status_code == 201


def test_uploads_past_the_rate_are_429_and_leave_nothing_on_disk(api: Api) -> None:
    alice = api.as_(api.stack.alice)
    assert Limits().uploads_per_minute == 300
    limit(api, "alice", uploads_per_minute=3)
    for i in range(3):
        assert alice.put(f"/v1/files/f{i}.bin", content=b"x").status_code == 201
    assert_rate_limited(alice.put("/v1/files/f3.bin", content=b"y" * 1000), "uploads_per_minute", 60)
    assert [f["path"] for f in alice.get("/v1/files").json()["data"]] == ["f0.bin", "f1.bin", "f2.bin"]
    storage = api.stack.services.storage
    assert sorted(p.name for p in storage.dir_of("alice").iterdir()) == ["f0.bin", "f1.bin", "f2.bin"]


@pytest.fixture
def second(api: Api, db_url: str, tmp_path: Path) -> Iterator[Api]:
    """Another API process's app on the same database (or the same one restarted): nothing in memory shared."""
    s = stack(db_url, tmp_path / "second", run_controller=False)
    with services.serving(s.app) as live:
        a = Api(s, live.url, tmp_path / "second")
        try:
            yield a
        finally:
            a.close()


def test_the_count_holds_across_api_processes(api: Api, second: Api) -> None:
    limit(api, "alice", creates_per_minute=3)
    one, two = api.as_(api.stack.alice), second.as_(second.stack.alice)
    assert one.post("/v1/workloads", json={**NB, "name": "a"}).status_code == 201
    assert two.post("/v1/workloads", json={**NB, "name": "b"}).status_code == 201
    assert one.post("/v1/workloads", json={**NB, "name": "c"}).status_code == 201
    assert_rate_limited(two.post("/v1/workloads", json={**NB, "name": "d"}), "creates_per_minute", 60)
    assert_rate_limited(one.post("/v1/workloads", json={**NB, "name": "d"}), "creates_per_minute", 60)


def test_housekeeping_forgets_calls_past_the_window(db: Database) -> None:
    with db.write() as conn:
        for owner, at in (("alice", 0.0), ("alice", 30.0), ("bob", 59.0)):
            assert rates_repo.take_call(conn, owner, "create", at, 10, 60.0) is None
        assert rates_repo.take_call(conn, "alice", "create", 61.0, 1, 60.0) == 29.0  # prunes the first: 1 left
        assert rates_repo.take_call(conn, "alice", "create", 61.0, 3, 60.0) is None
        housekeep(conn, cycle=1, now=100.0, region="local", released=[])
        left = conn.execute(text("SELECT owner, at FROM owner_calls ORDER BY at")).all()
    assert [tuple(r) for r in left] == [("bob", 59.0), ("alice", 61.0)]


def test_a_retry_with_the_same_idempotency_key_is_replayed_not_counted(api: Api) -> None:
    alice = api.as_(api.stack.alice)
    limit(api, "alice", creates_per_minute=1)
    first = alice.post("/v1/workloads", json=NB, headers={"Idempotency-Key": "k1"})
    assert first.status_code == 201
    again = alice.post("/v1/workloads", json=NB, headers={"Idempotency-Key": "k1"})
    assert (again.status_code, again.content) == (201, first.content)  # the first answer, past the limit too
    assert_rate_limited(alice.post("/v1/workloads", json=NB, headers={"Idempotency-Key": "k2"}),
                        "creates_per_minute", 60)
