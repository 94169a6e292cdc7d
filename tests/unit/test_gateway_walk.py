"""The walk on an in-memory upstream (``fakeupstream``): its conduct, a rule a case, in milliseconds and with no
processes. The same rules against real fake servers over HTTP are in test_gateway_conduct and _failover."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tensora.gateway import chain
from tensora.gateway.breaker import Breaker, Policy
from tensora.gateway.call import Call, Options, Served
from tensora.gateway.chain import Backend, ServedBy
from tensora.gateway.limits import Admission, Quota
from tensora.gateway.relay import Relay
from tensora.gateway.routes import KeyRoute, RouteTable, table_from_json
from tensora.gateway.upstream import Reply
from tensora.gateway.walk import Walk, _Tiers
from tests.support.clock import FakeClock
from tests.support.fakeupstream import FakeUpstream, Step, ok, sse, status

GPU, CPU, BIG = "http://10.0.0.1:1/r1/v1", "http://10.0.0.1:1/c1/v1", "http://10.0.0.1:1/g1/v1"
KEY = KeyRoute("key_1", "alice", ("inference",), None, None)


class Sent:
    """The client's side of the ASGI ``send``: what it was sent."""

    def __init__(self) -> None:
        self.msgs: list[dict[str, Any]] = []

    async def __call__(self, msg: dict[str, Any]) -> None:
        self.msgs.append(msg)

    @property
    def status(self) -> int:
        return int(self.msgs[0]["status"])

    def header(self, name: bytes) -> str:
        value: bytes = dict(self.msgs[0]["headers"])[name]
        return value.decode()

    @property
    def body(self) -> bytes:
        return b"".join(m.get("body", b"") for m in self.msgs[1:])


def table(fallback: bool = False) -> RouteTable:
    """Two tiers of one replica each: the endpoint's GPU replica, then its CPU fallback; with ``fallback``, a
    third: the owner's model ``big`` as its fallback model."""
    def rep(rid: str, url: str, cpu: bool = False) -> dict[str, Any]:
        return {"id": rid, "url": url, "cls": "cpu-4c-16g" if cpu else "l40s-48gb", "cpu": cpu, "upstream_model": "/m"}
    return table_from_json({"version": "1", "region": "eu", "keys": [], "endpoints": [
        {"id": "wl_main", "name": "my-llm", "owner": "alice", "region": "eu", "model": "/m", "cpu_fallback": True,
         "fallback_models": ["big"] if fallback else [], "replicas": [rep("r1", GPU), rep("c1", CPU, cpu=True)]},
        {"id": "wl_big", "name": "big", "owner": "alice", "region": "eu", "model": "/b",
         "replicas": [rep("g1", BIG)]}]})


def walk(script: dict[str, list[Step]], clock: FakeClock, **options: Any) -> tuple[Walk, FakeUpstream]:
    o = Options(region="eu", ttft_s=0.2, stream_idle_s=0.2, retry_delay_s=0.01, retry_room_s=0.0, **options)
    fake = FakeUpstream(script)
    return Walk(o, clock, fake, Relay(o, clock)), fake


def run(w: Walk, *, stream: bool = False, fallback: bool = False) -> tuple[Served | None, Sent]:
    t = table(fallback)
    endpoint = t.resolve("alice", "my-llm")
    assert endpoint is not None
    sent = Sent()
    body = {"model": "my-llm", "messages": [{"role": "user", "content": "hi"}], "stream": stream}
    call = Call(sent, "req_1", "/chat/completions", KEY, t, endpoint, body, stream, False, 10, b"Bearer k", False)
    return asyncio.run(w.run(call)), sent


class Unhurried(FakeUpstream):
    """An upstream client that never calls ``meanwhile``: every answer's headers are made once it is in."""

    async def post(self, base_url: str, path: str, body: bytes, headers: list[tuple[str, str]],
                   head_timeout: float, meanwhile: Callable[[], None] | None = None) -> Reply:
        return await super().post(base_url, path, body, headers, head_timeout)


HEAD_CASES = {
    "the first try answers": ({}, False),
    "a 5xx, then the retry there answers": ({GPU: [status(503), ok("again")]}, False),
    "the next tier answers after a timeout": ({GPU: [Step(stall=True)]}, False),
    "a 429, then the next tier": ({GPU: [status(429, retry_after="2")]}, False),
    "a 4xx passed through": ({GPU: [status(400)]}, False),
    "every backend fails": ({GPU: [status(503), status(503)], CPU: [status(502), status(502)]}, False),
    "a stream": ({}, True),
    "a stream after a reset": ({GPU: [Step(error="reset"), Step(error="reset")]}, True),
}


