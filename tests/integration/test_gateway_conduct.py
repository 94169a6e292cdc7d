"""The gateway's conduct when a backend misbehaves after the request went out:
a stream that stalls after its first tokens ends cleanly and counts against the backend; a 5xx or a reset
from a tier's only backend is tried once more there; and a request is never sent again behind the
caller's back. Real fake-backend processes that count the requests they get, real HTTP; a fake clock
where the deadline decides."""

from __future__ import annotations

import asyncio
import random
import socket
import time
from collections.abc import Callable
from typing import Any

import httpx
import orjson
import pytest
import uvloop
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tensora.gateway import upstream
from tensora.gateway.breaker import Policy
from tensora.gateway.limits import MemoryLimiter
from tensora.gateway.proxy import Gateway, Options
from tensora.gateway.routes import RouteTable
from tensora.gateway.upstream import Client, UpstreamError
from tensora.keys import apikeys
from tests.support.clock import FakeClock
from tests.support.gateway_harness import (
    Backends,
    backends_fixture,
    chat,
    make_table,
    replica,
    serving,
    sse_payloads,
)

pytestmark = pytest.mark.timeout(120)

ALICE = apikeys.generate()
KEYS = {ALICE: ("alice", ["inference"])}
BODY = orjson.dumps({"model": "/models/m", "messages": [{"role": "user", "content": "hi"}]})
LOOPS: dict[str, Callable[[Any], Any]] = {"asyncio": asyncio.run, "uvloop": uvloop.run}


backends = backends_fixture(["r1", "r2", "f1"])


@pytest.fixture(autouse=True)
def _reset(backends: Backends) -> None:
    backends.reset()


def gateway(table: RouteTable, clock: Any = None, **opts: Any) -> Gateway:
    o = Options(ttft_s=1.0, deadline_s=4.0, breaker=Policy(consecutive=1000))
    for k, v in opts.items():
        setattr(o, k, v)
    return Gateway(o, lambda: table, MemoryLimiter(), None, **({"clock": clock} if clock is not None else {}))


def lone(b: Backends, **main: Any) -> RouteTable:
    """my-llm on r1 alone (a tier of one), falling back to the model ``small`` on f1."""
    return make_table([{"id": "wl_main", "name": "my-llm", "owner": "alice", "fallback_models": ["small"],
                        "replicas": [replica("r1", b.url("r1"))], **main},
                       {"id": "wl_small", "name": "small", "owner": "alice",
                        "replicas": [replica("f1", b.url("f1"))]}], KEYS)


def post(url: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{url}/chat/completions", json=body, headers={"Authorization": f"Bearer {ALICE}"},
                      timeout=30)


def tried(r: httpx.Response) -> list[str]:
    return r.headers["x-tensora-attempts"].split(",")


# -- 6. never a silent duplicate: the upstream client ---------------------------------------------------


async def _send(c: Client, url: str) -> int:
    resp = await c.post(url, "/chat/completions", BODY, [], 5.0)
    try:
        await resp.read()
        return resp.status
    finally:
        resp.release()


@pytest.mark.parametrize("run", LOOPS.values(), ids=LOOPS.keys())
def test_a_request_reset_after_the_upstream_held_it_is_never_sent_again(backends: Backends,
                                                                          run: Callable[[Any], Any]) -> None:
    """The model server read it and worked on it: sending it again on a fresh connection would run it twice."""
    async def go() -> str:
        c = Client()
        try:
            assert await _send(c, backends.url("r1")) == 200  # leaves a kept-alive connection in the pool
            backends.mode("r1", "hold_reset", hold_s=0.3)
            with pytest.raises(UpstreamError) as exc:
                await _send(c, backends.url("r1"))
            return exc.value.kind
        finally:
            c.close()

    before = backends.requests("r1")
    assert run(go()) == "reset"
    assert backends.requests("r1") - before == 2  # the warm-up and the one that was reset: no third


