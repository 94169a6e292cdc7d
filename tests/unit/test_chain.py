"""The fallback chain as a pure plan (ADR-0010 B): named cases of who is tried, in which order."""

from __future__ import annotations

from typing import Any

import pytest

from tensora.gateway.chain import Peer, ServedBy, longer_context, order, plan, tiers
from tensora.gateway.routes import RouteTable, table_from_json


def rep(rid: str, cpu: bool = False) -> dict[str, Any]:
    return {"id": rid, "url": f"http://10.0.0.1:1/{rid}/v1", "cls": "cpu-4c-16g" if cpu else "l40s-48gb", "cpu": cpu,
            "upstream_model": "/models/m"}


def table(**main: Any) -> RouteTable:
    endpoints = [
        {"id": "wl_main", "name": "my-llm", "owner": "alice", "region": "eu", "model": "/models/m",
         "cpu_fallback": True, "replicas": [rep("r1"), rep("r2"), rep("c1", cpu=True)], **main},
        {"id": "wl_pool", "name": "m-shared", "owner": "ops", "region": "eu", "model": "/models/m", "serverless": True,
         "replicas": [rep("s1")]},
        {"id": "wl_small", "name": "small", "owner": "alice", "region": "eu", "model": "/models/s",
         "replicas": [rep("f1", cpu=True)]},
        {"id": "wl_bob", "name": "small", "owner": "bob", "region": "eu", "model": "/models/s",
         "replicas": [rep("b1")]},
        {"id": "wl_big", "name": "big", "owner": "alice", "region": "eu", "model": "/models/b",
         "replicas": [rep("g1")]},
    ]
    return table_from_json({"version": "1", "region": "eu", "endpoints": endpoints, "keys": []})


PEERS = [Peer("us", "http://us-gw/v1"), Peer("eu", "http://eu-gw/v1")]


def keys(t: RouteTable, *, hopped: bool = False, opened: tuple[str, ...] = (), turn: int = 0) -> list[str]:
    e = t.resolve("alice", "my-llm")
    assert e is not None
    p = plan(e, t, PEERS, lambda k: 99.0 if k in opened else None, hopped=hopped, turn=turn)
    return [b.key for b in p.attempts]


CASES = [
    ("own replicas, then cpu, then the pool; no fallback models, no other region", {},
     {}, ["my-llm/r1", "my-llm/r2", "my-llm/c1", "m-shared/s1"]),
    ("no cpu fallback: its cpu replica is not tried", {"cpu_fallback": False},
     {}, ["my-llm/r1", "my-llm/r2", "m-shared/s1"]),
    ("fallback models after the pool, the caller's own by name", {"fallback_models": ["small"]},
     {}, ["my-llm/r1", "my-llm/r2", "my-llm/c1", "m-shared/s1", "small/f1"]),
    ("an unknown fallback model is left out", {"fallback_models": ["nope"]},
     {}, ["my-llm/r1", "my-llm/r2", "my-llm/c1", "m-shared/s1"]),
    ("cross-region last, only to other regions", {"allow_cross_region": True},
     {}, ["my-llm/r1", "my-llm/r2", "my-llm/c1", "m-shared/s1", "peer:us"]),
    ("a request that already hopped goes to no peer", {"allow_cross_region": True},
     {"hopped": True}, ["my-llm/r1", "my-llm/r2", "my-llm/c1", "m-shared/s1"]),
    ("open breakers are skipped at once", {},
     {"opened": ("my-llm/r1", "m-shared/s1")}, ["my-llm/r2", "my-llm/c1"]),
    ("replicas of a tier rotate by turn", {},
     {"turn": 1}, ["my-llm/r2", "my-llm/r1", "my-llm/c1", "m-shared/s1"]),
    ("an endpoint that asked for cpu: its cpu replicas are its own", {"requested_cpu": True},
     {}, ["my-llm/r1", "my-llm/r2", "my-llm/c1", "m-shared/s1"]),
    ("no model path: no pool", {"model": None},
     {}, ["my-llm/r1", "my-llm/r2", "my-llm/c1"]),
]


