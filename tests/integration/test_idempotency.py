"""Idempotency-Key over real HTTP, on SQLite and PostgreSQL: concurrent duplicates make one
workload, replays are byte-identical, keys are scoped by calling key and path, failures are not
stored, a key creation's record keeps no secret, and records expire (in-flight claims after 60 s,
responses after 24 h) on a fake clock."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from sqlalchemy import text

from tensora.api.idempotency import IN_FLIGHT_S, KEEP_S, MAX_KEY_LEN, fingerprint
from tensora.control import workloads
from tensora.control.spec import parse_spec
from tensora.keys import apikeys
from tensora.store import idempotency as idempotency_repo
from tensora.store import keys as keys_repo
from tensora.store import workloads as workloads_repo
from tensora.store.idempotency import IdempotencyRow
from tensora.store.rows import WorkloadRecord
from tests.support.services import LiveServer, serving
from tests.support.stack import Stack, stack

NB: dict[str, Any] = {"kind": "notebook", "name": "nb-1", "gpu_class": "l40s-48gb"}
REPLAYED = "Idempotent-Replayed"


@dataclass
class Live:
    stack: Stack
    server: LiveServer

    def client(self, key: str) -> httpx.Client:
        return httpx.Client(base_url=self.server.url, headers=self.stack.headers(key), timeout=10)

    def workloads(self, owner: str | None = None) -> list[WorkloadRecord]:
        with self.stack.services.db.read() as conn:
            return list(workloads_repo.list_workloads(conn, owner, None, None, 1000, None))


@pytest.fixture
def live(db_url: str, tmp_path: Any) -> Iterator[Live]:
    """A served stack whose controller runs in the background (as in production)."""
    s = stack(db_url, tmp_path)
    with serving(s.app) as server:
        yield Live(s, server)
    s.services.db.dispose()


@pytest.fixture
def manual(db_url: str, tmp_path: Any) -> Iterator[Live]:
    """A served stack whose controller runs only when the test calls ``run_once``."""
    s = stack(db_url, tmp_path, run_controller=False)
    with serving(s.app) as server:
        yield Live(s, server)
    s.services.db.dispose()


def key_id(secret: str, live: Live) -> str:
    with live.stack.services.db.read() as conn:
        row = keys_repo.key_by_digest(conn, apikeys.digest(secret))
    assert row is not None
    return str(row.id)


def idem(key: str) -> dict[str, str]:
    return {"Idempotency-Key": key}


def replayed(r: httpx.Response) -> bool:
    return bool(r.headers.get(REPLAYED) == "true")


def assert_error(r: httpx.Response, status: int, field: str | None = None) -> dict[str, Any]:
    assert r.status_code == status, r.text
    err: dict[str, Any] = r.json()["error"]
    assert set(err) == {"type", "message", "field"}
    if field is not None:
        assert err["field"] == field, err
    if status == 503:
        assert int(r.headers["Retry-After"]) >= 1
    return err


# -- concurrent duplicates --------------------------------------------------------------

CALLERS = 100
MAX_RETRIES = 40


async def _post_until_final(client: httpx.AsyncClient, key: str, body: dict[str, Any]) -> tuple[httpx.Response, int]:
    """POST, retrying 409 (in flight) and 503 as the server asks; (final response, retries)."""
    for attempt in range(MAX_RETRIES + 1):
        r = await client.post("/v1/workloads", json=body, headers=idem(key))
        if r.status_code not in (409, 503):
            return r, attempt
        assert "Retry-After" in r.headers, (r.status_code, r.headers)
        if r.status_code == 409:
            assert r.headers["x-should-retry"] == "true"
        wait_ms = r.headers.get("retry-after-ms")
        await asyncio.sleep(int(wait_ms) / 1000 if wait_ms else float(r.headers["Retry-After"]))
    raise AssertionError(f"still {r.status_code} after {MAX_RETRIES} retries: {r.text}")


async def _duplicates(url: str, headers: dict[str, str], key: str) -> list[tuple[httpx.Response, int]]:
    limits = httpx.Limits(max_connections=50, max_keepalive_connections=50)
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=20, limits=limits) as client:
        return await asyncio.gather(*(_post_until_final(client, key, NB) for _ in range(CALLERS)))


def test_concurrent_duplicates_create_one_workload(live: Live, monkeypatch: pytest.MonkeyPatch) -> None:
    real_create, first = workloads.create, threading.Event()

    def slow_first_create(*args: Any, **kw: Any) -> dict[str, Any]:
        """The first request works for a while, so the duplicates arrive while it is in flight."""
        if not first.is_set():
            first.set()
            time.sleep(0.3)
        return real_create(*args, **kw)

    monkeypatch.setattr(workloads, "create", slow_first_create)
    results = asyncio.run(_duplicates(live.server.url, live.stack.headers(live.stack.alice), "dup-1"))

    statuses = {r.status_code for r, _ in results}
    bodies = {r.content for r, _ in results}
    assert statuses == {201}
    assert len(bodies) == 1, "every caller must see the byte-identical first response"
    fresh = [r for r, _ in results if not replayed(r)]
    assert len(fresh) == 1, f"{len(fresh)} responses ran the request instead of replaying it"
    rows = live.workloads("alice")
    assert len(rows) == 1
    assert rows[0].id == fresh[0].json()["id"]
    if not live.stack.services.db.is_sqlite:
        # PostgreSQL reads the in-flight record while the first request works: callers waited on 409s.
        # (SQLite's write lock queues them behind the first request instead: they see it done.)
        assert sum(retries for _, retries in results) > 0


# -- keys, bodies, paths and owners -----------------------------------------------------

def test_same_key_with_another_body_is_refused(live: Live) -> None:
    with live.client(live.stack.alice) as c:
        first = c.post("/v1/workloads", json=NB, headers=idem("k-body"))
        other = c.post("/v1/workloads", json={**NB, "name": "nb-2"}, headers=idem("k-body"))
        reordered = c.post("/v1/workloads", json=dict(reversed(NB.items())), headers=idem("k-body"))
    assert first.status_code == 201
    err = assert_error(other, 422, field="Idempotency-Key")
    assert "different request body" in err["message"]
    assert reordered.status_code == 201 and replayed(reordered), "the same body in another key order replays"
    assert reordered.content == first.content
    assert len(live.workloads("alice")) == 1


def test_key_is_scoped_by_path_and_calling_key(live: Live) -> None:
    s = live.stack
    with live.client(s.alice) as alice, live.client(s.bob) as bob:
        a = alice.post("/v1/workloads", json=NB, headers=idem("shared"))
        b = bob.post("/v1/workloads", json=NB, headers=idem("shared"))
        k = alice.post("/v1/keys", json={"name": "ci", "scopes": ["workloads:read"]}, headers=idem("shared"))
    assert (a.status_code, b.status_code, k.status_code) == (201, 201, 201)
    assert not any(replayed(r) for r in (a, b, k))
    assert a.json()["owner"] == "alice" and b.json()["owner"] == "bob"
    assert a.json()["id"] != b.json()["id"]
    assert k.json()["key"].startswith("tsk_")
    assert [w.id for w in live.workloads("alice")] == [a.json()["id"]]
    assert [w.id for w in live.workloads("bob")] == [b.json()["id"]]


def test_replay_returns_the_first_response_after_the_workload_changed(live: Live) -> None:
    with live.client(live.stack.alice) as c:
        first = c.post("/v1/workloads", json=NB, headers=idem("k-state"))
        assert first.status_code == 201 and first.json()["state"] == "queued"
        wid = first.json()["id"]
        deadline = time.monotonic() + 10
        while (now := c.get(f"/v1/workloads/{wid}").json())["state"] == "queued":
            assert time.monotonic() < deadline, "the controller never placed the workload"
            time.sleep(0.02)
        again = c.post("/v1/workloads", json=NB, headers=idem("k-state"))
    assert now["state"] in ("starting", "running")
    assert again.status_code == 201 and replayed(again)
    assert again.content == first.content
    assert again.json()["state"] == "queued"


def test_a_validation_failure_is_not_stored(live: Live) -> None:
    with live.client(live.stack.alice) as c:
        unknown = c.post("/v1/workloads", json={**NB, "gpu_class": "no-such-class"}, headers=idem("k-fix"))
        malformed = c.post("/v1/workloads", json={**NB, "name": "Not A Name"}, headers=idem("k-fix"))
        fixed = c.post("/v1/workloads", json=NB, headers=idem("k-fix"))
    assert_error(unknown, 422, field="gpu_class")
    assert_error(malformed, 422, field="name")
    assert fixed.status_code == 201 and not replayed(fixed)
    assert len(live.workloads("alice")) == 1


BAD_KEYS = {
    "empty": "",
    "one past the limit": "k" * (MAX_KEY_LEN + 1),
    "a control character": "a\tb",
}


def test_malformed_keys_are_refused(live: Live) -> None:
    with live.client(live.stack.alice) as c:
        longest = c.post("/v1/workloads", json=NB, headers=idem("k" * MAX_KEY_LEN))
        answers = {name: c.post("/v1/workloads", json={**NB, "name": "nb-2"}, headers=idem(key))
                   for name, key in BAD_KEYS.items()}
    assert longest.status_code == 201, "a key of exactly the limit is fine"
    for name, r in answers.items():
        assert r.status_code == 422, (name, r.text)
        assert r.json()["error"]["field"] == "Idempotency-Key", name
    assert len(live.workloads("alice")) == 1


def test_without_a_key_each_post_creates(live: Live) -> None:
    with live.client(live.stack.alice) as c:
        one, two = (c.post("/v1/workloads", json={**NB, "name": f"nb-{i}"}) for i in range(2))
        again = c.post("/v1/workloads", json={**NB, "name": "nb-0"})
    assert (one.status_code, two.status_code) == (201, 201)
    assert one.json()["id"] != two.json()["id"]
    assert not replayed(one) and not replayed(two)
    assert again.status_code == 409 and again.json()["error"]["type"] == "name_taken"  # no second 'nb-0' either
    assert len(live.workloads("alice")) == 2


def test_stop_and_restart_replay(manual: Live) -> None:
    s = manual.stack
    with manual.client(s.alice) as c:
        wid = c.post("/v1/workloads", json=NB).json()["id"]
        s.controller.run_once()
        s.controller.run_once()
        assert c.get(f"/v1/workloads/{wid}").json()["state"] == "running"
        restarts = [c.post(f"/v1/workloads/{wid}/restart", json={"placement": "requested"}, headers=idem("r1"))
                    for _ in range(2)]
        s.controller.run_once()
        stops = [c.post(f"/v1/workloads/{wid}/stop", headers=idem("s1")) for _ in range(2)]
        events = c.get(f"/v1/workloads/{wid}/events").json()["data"]
    for first, again in (restarts, stops):
        assert first.status_code == again.status_code == 200
        assert not replayed(first) and replayed(again)
        assert again.content == first.content
    assert restarts[0].json()["state"] == "queued"
    assert stops[0].json()["state"] in ("stopping", "stopped")
    reasons = [e["reason"] for e in events]
    assert sum("restart requested" in r for r in reasons) == 1, reasons
    assert sum(r.startswith(("stopping: stop requested", "stopped: stop requested")) for r in reasons) == 1, reasons


def test_a_retryable_conflict_is_not_stored(manual: Live) -> None:
    """409 with Retry-After says "retry": a retry with the same key must run afresh, not replay the 409."""
    s = manual.stack
    with manual.client(s.alice) as c:
        wid = c.post("/v1/workloads", json=NB).json()["id"]
        s.controller.run_once()
        s.controller.run_once()
        assert c.post(f"/v1/workloads/{wid}/stop").json()["state"] == "stopping"
        busy = c.post(f"/v1/workloads/{wid}/restart", json={}, headers=idem("r-busy"))
        for _ in range(3):
            s.controller.run_once()
        assert c.get(f"/v1/workloads/{wid}").json()["state"] == "stopped"
        retried = c.post(f"/v1/workloads/{wid}/restart", json={}, headers=idem("r-busy"))
    assert_error(busy, 409)
    assert "Retry-After" in busy.headers
    assert retried.status_code == 200 and not replayed(retried), retried.text
    assert retried.json()["state"] == "queued"


def test_a_final_error_is_stored_and_replayed(live: Live) -> None:
    """A 404 is the answer for this key (no Retry-After): it replays like a success does."""
    with live.client(live.stack.alice) as c:
        first, again = (c.post("/v1/workloads/wl_missing/stop", headers=idem("k-404")) for _ in range(2))
    assert_error(first, 404)
    assert again.status_code == 404 and replayed(again) and again.content == first.content


def test_a_replayed_key_creation_says_the_key_exists_but_never_its_secret(live: Live) -> None:
    with live.client(live.stack.alice) as c:
        before = len(c.get("/v1/keys").json()["data"])
        body = {"name": "ci", "scopes": ["workloads:read"]}
        first, again = (c.post("/v1/keys", json=body, headers=idem("k-key")) for _ in range(2))
        after = c.get("/v1/keys").json()["data"]
    assert first.status_code == again.status_code == 201
    assert replayed(again) and not replayed(first)
    secret = first.json()["key"]
    assert apikeys.well_formed(secret) and first.json()["secret_withheld"] is False
    assert again.json() == {**first.json(), "key": None, "secret_withheld": True}
    assert secret not in again.text
    assert len(after) == before + 1
    assert [k["id"] for k in after if k["name"] == "ci"] == [first.json()["id"]]


def test_the_idempotency_store_holds_no_secret(live: Live) -> None:
    """What is left in the database after keys are made with Idempotency-Keys: no secret in any row, in
    any column, also when the same key was replayed or raced."""
    secrets = []
    with live.client(live.stack.alice) as c:
        for n in range(3):
            for _ in range(2):
                r = c.post("/v1/keys", json={"name": f"k{n}"}, headers=idem(f"secret-{n}"))
                assert r.status_code == 201, r.text
                secrets.append(r.json()["key"])
    made = [s for s in secrets if s is not None]
    assert len(made) == 3  # one secret per create, none in its replay
    with live.stack.services.db.read() as conn:
        rows = [dict(r) for r in conn.execute(text("SELECT * FROM idempotency_records")).mappings()]
    assert len(rows) == 3 and {r["path"] for r in rows} == {"/v1/keys"}
    dump = repr(rows)
    for secret in made:
        assert secret not in dump
        assert secret[4:] not in dump  # not even without its prefix


def test_another_key_of_the_owner_cannot_replay_a_key_creation(live: Live) -> None:
    """A weak key of alice's (keys:write only) sends the Idempotency-Key her full key used: it gets no
    secret and no sight of the first response; it runs its own request (which grants only what it holds)."""
    body = {"name": "deploy"}
    with live.client(live.stack.alice) as alice:
        weak_secret = alice.post("/v1/keys", json={"name": "weak", "scopes": ["keys:write"]}).json()["key"]
        first = alice.post("/v1/keys", json=body, headers=idem("deploy-1"))
    with live.client(weak_secret) as weak:
        theirs = weak.post("/v1/keys", json=body, headers=idem("deploy-1"))
        again = weak.post("/v1/keys", json=body, headers=idem("deploy-1"))
    assert first.status_code == theirs.status_code == 201
    assert not replayed(theirs)
    assert first.json()["key"] not in theirs.text and first.json()["id"] != theirs.json()["id"]
    assert theirs.json()["scopes"] == ["keys:write"]  # what the weak key may grant, nothing of the first's
    assert replayed(again) and again.json()["id"] == theirs.json()["id"] and again.json()["key"] is None


# -- expiry on the fake clock -----------------------------------------------------------

def test_a_crashed_claim_expires_and_is_taken_over(manual: Live) -> None:
    s = manual.stack
    body = parse_spec(NB).model_dump(mode="json")  # what the route fingerprints (region defaulted)
    now = s.clock.now()
    with s.services.db.write() as conn:  # a server that claimed the key, then died
        idempotency_repo.claim_idempotency(conn, {"key_id": key_id(s.alice, manual), "method": "POST",
                                      "path": "/v1/workloads", "key": "k-crash",
                                      "fingerprint": fingerprint("POST", "/v1/workloads", body),
                                      "state": "in_flight", "status": None, "body": None,
                                      "created_at": now, "expires_at": now + IN_FLIGHT_S})
    with manual.client(s.alice) as c:
        s.clock.advance(IN_FLIGHT_S - 1)
        waiting = c.post("/v1/workloads", json=NB, headers=idem("k-crash"))
        s.clock.advance(2)
        taken = c.post("/v1/workloads", json=NB, headers=idem("k-crash"))
        again = c.post("/v1/workloads", json=NB, headers=idem("k-crash"))
    assert_error(waiting, 409)
    assert waiting.headers["Retry-After"] == "1" and waiting.headers["retry-after-ms"] == "100"
    assert waiting.headers["x-should-retry"] == "true"
    assert taken.status_code == 201 and not replayed(taken)
    assert again.status_code == 201 and replayed(again) and again.content == taken.content
    assert len(manual.workloads("alice")) == 1


def test_a_stored_response_is_kept_24h_then_forgotten(manual: Live) -> None:
    s = manual.stack
    pk = {"key_id": key_id(s.alice, manual), "method": "POST", "path": "/v1/workloads", "key": "k-day"}

    def record() -> IdempotencyRow | None:
        with s.services.db.read() as conn:
            return idempotency_repo.get_idempotency(conn, pk)

    def expire_step() -> None:
        """Housekeeping runs on the first cycle and every 30th after: run a full round of cycles."""
        for _ in range(30):
            s.controller.run_once()

    with manual.client(s.alice) as c:
        first = c.post("/v1/workloads", json=NB, headers=idem("k-day"))
        s.clock.advance(KEEP_S - 60)
        expire_step()
        assert record() is not None, "a response younger than 24 h must be kept"
        kept = c.post("/v1/workloads", json=NB, headers=idem("k-day"))
        s.clock.advance(120)
        expire_step()
        assert record() is None, "the controller's housekeeping must forget a response older than 24 h"
        fresh = c.post("/v1/workloads", json=NB, headers=idem("k-day"))
    assert first.status_code == 201
    assert replayed(kept) and kept.content == first.content
    # forgotten, so the create runs anew: the name is the first workload's now (a 409 naming it, not a second one)
    assert fresh.status_code == 409 and not replayed(fresh)
    assert first.json()["id"] in fresh.json()["error"]["message"]
    assert len(manual.workloads("alice")) == 1
