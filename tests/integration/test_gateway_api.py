"""The control API's side of the gateway, on SQLite and PostgreSQL: the route table it hands out,
the usage batches it takes (each record once), per-key limits, and who may run serverless endpoints."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tensora.gateway.routes import table_from_json
from tensora.keys import apikeys, replicakeys
from tensora.models.tinymodel import MAX_POSITIONS, write_tiny_model
from tensora.store import workloads as workloads_repo
from tests.support import services
from tests.support.stack import T0, Stack, stack

_clients: list[httpx.Client] = []


@pytest.fixture
def s(db_url: str, tmp_path: Path) -> Iterator[tuple[Stack, str]]:
    st = stack(db_url, tmp_path, run_controller=False)
    with services.serving(st.app) as live:
        try:
            yield st, live.url
        finally:
            while _clients:
                _clients.pop().close()
            st.services.db.dispose()


def client(url: str, key: str) -> httpx.Client:
    c = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=10)
    _clients.append(c)
    return c


def record(rid: str, owner: str = "alice", **kw: Any) -> dict[str, Any]:
    return {"id": rid, "at": T0 + 1, "owner": owner, "key_id": "key_x", "endpoint": "chat", "endpoint_id": "wl_1",
            "product": "endpoint", "answered_by": "wl_1", "model": "chat", "served_by": "replica", "region": "local",
            "prompt_tokens": 7, "completion_tokens": 5, "status": 200, **kw}


def test_routes_are_for_admin_keys_name_ready_replicas_and_only_key_digests(s: tuple[Stack, str]) -> None:
    st, url = s
    admin, alice = client(url, st.admin), client(url, st.alice)
    made = alice.post("/v1/workloads", json={"kind": "endpoint", "name": "chat", "gpu_class": "l40s-48gb",
                                             "fallback": ["cpu"], "fallback_after": 0, "model_params": "1B",
                                             "fallback_models": ["small"],
                                             "spec": {"ttft_deadline_s": 7, "stream_idle_s": 4.5}})
    assert made.status_code == 201, made.text
    assert alice.get("/v1/gateway/routes").status_code == 403
    first = admin.get("/v1/gateway/routes")
    assert first.status_code == 200 and first.json()["endpoints"] == []  # queued: nothing to route to yet
    st.controller.run_once()
    st.controller.run_once()
    with st.services.db.write() as conn:  # the simulated driver has no URLs; give its replica one
        for r in workloads_repo.replicas_of(conn, [made.json()["id"]]):
            workloads_repo.update_replica(conn, r.id, {"url": "http://127.0.0.1:9/v1"})
    table = admin.get("/v1/gateway/routes", headers={"If-None-Match": first.headers["etag"]})
    assert table.status_code == 200 and table.headers["etag"] != first.headers["etag"]
    (ep,) = table.json()["endpoints"]
    assert (ep["name"], ep["owner"], ep["cpu_fallback"], ep["requested_cpu"]) == ("chat", "alice", True, False)
    assert ep["fallback_models"] == ["small"] and ep["ttft_s"] == 7 and ep["serverless"] is False
    assert ep["stream_idle_s"] == 4.5 and table_from_json(table.json()).endpoints[0].stream_idle_s == 4.5
    (r,) = ep["replicas"]
    assert r["url"] == "http://127.0.0.1:9/v1" and r["cls"] == "l40s-48gb" and r["cpu"] is False
    keys = table.json()["keys"]
    assert {k["owner"] for k in keys} >= {"admin", "alice", "bob"}
    assert apikeys.digest(st.alice) in {k["digest"] for k in keys}
    assert st.alice not in table.text and st.admin not in table.text
    same = admin.get("/v1/gateway/routes", headers={"If-None-Match": table.headers["etag"]})
    assert same.status_code == 304


def test_an_endpoints_known_context_reaches_the_gateway(s: tuple[Stack, str], tmp_path: Path) -> None:
    """The context length its model's config.json states (the tiny model's: MAX_POSITIONS) is in the route
    document, for the gateway to send a prompt too long for it to a fallback model."""
    st, url = s
    admin, alice = client(url, st.admin), client(url, st.alice)
    write_tiny_model(tmp_path / "tiny-src")
    for f in sorted((tmp_path / "tiny-src").iterdir()):
        r = alice.put(f"/v1/files/tiny/{f.name}", content=f.read_bytes())
        assert r.status_code in (200, 201), r.text
    made = alice.post("/v1/workloads", json={"kind": "endpoint", "name": "chat", "gpu_class": "l40s-48gb",
                                             "model": "tiny"})
    assert made.status_code == 201, made.text
    st.controller.run_once()
    st.controller.run_once()
    with st.services.db.write() as conn:
        for r in workloads_repo.replicas_of(conn, [made.json()["id"]]):
            workloads_repo.update_replica(conn, r.id, {"url": "http://127.0.0.1:9/v1"})
    (ep,) = admin.get("/v1/gateway/routes").json()["endpoints"]
    assert ep["context"] == MAX_POSITIONS
    assert table_from_json(admin.get("/v1/gateway/routes").json()).endpoints[0].context == MAX_POSITIONS

def test_on_the_local_driver_each_replica_carries_its_own_key_for_the_gateway(s: tuple[Stack, str]) -> None:
    st, url = s
    admin, alice = client(url, st.admin), client(url, st.alice)
    ids = [alice.post("/v1/workloads", json={"kind": "endpoint", "name": name, "gpu_class": "cpu-1c-4g",
                                              "model_params": "1B"}).json()["id"] for name in ("chat", "code")]
    st.controller.run_once()
    st.controller.run_once()
    with st.services.db.write() as conn:
        for r in workloads_repo.replicas_of(conn, ids):
            workloads_repo.update_replica(conn, r.id, {"url": "http://127.0.0.1:9/v1"})

    def replicas() -> list[dict[str, Any]]:
        return [r for e in admin.get("/v1/gateway/routes").json()["endpoints"] for r in e["replicas"]]

    assert len(replicas()) == 2 and all("api_key" not in r for r in replicas())  # not the local driver: no key
    st.services.replica_secret = secret = b"s" * replicakeys.SECRET_BYTES
    keyed = replicas()
    assert [r["api_key"] for r in keyed] == [replicakeys.derive(secret, r["id"]) for r in keyed]
    assert len({r["api_key"] for r in keyed}) == 2
    assert alice.get("/v1/gateway/routes").status_code == 403  # only the gateway (an admin key) sees them


def test_usage_batches_count_each_record_once_and_owners_see_their_own(s: tuple[Stack, str]) -> None:
    st, url = s
    admin, alice, bob = client(url, st.admin), client(url, st.alice), client(url, st.bob)
    batch = {"records": [record("req_1"), record("req_2", product="serverless", model="m-shared",
                                                    served_by="serverless"), record("req_3", owner="bob")]}
    assert alice.post("/v1/gateway/usage", json=batch).status_code == 403
    first = admin.post("/v1/gateway/usage", json=batch)
    again = admin.post("/v1/gateway/usage", json=batch)  # a gateway resending what it was not sure arrived
    assert first.json() == {"received": 3, "new": 3} and again.json() == {"received": 3, "new": 0}
    mine = alice.get("/v1/usage/tokens").json()["data"]
    assert sorted((r["product"], r["model"], r["requests"], r["completion_tokens"]) for r in mine) == [
        ("endpoint", "chat", 1, 5), ("serverless", "m-shared", 1, 5)]
    assert [r["owner"] for r in bob.get("/v1/usage/tokens").json()["data"]] == ["bob"]
    bad = admin.post("/v1/gateway/usage", json={"records": [record("req_4", product="gold")]})
    assert bad.status_code == 422 and "product" in bad.text
    assert len(admin.get("/v1/usage/tokens").json()["data"]) == 3  # nothing of the bad batch written


def test_keys_carry_their_gateway_limits_into_the_routes(s: tuple[Stack, str]) -> None:
    st, url = s
    alice, admin = client(url, st.alice), client(url, st.admin)
    made = admin.post("/v1/keys", json={"name": "app", "owner": "alice", "scopes": ["inference"],
                                        "requests_per_minute": 60, "tokens_per_minute": 5000})
    assert made.status_code == 201, made.text
    assert (made.json()["requests_per_minute"], made.json()["tokens_per_minute"]) == (60, 5000)
    keys = {k["id"]: k for k in admin.get("/v1/gateway/routes").json()["keys"]}
    assert (keys[made.json()["id"]]["rpm"], keys[made.json()["id"]]["tpm"]) == (60, 5000)
    assert alice.post("/v1/keys", json={"requests_per_minute": 0}).status_code == 422
    assert alice.delete(f"/v1/keys/{made.json()['id']}").status_code == 204
    assert made.json()["id"] not in {k["id"] for k in admin.get("/v1/gateway/routes").json()["keys"]}


@pytest.mark.parametrize(("who", "spec", "status", "field"), [
    ("alice", {"serverless": True}, 403, "spec.serverless"),
    ("admin", {"serverless": True}, 201, None),
    ("alice", {"ttft_deadline_s": 0}, 422, "spec.ttft_deadline_s"),
    ("alice", {"ttft_deadline_s": "fast"}, 422, "spec.ttft_deadline_s"),
    ("alice", {"ttft_deadline_s": 2.5}, 201, None),
    ("alice", {"stream_idle_s": 0}, 422, "spec.stream_idle_s"),
    ("alice", {"stream_idle_s": 601}, 422, "spec.stream_idle_s"),
    ("alice", {"stream_idle_s": True}, 422, "spec.stream_idle_s"),
    ("alice", {"stream_idle_s": 600}, 201, None),
])
def test_endpoint_gateway_settings(s: tuple[Stack, str], who: str, spec: dict[str, Any], status: int,
                                   field: str | None) -> None:
    st, url = s
    c = client(url, st.admin if who == "admin" else st.alice)
    r = c.post("/v1/workloads", json={"kind": "endpoint", "name": "ep", "gpu_class": "l40s-48gb",
                                      "model_params": "1B", "spec": spec})
    assert r.status_code == status, r.text
    if field is not None:
        assert r.json()["error"]["field"] == field
