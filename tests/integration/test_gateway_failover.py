"""The gateway's failover conduct against fake backends that fail on purpose:
ejected backends probed actively and back within seconds of their recovery, a backend's 429 and its
Retry-After respected, a request too long for the model sent to the fallback models (and other 4xx
passed through, never retried). Fake clock where timing is the rule; one real-time return-to-primary."""

from __future__ import annotations

import asyncio
import email.utils
import logging
import time
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from tensora.gateway.app import GatewaySettings, build
from tensora.gateway.breaker import Policy
from tensora.gateway.chain import Backend, Peer, ServedBy
from tensora.gateway.limits import MemoryLimiter
from tensora.gateway.probe import Prober, probe_url
from tensora.gateway.proxy import Gateway, Options
from tensora.gateway.routes import RouteTable
from tensora.gateway.walk import context_exceeded, retry_after
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
REPLICA_KEY = "k1-own-key"
OPENAI_CONTEXT = {"message": "This model's maximum context length is 8192 tokens. However, your messages resulted "
                  "in 9001 tokens.", "type": "invalid_request_error", "param": "messages",
                  "code": "context_length_exceeded"}
VLLM_CONTEXT = {"message": "This model's maximum context length is 4096 tokens. However, you requested 5000 tokens "
                "(4000 in the messages, 1000 in the completion).", "type": "BadRequestError", "param": None,
                "code": 400}
VLLM_V1_CONTEXT = {"message": "The decoder prompt (length 5000) is longer than the maximum model length of 4096.",
                   "type": "BadRequestError", "param": None, "code": 400}


backends = backends_fixture(["r1", "c1", "s1", "f1", "g1", "k1"], api_keys={"k1": REPLICA_KEY})


@pytest.fixture(autouse=True)
def _reset(backends: Backends) -> None:
    backends.reset()


def table(b: Backends, contexts: tuple[int | None, int | None, int | None] = (None, None, None),
          **main: Any) -> RouteTable:
    """my-llm: r1, then CPU c1, then the pool's s1, then fallback models small (f1) and big (g1);
    ``contexts``: the known context lengths of my-llm (and the pool's, the same model), small and big."""
    return make_table([
        {"id": "wl_main", "name": "my-llm", "owner": "alice", "cpu_fallback": True,
         "fallback_models": ["small", "big"],
         "replicas": [replica("r1", b.url("r1")), replica("c1", b.url("c1"), cpu=True)], "context": contexts[0],
         **main},
        {"id": "wl_pool", "name": "m-shared", "owner": "ops", "serverless": True, "context": contexts[0],
         "replicas": [replica("s1", b.url("s1"))]},
        {"id": "wl_small", "name": "small", "owner": "alice", "model": "/models/s", "context": contexts[1],
         "replicas": [replica("f1", b.url("f1"), model="/models/s")]},
        {"id": "wl_big", "name": "big", "owner": "alice", "model": "/models/b", "context": contexts[2],
         "replicas": [replica("g1", b.url("g1"), model="/models/b")]},
        {"id": "wl_keyed", "name": "keyed", "owner": "alice", "model": None,
         "replicas": [replica("k1", b.url("k1"), api_key=REPLICA_KEY)]},
    ], KEYS)


def gateway(t: RouteTable, *, clock: Any = None, peers: tuple[Peer, ...] = (), **opts: Any) -> Gateway:
    o = Options(ttft_s=1.0, deadline_s=5.0, breaker=Policy(consecutive=1, base_s=30, max_s=300), peers=peers)
    for k, v in opts.items():
        setattr(o, k, v)
    return Gateway(o, lambda: t, MemoryLimiter(), None, **({"clock": clock} if clock is not None else {}))