CLOSED_IDLE = {  # after a first answer from r1, which then closes its kept-alive connection: the steps, r1's count
    # the close arrived but the loop has not run since (blocked here on purpose): the socket, asked before reuse,
    # says so; then the loop sees the close, and the pool drops the connection before the next request
    "the loop blocked": (["block", "r1", "sleep", "r1"], 3),
    # the loop has read since (another connection's answer): it saw the close in that turn (the socket not asked)
    "the loop read since": (["sleep", "r2", "r1"], 2),
}


@pytest.mark.parametrize("run", LOOPS.values(), ids=LOOPS.keys())
@pytest.mark.parametrize(("steps", "r1"), CLOSED_IDLE.values(), ids=CLOSED_IDLE.keys())
def test_a_kept_alive_connection_closed_while_it_idled_is_replaced_before_the_request_is_written(
        backends: Backends, run: Callable[[Any], Any], steps: list[str], r1: int) -> None:
    """The request after the close goes once, on a fresh connection, as no failure at all. The attack on a
    liveness check that trusts the loop: with the check skipped outright, the request after the close fails with
    a reset."""
    async def go() -> list[int]:
        c = Client()
        try:
            backends.mode("r1", "close_idle")  # answers, then closes the kept-alive connection
            got = [await _send(c, backends.url("r1"))]
            for step in steps:
                if step == "block":
                    time.sleep(0.2)  # blocking on purpose: the loop must not see the close before the next request
                elif step == "sleep":
                    await asyncio.sleep(0.2)  # the loop runs: the close comes in
                else:
                    got.append(await _send(c, backends.url(step)))
            return got
        finally:
            c.close()

    before = backends.requests("r1")
    assert run(go()) == [200] * (1 + sum(step.startswith("r") for step in steps))
    assert backends.requests("r1") - before == r1


class Polls:
    """An idle connection's ``poll``, counted: whether ``unused`` asked the socket."""

    def __init__(self, conn: Any) -> None:
        self.real, self.calls = conn.poll, 0
        conn.poll = self

    def poll(self, timeout: int) -> list[tuple[int, int]]:
        self.calls += 1
        return self.real.poll(timeout)  # type: ignore[no-any-return]


@pytest.mark.parametrize(("loop", "paused", "asked"), [("uvloop", False, 0), ("uvloop", True, 1),
                                                      ("asyncio", False, 1)], ids=["uvloop", "paused", "asyncio"])
def test_a_connection_idle_since_the_loop_read_is_taken_without_asking_its_socket(backends: Backends, loop: str,
                                                                                  paused: bool, asked: int) -> None:
    """On uvloop a read handed on since the connection went idle means the loop's I/O phase ran since, and saw
    any close that came before it: the socket is not asked again (a syscall per request). Not while its reading is
    paused (the loop reads nothing of it), and not on asyncio's loop, which runs its I/O after the callbacks already
    queued: there it is asked."""
    async def go() -> tuple[int, int, bool]:
        c = Client()
        try:
            assert await _send(c, backends.url("r1")) == 200
            pool = c.pools[("http", "127.0.0.1", backends.ports["r1"])]
            (conn,) = pool.idle
            polls = Polls(conn)
            conn.paused = paused
            assert await _send(c, backends.url("r2")) == 200  # reads on another connection: the loop turned
            status = await _send(c, backends.url("r1"))
            return status, polls.calls, list(pool.idle) == [conn]
        finally:
            c.close()

    before = backends.requests("r1")
    assert LOOPS[loop](go()) == (200, asked, True)  # the same connection carried it, and is back in its pool
    assert backends.requests("r1") - before == 2


def test_a_connection_taken_again_before_the_loop_read_asks_its_socket(backends: Backends) -> None:
    """Released and taken in the same turn of the loop (nothing read since, as under load): its socket is asked."""
    async def go() -> int:
        c = Client()
        try:
            assert await _send(c, backends.url("r1")) == 200
            pool = c.pools[("http", "127.0.0.1", backends.ports["r1"])]
            polls = Polls(pool.idle[0])
            conn = pool.take()
            assert conn is not None
            conn.close()
            return polls.calls
        finally:
            c.close()

    assert uvloop.run(go()) == 1