@pytest.mark.parametrize(("name", "main", "kw", "expected"), CASES, ids=[c[0] for c in CASES])
def test_chain_order(name: str, main: dict[str, Any], kw: dict[str, Any], expected: list[str]) -> None:
    assert keys(table(**main), **kw) == expected


def test_what_each_tier_is_served_by_and_named() -> None:
    t = table(fallback_models=["small"], allow_cross_region=True)
    e = t.resolve("alice", "my-llm")
    assert e is not None
    got = {b.key: (b.served_by, b.model, b.endpoint_id) for b in plan(e, t, PEERS, lambda k: None).attempts}
    assert got == {
        "my-llm/r1": (ServedBy.REPLICA, "my-llm", "wl_main"), "my-llm/r2": (ServedBy.REPLICA, "my-llm", "wl_main"),
        "my-llm/c1": (ServedBy.CPU, "my-llm", "wl_main"), "m-shared/s1": (ServedBy.SERVERLESS, "m-shared", "wl_pool"),
        "small/f1": (ServedBy.FALLBACK_MODEL, "small", "wl_small"), "peer:us": (ServedBy.REPLICA, "my-llm", "wl_main")}


def test_retry_after_is_the_soonest_open_breaker() -> None:
    t = table()
    e = t.resolve("alice", "my-llm")
    assert e is not None
    until = {"my-llm/r1": 50.0, "my-llm/r2": 20.0, "my-llm/c1": 30.0, "m-shared/s1": 40.0}
    p = plan(e, t, PEERS, until.get)
    assert p.attempts == () and p.retry_after == 20.0 and len(p.skipped) == 4


def test_names_resolve_to_the_callers_own_endpoint_then_the_pool() -> None:
    t = table()
    own, bobs = t.resolve("alice", "small"), t.resolve("bob", "small")
    assert own is not None and own.id == "wl_small" and bobs is not None and bobs.id == "wl_bob"
    assert (shared := t.resolve("carol", "m-shared")) is not None and shared.id == "wl_pool"
    assert t.resolve("carol", "my-llm") is None  # another owner's endpoint is not visible
    assert [e.name for e in t.visible("bob")] == ["small", "m-shared"]


def test_rate_limited_backends_are_skipped_apart_from_open_breakers() -> None:
    t = table()
    e = t.resolve("alice", "my-llm")
    assert e is not None
    opened, limited = {"my-llm/r1": 50.0}, {"my-llm/r1": 5.0, "my-llm/c1": 40.0}
    p = order(tiers(e, t, PEERS, hopped=False), opened.get, 0, limited.get)
    assert [b.key for b in p.attempts] == ["my-llm/r2", "m-shared/s1"]
    assert [b.key for b in p.skipped] == ["my-llm/r1"] and [b.key for b in p.limited] == ["my-llm/c1"]
    assert p.retry_after == 40.0


LONGER = [  # (who said it is too long, what was left, what is left after)
    ("the primary: its other replicas, cpu, pool and peers are the same model", "my-llm/r1",
     ["my-llm/r2", "my-llm/c1", "m-shared/s1", "small/f1", "big/g1", "peer:us"], ["small/f1", "big/g1"]),
    ("a fallback model: the next one, in listed order", "small/f1", ["big/g1", "peer:us"], ["big/g1"]),
    ("the pool (the same model): the fallback models", "m-shared/s1", ["small/f1", "big/g1"], ["small/f1", "big/g1"]),
    ("no fallback model left: nothing", "big/g1", ["peer:us"], []),
]


@pytest.mark.parametrize(("name", "failed", "left", "after"), LONGER, ids=[c[0] for c in LONGER])
def test_after_a_context_length_error_only_the_fallback_models_are_left(name: str, failed: str, left: list[str],
                                                                        after: list[str]) -> None:
    t = table(fallback_models=["small", "big"], allow_cross_region=True)
    e = t.resolve("alice", "my-llm")
    assert e is not None
    every = {b.key: b for b in plan(e, t, PEERS, lambda k: None).attempts}
    assert [b.key for b in longer_context([every[k] for k in left], every[failed])] == after, name