def post(url: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{url}/chat/completions", json=body, headers={"Authorization": f"Bearer {ALICE}"}, timeout=30)


def trail(r: httpx.Response) -> str:
    return r.headers["x-tensora-attempts"]


def probe_round(p: Prober) -> int:
    async def go() -> int:
        async with httpx.AsyncClient() as client:
            return await p.round(client)
    return asyncio.run(go())


# -- pure decisions ------------------------------------------------------------------------------


def _err(obj: dict[str, Any], top: bool = False) -> bytes:
    return orjson.dumps(obj if top else {"error": obj})


CONTEXT = [
    ("openai's code", _err(OPENAI_CONTEXT), True),
    ("vllm's message", _err(VLLM_CONTEXT), True),
    ("vllm before 0.8: its fields at the top", _err({"object": "error", **VLLM_CONTEXT}, top=True), True),
    ("vllm v1's message", _err(VLLM_V1_CONTEXT), True),
    ("max_tokens too large for the context", _err({"message": "'max_tokens' or 'max_completion_tokens' is too "
                                                  "large: 8000. This model's maximum context length is 4096 tokens "
                                                  "and your request has 2778 input tokens", "code": 400}), True),
    ("a content filter", _err({"message": "rejected by our safety system", "code": "content_filter"}), False),
    ("an invalid request", _err({"message": "temperature must be <= 2", "code": None}), False),
    ("the words, but in the param, not the message", _err({"message": "bad", "param": "maximum context length"}),
     False),
    ("not json", b"maximum context length exceeded, in plain text", False),
    ("a list", b'["maximum context length"]', False),
]


@pytest.mark.parametrize(("name", "body", "expected"), CONTEXT, ids=[c[0] for c in CONTEXT])
def test_what_counts_as_a_context_length_error(name: str, body: bytes, expected: bool) -> None:
    assert context_exceeded(body) is expected, name


RETRY = [
    ("none", {}, None),
    ("seconds", {b"retry-after": b"2"}, 2.0),
    ("fractional seconds", {b"retry-after": b" 0.25 "}, 0.25),
    ("ms first", {b"retry-after-ms": b"1500", b"retry-after": b"9"}, 1.5),
    ("bad ms: the seconds", {b"retry-after-ms": b"soon", b"retry-after": b"9"}, 9.0),
    ("negative", {b"retry-after": b"-3"}, None),
    ("not a number", {b"retry-after": b"inf"}, None),
    ("garbage", {b"retry-after": b"whenever"}, None),
    ("a date in the past", {b"retry-after": b"Wed, 21 Oct 2015 07:28:00 GMT"}, 0.0),
]


@pytest.mark.parametrize(("name", "headers", "expected"), RETRY, ids=[c[0] for c in RETRY])
def test_how_long_a_429_asks_to_wait(name: str, headers: dict[bytes, bytes], expected: float | None) -> None:
    assert retry_after(headers.get) == expected, name


def test_a_retry_after_date_in_the_future() -> None:
    when = email.utils.formatdate(time.time() + 60, usegmt=True).encode()
    got = retry_after({b"retry-after": when}.get)
    assert got is not None and 58 <= got <= 60


# -- 1. active probes ------------------------------------------------------------------------------


def test_an_ejected_backend_is_probed_and_back_after_two_good_probes_not_after_its_cooldown(
        backends: Backends) -> None:
    clock = FakeClock(1000.0)
    gw = gateway(table(backends), clock=clock)
    prober = Prober(gw)
    backends.mode("r1", "down")
    with serving(gw) as url:
        first = post(url, chat())
        assert trail(first) == "my-llm/r1:http_503,my-llm/c1:ok"
        breaker = gw.breakers["my-llm/r1"]
        until = breaker.open_until
        assert until == clock.now() + 30 and set(gw.ejected) == {"my-llm/r1"}
        assert trail(post(url, chat())) == "my-llm/r1:breaker_open,my-llm/c1:ok"
        for _ in range(3):  # still down: failed probes, and the ejection is not made any longer
            clock.advance(2)
            assert probe_round(prober) == 1
        assert breaker.open_until == until and breaker.ejections == 1 and backends.probes("r1") == 3
        backends.mode("r1", "ok")
        clock.advance(2)
        probe_round(prober)
        assert trail(post(url, chat())) == "my-llm/r1:breaker_open,my-llm/c1:ok"  # one good probe: not yet
        clock.advance(2)
        probe_round(prober)
        back = post(url, chat())  # 10 s after the ejection, 20 s before its cooldown would have ended
        assert probe_round(prober) == 0  # nothing ejected: nothing probed
    assert trail(back) == "my-llm/r1:ok" and back.headers["x-tensora-served-by"] == "replica"
    assert gw.ejected == {} and breaker.ejections == 0


@pytest.mark.timeout(60)
def test_traffic_is_back_on_a_recovered_backend_after_its_good_probes_in_real_time(backends: Backends) -> None:
    """The prober running on the gateway's loop brings a recovered backend back by its good probes, long before
    its 30 s cooldown would have."""
    gw = gateway(table(backends))
    prober = Prober(gw, interval_s=2.0)
    tasks: list[asyncio.Task[None]] = []

    async def start() -> None:
        tasks.append(asyncio.create_task(prober.run()))

    async def stop() -> None:
        tasks[0].cancel()

    gw.on_startup.append(start)
    gw.on_shutdown.append(stop)
    backends.mode("r1", "down")
    with serving(gw) as url:
        assert trail(post(url, chat())) == "my-llm/r1:http_503,my-llm/c1:ok"
        time.sleep(2.5)  # a probe round or so while it is still down
        assert trail(post(url, chat())) == "my-llm/r1:breaker_open,my-llm/c1:ok"
        breaker = gw.breakers["my-llm/r1"]
        cooled = breaker.open_until
        assert cooled is not None and breaker.ejections == 1
        probes = backends.probes("r1")
        backends.mode("r1", "ok")
        while (tried := trail(post(url, chat()))) != "my-llm/r1:ok":  # a hang: the timeout mark fails it
            assert tried == "my-llm/r1:breaker_open,my-llm/c1:ok", tried
            time.sleep(0.05)
        back_at = gw.clock()
    assert back_at < cooled  # back by its probes, on the gateway's own clock, before the cooldown would end
    assert backends.probes("r1") - probes >= 2  # probe_successes 2: two good probes came first
    assert gw.ejected == {} and breaker.ejections == 0  # closed by a good probe, which forgives the ejection


def test_the_prober_sends_the_replicas_own_key_and_peers_get_healthz(backends: Backends) -> None:
    clock = FakeClock(1000.0)
    t = table(backends)
    gw = gateway(t, clock=clock)
    backends.mode("k1", "down")
    with serving(gw) as url:
        r = httpx.post(f"{url}/chat/completions", json=chat(model="keyed"),
                       headers={"Authorization": f"Bearer {ALICE}"}, timeout=30)
        assert r.status_code == 503 and trail(r) == "keyed/k1:http_503"
        backends.mode("k1", "ok")  # it answers 401 to a probe without its key: closing proves the key went
        prober = Prober(gw)
        probe_round(prober)
        probe_round(prober)
    assert gw.breakers["keyed/k1"].open_until is None
    peer = Backend("peer:us", "https://us.example/v1", "m", "m", ServedBy.REPLICA, "wl", "us", peer=True)
    assert probe_url(peer) == "https://us.example/healthz"  # its /v1/models would want the caller's key


def test_a_replica_gone_from_the_route_table_is_no_longer_probed(backends: Backends) -> None:
    clock = FakeClock(1000.0)
    tables = [table(backends)]
    gw = gateway(tables[0], clock=clock)
    gw.table = lambda: tables[0]
    backends.mode("r1", "down")
    with serving(gw) as url:
        post(url, chat())
    prober = Prober(gw)
    assert probe_round(prober) == 1
    tables[0] = make_table([{"id": "wl_main", "name": "my-llm", "owner": "alice",
                             "replicas": [replica("c1", backends.url("c1"))]}], KEYS)
    assert probe_round(prober) == 0 and gw.ejected == {}


def test_the_gateway_starts_its_prober_again_should_it_end(tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TENSORA_GATEWAY_KEY", "k")
    gw = build(GatewaySettings(data_dir=tmp_path, control_url="http://127.0.0.1:9", probe_interval_s=0.01,
                               startup_grace_s=60))
    runs: list[int] = []

    async def run() -> None:
        runs.append(1)
        if len(runs) == 1:
            raise SystemError("what the prober does not catch")
        await asyncio.sleep(3600)

    monkeypatch.setattr(gw.prober, "run", run)
    with caplog.at_level(logging.CRITICAL, "tensora.gateway"), serving(gw):
        deadline = time.monotonic() + 10
        while len(runs) < 2:
            assert time.monotonic() < deadline, caplog.text
            time.sleep(0.02)
    assert "the prober stopped" in caplog.text and "SystemError" in caplog.text


# -- 2. context length -----------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("error", [OPENAI_CONTEXT, VLLM_CONTEXT, VLLM_V1_CONTEXT], ids=["openai", "vllm", "vllm-v1"])
def test_a_request_too_long_for_the_model_skips_its_tiers_for_the_fallback_models(
        backends: Backends, error: dict[str, Any], stream: bool) -> None:
    backends.mode("r1", "http_400", error=error)
    before = backends.requests("c1"), backends.requests("s1")
    with serving(gateway(table(backends))) as url:
        r = post(url, chat(stream=stream))
    assert r.status_code == 200, r.text
    assert trail(r) == "my-llm/r1:context_length_exceeded,small/f1:ok"
    assert r.headers["x-tensora-served-by"] == "fallback-model"
    answer = sse_payloads(r.text)[1] if stream else r.text
    assert "f1:" in answer and '"model":"small"' in answer.replace(" ", "")
    assert (backends.requests("c1"), backends.requests("s1")) == before  # the same model: never asked


def test_each_fallback_model_too_small_is_passed_and_the_last_ones_400_comes_through(backends: Backends) -> None:
    for name in ("r1", "f1", "g1"):
        backends.mode(name, "http_400", error=OPENAI_CONTEXT | {"message": f"{name}: too long"})
    with serving(gateway(table(backends))) as url:
        r = post(url, chat())
    assert r.status_code == 400
    assert r.json()["error"] == OPENAI_CONTEXT | {"message": "g1: too long"}
    assert trail(r) == ("my-llm/r1:context_length_exceeded,small/f1:context_length_exceeded,"
                        "big/g1:context_length_exceeded")


def test_no_fallback_models_the_context_error_passes_through_as_the_model_server_said_it(
        backends: Backends) -> None:
    backends.mode("r1", "http_400", error=VLLM_CONTEXT)
    before = backends.requests("c1")
    with serving(gateway(table(backends, fallback_models=[]))) as url:
        r = post(url, chat())
    assert r.status_code == 400 and r.json()["error"] == VLLM_CONTEXT
    assert trail(r) == "my-llm/r1:context_length_exceeded" and backends.requests("c1") == before


# at least (8000 + 16) // 8 + 100 = 1102 tokens of context: the prompt at 8 characters a token, and max_tokens
LONG = chat(messages=[{"role": "user", "content": "x" * 8000}], max_tokens=100)


def test_a_prompt_longer_than_the_known_context_goes_to_a_fallback_model_that_can_take_it(backends: Backends) -> None:
    before = {n: backends.requests(n) for n in ("r1", "c1", "s1", "f1")}
    with serving(gateway(table(backends, contexts=(1024, 512, 32768)))) as url:
        r = post(url, LONG)
        short = post(url, chat(max_tokens=100))  # fits my-llm: its own replica answers
    assert r.status_code == 200, r.text
    assert trail(r) == ("my-llm/r1:context_too_small,my-llm/c1:context_too_small,m-shared/s1:context_too_small,"
                        "small/f1:context_too_small,big/g1:ok")
    assert {n: backends.requests(n) for n in before} == {**before, "r1": before["r1"] + 1}  # only `short`
    assert short.status_code == 200 and trail(short) == "my-llm/r1:ok"


def test_a_prompt_no_known_context_can_take_is_a_400_and_nothing_is_sent(backends: Backends) -> None:
    before = backends.requests("r1"), backends.requests("g1")
    with serving(gateway(table(backends, contexts=(1024, 512, 1024)))) as url:
        r = post(url, LONG)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert r.json()["error"]["param"] == "messages" and "1102 tokens" in r.json()["error"]["message"]
    assert (backends.requests("r1"), backends.requests("g1")) == before


def test_an_unknown_context_is_tried_as_before(backends: Backends) -> None:
    with serving(gateway(table(backends, contexts=(None, None, None)))) as url:
        r = post(url, LONG)
    assert r.status_code == 200 and trail(r) == "my-llm/r1:ok"


def test_after_a_context_error_the_fallback_model_with_the_larger_known_context_goes_first(
        backends: Backends) -> None:
    backends.mode("r1", "http_400", error=OPENAI_CONTEXT)
    with serving(gateway(table(backends, contexts=(None, 8192, 65536)))) as url:
        r = post(url, chat())
    assert r.status_code == 200 and trail(r) == "my-llm/r1:context_length_exceeded,big/g1:ok"

def test_a_fallback_model_failing_otherwise_moves_on_and_nothing_left_is_a_503(backends: Backends) -> None:
    backends.mode("r1", "http_400", error=OPENAI_CONTEXT)
    backends.mode("f1", "http_500")
    with serving(gateway(table(backends))) as url:
        on = post(url, chat())
        backends.mode("g1", "http_503")
        none = post(url, chat())
    assert trail(on) == "my-llm/r1:context_length_exceeded,small/f1:http_500,big/g1:ok"
    assert none.status_code == 503 and trail(none) == ("small/f1:breaker_open,my-llm/r1:context_length_exceeded,"
                                                       "big/g1:http_503")


@pytest.mark.parametrize(("mode", "error"), [
    ("http_400", {"message": "Your request was rejected as a result of our safety system.",
                  "type": "invalid_request_error", "param": None, "code": "content_filter"}),
    ("http_400", {"message": "'messages' must contain the word 'json'", "type": "invalid_request_error",
                  "param": "messages", "code": None}),
    ("http_422", {"message": "temperature: must be <= 2", "type": "BadRequestError", "param": None, "code": 422}),
], ids=["content-filter", "invalid-request", "unprocessable"])
def test_other_client_errors_pass_through_unchanged_and_are_never_retried(
        backends: Backends, mode: str, error: dict[str, Any]) -> None:
    backends.mode("r1", mode, error=error)
    others = ("c1", "s1", "f1", "g1")
    with serving(gateway(table(backends))) as url:
        before = [backends.requests(n) for n in ("r1", *others)]
        r = post(url, chat())
    assert r.status_code == int(mode[5:]) and r.json() == {"error": error}
    assert trail(r) == f"my-llm/r1:{mode}"
    assert [backends.requests(n) for n in ("r1", *others)] == [before[0] + 1, *before[1:]]  # once, and only there


# -- 3. 429 ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(("headers", "skip_s"), [
    ({"retry-after": "2"}, 2.0),
    ({"retry-after-ms": "1500", "retry-after": "9"}, 1.5),  # the finer one wins, as in OpenAI's SDK
    ({"retry-after": "100000"}, 300.0),  # bounded: at most the breaker's max_s
], ids=["seconds", "ms", "bounded"])
def test_a_429s_retry_after_makes_the_backend_skipped_until_then(backends: Backends, headers: dict[str, str],
                                                                  skip_s: float) -> None:
    clock = FakeClock(1000.0)
    gw = gateway(table(backends), clock=clock)
    backends.mode("r1", "http_429", headers=headers)
    with serving(gw) as url:
        first = post(url, chat())
        hits = backends.requests("r1")
        clock.advance(skip_s - 0.01)
        skipped = post(url, chat())
        assert backends.requests("r1") == hits  # nothing sent to it
        backends.mode("r1", "ok")
        clock.advance(0.02)
        back = post(url, chat())
    assert trail(first) == "my-llm/r1:http_429,my-llm/c1:ok"
    assert trail(skipped) == "my-llm/r1:rate_limited,my-llm/c1:ok"
    assert trail(back) == "my-llm/r1:ok"
    assert gw.breakers["my-llm/r1"].failures == 0 and gw.ejected == {}  # busy is not broken