@pytest.mark.parametrize(("script", "stream"), HEAD_CASES.values(), ids=HEAD_CASES.keys())
def test_the_headers_made_while_the_upstream_works_are_those_made_after(script: dict[str, list[Step]],
                                                                        stream: bool) -> None:
    """``Relay.prepare`` (the answer's headers made while it is awaited) changes no byte of what the client gets,
    the attempts that failed before it and the rate-limit headers included."""
    got = []
    for fake in (FakeUpstream(script), Unhurried(script)):
        o = Options(region="eu", ttft_s=0.2, stream_idle_s=0.2, retry_delay_s=0.01, retry_room_s=0.0)
        w = Walk(o, FakeClock(1000.0), fake, Relay(o, FakeClock(1000.0)))
        t = table()
        endpoint = t.resolve("alice", "my-llm")
        assert endpoint is not None
        sent = Sent()
        body = {"model": "my-llm", "messages": [{"role": "user", "content": "hi"}], "stream": stream}
        call = Call(sent, "req_1", "/chat/completions", KEY, t, endpoint, body, stream, False, 10, b"Bearer k",
                    False, admission=Admission(True, 16, Quota(60, 1000), 7, 100, 12.5))
        asyncio.run(w.run(call))
        assert sent.header(b"x-ratelimit-remaining-requests") == "53"
        got.append(sent.msgs)
    assert got[0] == got[1]


def test_a_5xx_from_a_tiers_only_replica_is_tried_once_more_there() -> None:
    clock = FakeClock(1000.0)
    w, fake = walk({GPU: [status(503), ok("again")]}, clock)
    served, sent = run(w)
    assert sent.status == 200 and orjson.loads(sent.body)["choices"][0]["message"]["content"] == "again"
    assert sent.header(b"x-tensora-attempts") == "my-llm/r1:http_503,my-llm/r1:ok"
    assert served is not None and served.backend.key == "my-llm/r1" and served.prompt_tokens == 3
    assert [p[0] for p in fake.posts] == [GPU, GPU] and fake.posts[0][2]["model"] == "/m"
    assert w.breakers["my-llm/r1"].failures == 0  # the retry worked: closed again


def test_a_backend_that_sends_no_head_in_time_is_left_for_the_next_tier() -> None:
    clock = FakeClock(1000.0)
    w, fake = walk({GPU: [Step(stall=True)]}, clock)
    served, sent = run(w)
    assert sent.status == 200 and sent.header(b"x-tensora-attempts") == "my-llm/r1:timeout,my-llm/c1:ok"
    assert served is not None and served.backend.key == "my-llm/c1"
    assert [p[0] for p in fake.posts] == [GPU, CPU]  # a timeout is not retried
    assert w.breakers["my-llm/r1"].failures == 1


def test_a_stream_that_stalls_after_its_first_token_ends_with_the_error_event() -> None:
    clock = FakeClock(1000.0)
    first = {"choices": [{"index": 0, "delta": {"content": "Hel"}}]}
    w, fake = walk({GPU: [sse(first, None)]}, clock)
    served, sent = run(w, stream=True)
    assert sent.status == 200 and sent.header(b"x-tensora-attempts") == "my-llm/r1:ok"
    events = [e.removeprefix(b"data: ") for e in sent.body.split(b"\n\n") if e]
    assert orjson.loads(events[0])["choices"][0]["delta"]["content"] == "Hel"
    assert "stream_idle" in orjson.loads(events[1])["error"]["message"] and events[2] == b"[DONE]"
    assert served is not None and served.broken == "stream_idle" and served.status == 502
    assert w.breakers["my-llm/r1"].failures == 1 and [p[0] for p in fake.posts] == [GPU]  # never spliced


def test_a_429_with_retry_after_skips_that_backend_until_then() -> None:
    clock = FakeClock(1000.0)
    w, fake = walk({GPU: [status(429, retry_after="2")]}, clock)
    _, sent = run(w)
    assert sent.header(b"x-tensora-attempts") == "my-llm/r1:http_429,my-llm/c1:ok"
    breaker = w.breakers["my-llm/r1"]
    now = clock.now()
    assert breaker.limited_until(now) == pytest.approx(now + 2) and breaker.failures == 0  # busy, not broken
    _, sent = run(w)
    assert sent.header(b"x-tensora-attempts") == "my-llm/r1:rate_limited,my-llm/c1:ok"
    clock.advance(2.1)
    _, sent = run(w)
    assert sent.header(b"x-tensora-attempts") == "my-llm/r1:ok"
    assert [p[0] for p in fake.posts] == [GPU, CPU, CPU, GPU]


def test_when_every_backend_is_rate_limited_the_503_carries_the_soonest_retry_after() -> None:
    clock = FakeClock(1000.0)
    w, _ = walk({GPU: [status(429, retry_after="2")], CPU: [status(429, retry_after_ms="500")]}, clock)
    served, sent = run(w)
    assert served is None and sent.status == 503
    assert sent.header(b"x-tensora-attempts") == "my-llm/r1:http_429,my-llm/c1:http_429"
    assert (sent.header(b"retry-after"), sent.header(b"retry-after-ms")) == ("1", "500")