@pytest.mark.parametrize("run", LOOPS.values(), ids=LOOPS.keys())
def test_a_write_that_fails_at_once_goes_again_on_a_fresh_connection(backends: Backends, run: Callable[[Any], Any],
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Nothing reached the upstream (the socket takes no more writes): the one case besides a close seen
    before writing where the request may go again, and it does, once."""
    monkeypatch.setattr(upstream._Conn, "unused", lambda self: not self.closed)  # let the broken one through

    async def go() -> int:
        c = Client()
        try:
            assert await _send(c, backends.url("r1")) == 200
            (pool,) = c.pools.values()
            (conn,) = pool.idle
            assert conn.sock is not None
            conn.sock.shutdown(socket.SHUT_WR)  # a write now fails at once (EPIPE)
            return await _send(c, backends.url("r1"))
        finally:
            c.close()

    before = backends.requests("r1")
    assert run(go()) == 200
    assert backends.requests("r1") - before == 2


# -- 6. ... and through the gateway: every request a backend saw is in X-Tensora-Attempts -----------------


def test_a_reset_after_a_hold_is_listed_as_often_as_the_backend_saw_the_request(backends: Backends) -> None:
    table = make_table([{"id": "wl_main", "name": "my-llm", "owner": "alice", "fallback_models": ["small"],
                         "replicas": [replica("r1", backends.url("r1")), replica("r2", backends.url("r2"))]},
                        {"id": "wl_small", "name": "small", "owner": "alice",
                         "replicas": [replica("f1", backends.url("f1"))]}], KEYS)
    with serving(gateway(table)) as url:
        warm = [post(url, chat()) for _ in range(2)]  # a kept-alive connection to each replica
        for n in ("r1", "r2"):
            backends.mode(n, "hold_reset", hold_s=0.3)
        before = {n: backends.requests(n) for n in ("r1", "r2", "f1")}
        r = post(url, chat())
    assert all(w.status_code == 200 for w in warm)
    assert r.status_code == 200 and r.headers["x-tensora-served-by"] == "fallback-model"
    assert sorted(tried(r)) == ["my-llm/r1:reset", "my-llm/r2:reset", "small/f1:ok"]
    for n, key in (("r1", "my-llm/r1"), ("r2", "my-llm/r2"), ("f1", "small/f1")):
        assert backends.requests(n) - before[n] == sum(a.startswith(key + ":") for a in tried(r)), n


# -- 5. one retry of a tier's only backend ---------------------------------------------------------------


RETRIED = {  # name -> (r1's mode, its knobs, X-Tensora-Attempts, who answers)
    "a 503 that clears": ("http_503", {"times": 1}, ["my-llm/r1:http_503", "my-llm/r1:ok"], "r1"),
    "a 500 that stays": ("http_500", {}, ["my-llm/r1:http_500", "my-llm/r1:http_500", "small/f1:ok"], "f1"),
    "a dropped connection": ("close", {"times": 1}, ["my-llm/r1:reset", "my-llm/r1:ok"], "r1"),
    "a reset after a hold": ("hold_reset", {"hold_s": 0.1},
                             ["my-llm/r1:reset", "my-llm/r1:reset", "small/f1:ok"], "f1"),
    "a 400 is the caller's: never": ("http_400", {}, ["my-llm/r1:http_400"], None),
    "a 429 is busy: never (the next tier)": ("http_429", {}, ["my-llm/r1:http_429", "small/f1:ok"], "f1"),
    "a timeout: never": ("stall_head", {}, ["my-llm/r1:timeout", "small/f1:ok"], "f1"),
}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize(("fault", "knobs", "attempts", "answers"), RETRIED.values(), ids=RETRIED.keys())
def test_a_5xx_or_a_reset_from_a_tiers_only_backend_is_tried_once_more_there(
        backends: Backends, fault: str, knobs: dict[str, Any], attempts: list[str], answers: str | None,
        stream: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(random, "uniform", lambda a, b: a + (b - a) * 0.277)  # a jitter the test knows
    delay = 0.2 * (0.5 + (1.5 - 0.5) * 0.277)  # the one the walk computes from retry_delay_s, to the bit
    slept: list[float] = []
    sleep = asyncio.sleep

    async def sleeping(s: float, *a: Any, **kw: Any) -> Any:
        slept.append(s)
        return await sleep(s, *a, **kw)

    with serving(gateway(lone(backends), retry_delay_s=0.2)) as url:
        post(url, chat())  # a warm connection, so that the reset ones are on a reused one
        backends.mode("r1", fault, **knobs)
        before = backends.requests("r1")
        monkeypatch.setattr(asyncio, "sleep", sleeping)
        r = post(url, chat(stream=stream))
        monkeypatch.setattr(asyncio, "sleep", sleep)
    assert tried(r) == attempts, r.text
    retried = attempts.count(attempts[0]) == 2 or attempts[1:2] == ["my-llm/r1:ok"]
    assert slept.count(delay) == (1 if retried else 0), slept  # the jittered delay came before the retry only
    assert backends.requests("r1") - before == sum(a.startswith("my-llm/r1:") for a in attempts)  # none unseen
    if answers is None:
        assert r.status_code == 400 and r.json()["error"]["code"] == 400
        return
    assert r.status_code == 200
    text = "".join((orjson.loads(e)["choices"] or [{}])[0].get("delta", {}).get("content") or ""
                   for e in sse_payloads(r.text)[:-1]) if stream else r.json()["choices"][0]["message"]["content"]
    assert text.startswith(f"{answers}:")


def test_no_retry_in_a_tier_of_two_and_none_when_the_deadline_leaves_no_room(backends: Backends) -> None:
    two = make_table([{"id": "wl_main", "name": "my-llm", "owner": "alice",
                       "replicas": [replica("r1", backends.url("r1")), replica("r2", backends.url("r2"))]}], KEYS)
    for n in ("r1", "r2"):
        backends.mode(n, "http_503")
    clock = FakeClock(1000.0)  # it stands still: the whole deadline is left at every step
    with serving(gateway(two)) as url:
        pair = post(url, chat())
    with serving(gateway(lone(backends), clock=clock, deadline_s=1.05)) as url:  # 1.05 - delay < 1 s of room
        tight = post(url, chat())
    with serving(gateway(lone(backends), clock=clock, deadline_s=1.2)) as url:  # 1.2 - 0.15 >= 1 s
        roomy = post(url, chat())
    assert pair.status_code == 503 and sorted(tried(pair)) == ["my-llm/r1:http_503", "my-llm/r2:http_503"]
    assert tight.status_code == 200 and tried(tight) == ["my-llm/r1:http_503", "small/f1:ok"]
    assert roomy.status_code == 200 and tried(roomy) == ["my-llm/r1:http_503", "my-llm/r1:http_503", "small/f1:ok"]


def test_the_retry_counts_both_failures_and_never_outruns_the_breaker(backends: Backends) -> None:
    backends.mode("r1", "http_503")
    gw = gateway(lone(backends), breaker=Policy(consecutive=2, base_s=30))
    with serving(gw) as url:
        r = post(url, chat())
        again = post(url, chat())
    assert tried(r) == ["my-llm/r1:http_503", "my-llm/r1:http_503", "small/f1:ok"]
    assert gw.breakers["my-llm/r1"].open_until is not None  # two failures in a row: open
    assert tried(again) == ["my-llm/r1:breaker_open", "small/f1:ok"]
    one = gateway(lone(backends), breaker=Policy(consecutive=1, base_s=30))
    with serving(one) as url:
        first = post(url, chat())
    assert tried(first) == ["my-llm/r1:http_503", "small/f1:ok"]  # its first failure opened it: no retry


# -- 4. a stream that stalls after its first token --------------------------------------------------------


STALLS = {  # name -> (the endpoint's spec, the gateway's options)
    "the endpoint's stream_idle_s": ({"stream_idle_s": 0.3}, {}),
    "the gateway's default": ({}, {"stream_idle_s": 0.3}),
}


@pytest.mark.timeout(20)  # held to the 30 s deadline instead of the idle limit: a failure, not a wait
@pytest.mark.parametrize(("spec", "opts"), STALLS.values(), ids=STALLS.keys())
def test_a_stream_that_stalls_after_its_first_tokens_ends_with_the_error_event_and_done(
        backends: Backends, spec: dict[str, Any], opts: dict[str, Any]) -> None:
    backends.mode("r1", "stall_mid_stream")  # three tokens, then silence on an open connection
    gw = gateway(lone(backends, **spec), deadline_s=30.0, breaker=Policy(consecutive=1, base_s=30), **opts)
    with serving(gw) as url:
        r = post(url, chat(stream=True))
        after = post(url, chat(stream=True))
    assert r.status_code == 200
    events = sse_payloads(r.text)
    assert events[-1] == "[DONE]"
    err = orjson.loads(events[-2])["error"]
    assert err["code"] == "upstream_failed" and "(stream_idle)" in err["message"]  # not "(timeout)": the deadline
    text = "".join(orjson.loads(e)["choices"][0]["delta"].get("content") or "" for e in events[:-2])
    assert text.startswith("r1:0") and "f1" not in text
    assert gw.breakers["my-llm/r1"].open_until is not None  # the backend's failure: its breaker opened
    assert tried(after) == ["my-llm/r1:breaker_open", "small/f1:ok"]


def test_a_stream_with_events_within_the_idle_limit_is_not_cut(backends: Backends) -> None:
    gw = gateway(lone(backends, stream_idle_s=0.3), deadline_s=30.0, breaker=Policy(consecutive=1, base_s=30))
    with serving(gw) as url:
        r = post(url, chat(stream=True))
    events = sse_payloads(r.text)
    assert r.status_code == 200 and events[-1] == "[DONE]" and "error" not in r.text
    assert not gw.breakers["my-llm/r1"].open_until


# -- the invariant, over any mix of faults -----------------------------------------------------------------


FAULTS = ["ok", "http_500", "http_503", "http_429", "http_400", "close", "hold_reset", "stall_mid_stream"]


def test_every_request_a_backend_saw_is_in_the_attempts_once_whatever_the_faults(backends: Backends) -> None:
    """Whatever r1 and f1 do (and for how many requests), each request that reached one of them is listed
    in X-Tensora-Attempts, and no backend is listed more than twice (the one retry)."""
    keys = {"r1": "my-llm/r1", "f1": "small/f1"}
    with serving(gateway(lone(backends, stream_idle_s=0.2), retry_delay_s=0.02)) as url:

        @settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
        @given(faults=st.fixed_dictionaries({n: st.tuples(st.sampled_from(FAULTS), st.sampled_from([None, 1]))
                                             for n in keys}), stream=st.booleans())
        def one(faults: dict[str, tuple[str, int | None]], stream: bool) -> None:
            for n, (m, times) in faults.items():
                backends.mode(n, m, hold_s=0.05, **({"times": times} if times else {}))
            before = {n: backends.requests(n) for n in keys}
            r = post(url, chat(stream=stream))
            listed = tried(r)
            for n, key in keys.items():
                mine = [a for a in listed if a.startswith(key + ":")  # skipped at once: nothing was sent
                        and not a.endswith((":breaker_open", ":rate_limited"))]
                assert backends.requests(n) - before[n] == len(mine), (n, faults, listed)
                assert len(mine) <= 2, listed

        one()


def test_the_gateway_settings_reach_the_conduct(tmp_path: Any) -> None:
    from tensora.gateway.app import GatewaySettings

    o = GatewaySettings(data_dir=tmp_path, stream_idle_s=7, retry_delay_s=0.3).options()
    assert (o.stream_idle_s, o.retry_delay_s) == (7, 0.3)
    assert GatewaySettings(data_dir=tmp_path).options().stream_idle_s == Options().stream_idle_s == 30.0