def test_a_429_without_retry_after_gets_a_short_jittered_backoff(backends: Backends) -> None:
    clock = FakeClock(1000.0)
    gw = gateway(table(backends), clock=clock)
    backends.mode("r1", "http_429")
    waits = []
    with serving(gw) as url:
        for _ in range(8):
            clock.advance(10)
            assert trail(post(url, chat())) == "my-llm/r1:http_429,my-llm/c1:ok"
            until = gw.breakers["my-llm/r1"].busy_until
            assert until is not None
            waits.append(until - clock.now())
    assert all(0.5 <= w <= 1.5 for w in waits) and len(set(waits)) > 1, waits


def test_every_tier_exhausted_the_503_carries_the_soonest_retry_after_of_all(backends: Backends) -> None:
    clock = FakeClock(1000.0)
    gw = gateway(table(backends, fallback_models=[]), clock=clock)
    backends.mode("r1", "http_429", headers={"retry-after": "7"})
    backends.mode("c1", "http_429", headers={"retry-after-ms": "2500"})
    backends.mode("s1", "http_503")  # its breaker opens for 30 s
    with serving(gw) as url:
        r = post(url, chat())
        clock.advance(1)
        again = post(url, chat())
    assert r.status_code == 503 and trail(r) == "my-llm/r1:http_429,my-llm/c1:http_429,m-shared/s1:http_503"
    assert r.headers["retry-after"] == "3" and r.headers["retry-after-ms"] == "2500"
    assert again.status_code == 503 and again.headers["retry-after"] == "2"
    assert trail(again) == "m-shared/s1:breaker_open,my-llm/r1:rate_limited,my-llm/c1:rate_limited"


def test_a_peer_gateways_429_is_this_callers_alone_and_never_skips_the_peer_for_others(backends: Backends) -> None:
    clock = FakeClock(1000.0)
    gw = gateway(table(backends, fallback_models=[], cpu_fallback=False, model=None, allow_cross_region=True),
                 clock=clock, peers=(Peer("us", backends.url("g1")),))
    backends.mode("r1", "http_503")
    backends.mode("g1", "http_429", headers={"retry-after": "4"})
    with serving(gw) as url:
        r = post(url, chat())
        clock.advance(31)
        backends.mode("g1", "ok")
        again = post(url, chat())
    assert r.status_code == 503 and r.headers["retry-after"] == "4"
    assert trail(r) == "my-llm/r1:http_503,peer:us:http_429"
    assert again.status_code == 200 and trail(again).endswith("peer:us:ok")
