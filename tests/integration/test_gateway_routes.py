"""The route document the gateways poll, on SQLite and PostgreSQL: built once per change, never stale.

The fake clock stands still through every test: each change below happens in the same clock tick as the
document it must replace (and some write no timestamp at all), so a marker made of timestamps would miss
them."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from types import UnionType
from typing import Any, Union, cast, get_args, get_origin, get_type_hints, is_typeddict

import httpx
import pytest
from sqlalchemy import update

from tensora.api import gatewayroutes
from tensora.api.auth import create_key
from tensora.config.quotas import Limits, OwnerSettings
from tensora.gateway.routedoc import RouteDocument
from tensora.gateway.routes import table_from_json
from tensora.keys import apikeys
from tensora.store import keys as keys_repo
from tensora.store import owners as owners_repo
from tensora.store import routes as routes_repo
from tensora.store import workloads as workloads_repo
from tensora.store.tables import O
from tests.support import services
from tests.support.stack import Stack, stack


class Routes:
    def __init__(self, st: Stack, url: str) -> None:
        self.st, self.url = st, url
        self.c = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {st.admin}"}, timeout=10)
        self.etag: str | None = None

    @property
    def builds(self) -> int:
        return gatewayroutes.route_cache(self.st.services).builds

    def poll(self) -> dict[str, Any] | None:
        """As a gateway polls: None when nothing changed (304)."""
        r = self.c.get("/v1/gateway/routes", headers={"If-None-Match": self.etag} if self.etag else {})
        if r.status_code == 304:
            return None
        assert r.status_code == 200, r.text
        self.etag = r.headers["etag"]
        assert self.etag == f'"{r.json()["version"]}"'
        doc: dict[str, Any] = r.json()
        return doc

    def write(self, fn: Callable[[Any], Any]) -> Any:
        with self.st.services.db.write() as conn:
            return fn(conn)


@pytest.fixture
def routes(db_url: str, tmp_path: Path) -> Iterator[Routes]:
    st = stack(db_url, tmp_path, run_controller=False)
    with services.serving(st.app) as live:
        r = Routes(st, live.url)
        try:
            yield r
        finally:
            r.c.close()
            st.services.db.dispose()


def endpoint(r: Routes, name: str = "chat") -> str:
    made = httpx.post(f"{r.url}/v1/workloads", headers=r.st.headers(r.st.alice), timeout=10,
                      json={"kind": "endpoint", "name": name, "gpu_class": "cpu-1c-4g", "model_params": "1B"})
    assert made.status_code == 201, made.text
    wid: str = made.json()["id"]
    return wid


def replicas(doc: dict[str, Any]) -> set[str]:
    return {x["url"] for e in doc["endpoints"] for x in e["replicas"]}


def test_a_poll_that_finds_no_change_builds_nothing(routes: Routes, monkeypatch: pytest.MonkeyPatch) -> None:
    first = routes.poll()
    assert first is not None and routes.builds == 1
    built: list[int] = []
    real = gatewayroutes.routes_table
    monkeypatch.setattr(gatewayroutes, "routes_table", lambda *a: built.append(1) or real(*a))
    for _ in range(20):
        assert routes.poll() is None
    routes.etag = None
    assert routes.poll() == first  # without If-None-Match: the same bytes, from the cache
    assert built == [] and routes.builds == 1


def _start(r: Routes) -> None:
    endpoint(r)
    r.st.controller.run_once()


def _serve(r: Routes) -> None:
    """The endpoint's replica gets its URL: a write that sets no timestamp at all."""
    (w,) = r.write(lambda c: routes_repo.serving_endpoints(c, "local"))
    for x in r.write(lambda c: workloads_repo.replicas_of(c, [w.id])):
        r.write(lambda c, x=x: workloads_repo.update_replica(c, x.id, {"url": "http://127.0.0.1:9/v1",
                                                                       "state": "running"}))