def test_a_prompt_over_the_models_context_goes_to_the_fallback_model_only() -> None:
    clock = FakeClock(1000.0)
    too_long = Step(400, orjson.dumps({"error": {"message": "This model's maximum context length is 4096 tokens",
                                                 "type": "BadRequestError", "code": 400}}))
    w, fake = walk({GPU: [too_long]}, clock)
    served, sent = run(w, fallback=True)
    assert sent.status == 200 and sent.header(b"x-tensora-attempts") == "my-llm/r1:context_length_exceeded,big/g1:ok"
    assert served is not None and served.backend.key == "big/g1" and sent.header(b"x-tensora-fallback") == "true"
    assert [p[0] for p in fake.posts] == [GPU, BIG]  # not the same model on CPU
    assert w.breakers["my-llm/r1"].failures == 0  # the request's fault, not the backend's


def test_any_other_4xx_is_passed_through_as_it_came_and_never_retried() -> None:
    clock = FakeClock(1000.0)
    refused = status(400)
    w, fake = walk({GPU: [refused]}, clock)
    served, sent = run(w, fallback=True)
    assert sent.status == 400 and sent.body == refused.body
    assert sent.header(b"x-tensora-attempts") == "my-llm/r1:http_400" and [p[0] for p in fake.posts] == [GPU]
    assert served is not None and served.status == 400


def test_the_breakers_of_backends_gone_from_the_route_table_are_forgotten() -> None:
    clock = FakeClock(1000.0)
    w, _ = walk({GPU: [status(503), status(503)]}, clock, breaker=Policy(consecutive=1))
    run(w)
    assert w.breakers["my-llm/r1"].open_until is not None and "my-llm/r1" in w.ejected
    gone = table_from_json({"version": "2", "region": "eu", "keys": [], "endpoints": [
        {"id": "wl_main", "name": "my-llm", "owner": "alice", "region": "eu", "model": "/m", "cpu_fallback": True,
         "replicas": [{"id": "c1", "url": CPU, "cls": "cpu-4c-16g", "cpu": True, "upstream_model": "/m"}]}]})
    endpoint = gone.resolve("alice", "my-llm")
    assert endpoint is not None
    sent = Sent()
    call = Call(sent, "req_2", "/chat/completions", KEY, gone, endpoint, {"model": "my-llm"}, False, False, 10,
                b"Bearer k", False)
    asyncio.run(w.run(call))
    assert sent.status == 200 and set(w.breakers) == {"my-llm/c1"} and w.ejected == {}


# -- the plan kept per turn is chain.order's ------------------------------------------------------------------


def _backend(tier: int, i: int, peer: bool) -> Backend:
    return Backend(f"t{tier}/b{i}", f"http://10.0.0.{tier}:1/b{i}/v1", "/m", "m", ServedBy.REPLICA, "wl", "eu",
                   peer=peer)


_BREAKER = st.one_of(st.none(), st.builds(  # none yet, or one with an open_until / busy_until before or after now
    lambda o, b: Breaker(open_until=o, busy_until=b),
    st.one_of(st.none(), st.floats(990, 1010)), st.one_of(st.none(), st.floats(990, 1010))))


@settings(max_examples=300, deadline=None)
@given(sizes=st.lists(st.integers(0, 4), min_size=1, max_size=5), turn=st.integers(0, 10_000),
       states=st.lists(_BREAKER, min_size=20, max_size=20))
def test_the_walks_plan_is_chain_orders_whatever_the_breakers_say(sizes: list[int], turn: int,
                                                                   states: list[Breaker | None]) -> None:
    """The walk keeps a plan per turn of the rotation for when no breaker is open or limited; with or without
    those, its plan is the one ``chain.order`` makes from each breaker's ``retry_at`` and ``limited_until``."""
    tiers = [[_backend(t, i, peer=t == len(sizes) - 1) for i in range(n)] for t, n in enumerate(sizes)]
    w, _ = walk({}, FakeClock(1000.0))
    keys = [b.key for tier in tiers for b in tier]
    w.breakers = {k: s for k, s in zip(keys, states, strict=False) if s is not None}
    w._turn = turn
    now = 1000.0
    assert w._plan(_Tiers(tiers), now) == chain.order(tiers, w._open_until(now), turn, w._limited_until(now))


ALONE = {  # name -> (tier sizes, the keys that are their tier's only backend)
    "one replica, then a CPU fallback": ([1, 1, 0], {"t0/b0", "t1/b0"}),
    "two replicas: neither": ([2, 0], set()),
    "a single peer is a tier of one too (the walk asks b.peer)": ([0, 1], {"t1/b0"}),
}


@pytest.mark.parametrize(("sizes", "alone"), ALONE.values(), ids=ALONE.keys())
def test_the_backends_alone_in_their_tier_are_known_once(sizes: list[int], alone: set[str]) -> None:
    tiers = [[_backend(t, i, peer=t == len(sizes) - 1) for i in range(n)] for t, n in enumerate(sizes)]
    assert _Tiers(tiers).alone == alone