def _second_replica(r: Routes) -> None:
    (w,) = r.write(lambda c: routes_repo.serving_endpoints(c, "local"))
    (x,) = r.write(lambda c: workloads_repo.replicas_of(c, [w.id]))
    now = r.st.clock.now()
    second = x._replace(id="rp_second", slot=1, url="http://127.0.0.1:8/v1", created_at=now, updated_at=now)
    r.write(lambda c: workloads_repo.insert_replica(c, second))


def _replica_gone(r: Routes) -> None:
    r.write(lambda c: workloads_repo.update_replica(c, "rp_second", {"state": "stopping"}))


def _key(r: Routes) -> None:
    r.write(lambda c: create_key(c, "carol", "app", ["inference"], r.st.clock.now()))


def _revoke(r: Routes) -> None:
    (k,) = [k for k in r.write(lambda c: keys_repo.list_keys(c, "carol"))]
    assert r.write(lambda c: keys_repo.revoke_key(c, k.id, None, r.st.clock.now()))


def _limits(rpm: int) -> Callable[[Routes], None]:
    def change(r: Routes) -> None:
        r.write(lambda c: owners_repo.set_owner(c, "alice", False, r.st.clock.now()))
        r.write(lambda c: c.execute(update(O).where(O.c.owner == "alice")
                                    .values(limits={"requests_per_minute": rpm})))
    return change


def _stop(r: Routes) -> None:
    (w,) = r.write(lambda c: routes_repo.serving_endpoints(c, "local"))
    r.write(lambda c: workloads_repo.update_workload(c, w.id, {"state": "stopping"}))


def _alice(doc: dict[str, Any]) -> dict[str, Any]:
    (a,) = [o for o in doc["owners"] if o["owner"] == "alice"]
    return a


# in order, each on the state the ones before it left: (what changes, what the next poll must show)
CHANGES: list[tuple[str, Callable[[Routes], None], Callable[[dict[str, Any]], bool]]] = [
    ("endpoint started", _start, lambda d: [e["name"] for e in d["endpoints"]] == ["chat"]),
    ("replica routable (no timestamp written)", _serve, lambda d: replicas(d) == {"http://127.0.0.1:9/v1"}),
    ("replica added", _second_replica, lambda d: replicas(d) == {"http://127.0.0.1:9/v1", "http://127.0.0.1:8/v1"}),
    ("replica removed", _replica_gone, lambda d: replicas(d) == {"http://127.0.0.1:9/v1"}),
    ("key created", _key, lambda d: "carol" in {k["owner"] for k in d["keys"]}
     and "carol" in {o["owner"] for o in d["owners"]}),
    ("key revoked", _revoke, lambda d: "carol" not in {k["owner"] for k in d["keys"]}
     and "carol" not in {o["owner"] for o in d["owners"]}),
    ("owner limits changed", _limits(60), lambda d: _alice(d)["requests_per_minute"] == 60),
    ("owner limits changed again, same tick", _limits(61), lambda d: _alice(d)["requests_per_minute"] == 61),
    ("endpoint stopped", _stop, lambda d: d["endpoints"] == []),
]


def test_each_kind_of_change_is_seen_by_the_next_poll_even_within_one_clock_tick(routes: Routes) -> None:
    assert routes.poll() is not None
    for name, change, seen in CHANGES:
        builds = routes.builds
        change(routes)
        doc = routes.poll()
        assert doc is not None and seen(doc), name
        assert routes.builds == builds + 1, name  # built once for it
        assert routes.poll() is None and routes.builds == builds + 1, name  # and not again


def test_owners_with_a_live_key_carry_their_effective_limits(routes: Routes) -> None:
    routes.st.services.owner_defaults = OwnerSettings(limits=Limits(requests_per_minute=100, tokens_per_minute=5000))
    _limits(7)(routes)
    doc = routes.poll()
    assert doc is not None
    assert doc["owners"] == [{"owner": o, "requests_per_minute": 7 if o == "alice" else 100, "tokens_per_minute": 5000}
                             for o in ("admin", "alice", "bob")]
    digests = {k["digest"] for k in doc["keys"]}
    assert apikeys.digest(routes.st.alice) in digests and routes.st.alice not in str(doc)


def test_every_worker_gives_the_same_document_the_same_etag(routes: Routes) -> None:
    _start(routes)
    assert routes.poll() is not None
    routes.st.services.extra.pop("gateway_routes")  # another worker (or a restart): a cache of its own
    assert routes.poll() is None and routes.builds == 1


def test_gateways_polling_at_once_after_a_change_build_it_once(routes: Routes) -> None:
    assert routes.poll() is not None
    _key(routes)
    out: list[int] = []

    def poll() -> None:
        with httpx.Client(base_url=routes.url, headers={"Authorization": f"Bearer {routes.st.admin}"}) as c:
            out.append(c.get("/v1/gateway/routes", headers={"If-None-Match": routes.etag or ""}).status_code)

    threads = [threading.Thread(target=poll) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert out == [200] * 8 and routes.builds == 2



def problems(value: Any, tp: Any, at: str = "doc") -> list[str]:
    """Where ``value`` (JSON) is not of type ``tp``: a TypedDict (no key beyond it, every required one), a list,
    a union, or a plain type (a bool is no int, an int is a float as JSON has it)."""
    if is_typeddict(tp):
        if not isinstance(value, dict):
            return [f"{at}: not an object"]
        hints = get_type_hints(tp)
        out = [f"{at}.{k}: not in the schema" for k in value if k not in hints]
        out += [f"{at}.{k}: missing" for k in tp.__required_keys__ if k not in value]
        return out + [p for k, v in value.items() if k in hints for p in problems(v, hints[k], f"{at}.{k}")]
    if get_origin(tp) is list:
        if not isinstance(value, list):
            return [f"{at}: not a list"]
        return [p for i, v in enumerate(value) for p in problems(v, get_args(tp)[0], f"{at}[{i}]")]
    if get_origin(tp) in (Union, UnionType):
        return [] if any(not problems(value, t, at) for t in get_args(tp)) else [f"{at}: {value!r} is no {tp}"]
    if tp is type(None):
        return [] if value is None else [f"{at}: not null"]
    ok = (isinstance(value, tp) and (tp is bool or not isinstance(value, bool))) or (tp is float and type(value) is int)
    return [] if ok else [f"{at}: {value!r} is no {tp.__name__}"]


def test_the_document_served_is_the_schema_both_sides_use(routes: Routes) -> None:
    """What the API serves is a RouteDocument (tensora.gateway.routedoc), no key beyond it, and the gateway reads
    every endpoint, replica, key and owner of it."""
    for change in (_start, _serve, _second_replica, _key, _limits(60)):
        change(routes)
    doc = routes.poll()
    assert doc is not None and doc["endpoints"] and doc["keys"] and doc["owners"]
    assert problems(doc, RouteDocument) == []
    table = table_from_json(cast(RouteDocument, doc))
    assert [(e.id, [x.url for x in e.replicas]) for e in table.endpoints] == [
        (e["id"], [x["url"].rstrip("/") for x in e["replicas"]]) for e in doc["endpoints"]]
    assert set(table.keys) == {k["digest"] for k in doc["keys"]}
    assert {o: (v.rpm, v.tpm) for o, v in table.owners.items()} == {
        o["owner"]: (o["requests_per_minute"], o["tokens_per_minute"]) for o in doc["owners"]}
    wrong = {**doc, "keys": [{**doc["keys"][0], "rpm": "60"}], "endpoints": [{**doc["endpoints"][0], "x": 1}]}
    assert problems(wrong, RouteDocument) == ["doc.endpoints[0].x: not in the schema",
                                              "doc.keys[0].rpm: '60' is no int | None"]
