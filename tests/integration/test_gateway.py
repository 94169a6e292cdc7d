"""The gateway against real processes: fake OpenAI backends that refuse, fail, stall or die on demand,
and gateways on loopback. Every chain tier, the streaming rule, breakers on a fake clock, keys,
rate limits (in memory and across two gateways sharing a real Redis), headers, and the openai client."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import orjson
import pytest

from tensora.gateway.breaker import Policy
from tensora.gateway.chain import Peer
from tensora.gateway.limits import Caller, MemoryLimiter, Quota, RedisLimiter
from tensora.gateway.proxy import Gateway, Options
from tensora.gateway.routes import RouteTable
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
from tests.support.services import free_port

pytestmark = pytest.mark.timeout(120)

ALICE = apikeys.generate()
BOB = apikeys.generate()
NO_INFERENCE = apikeys.generate()
KEYS = {ALICE: ("alice", ["inference"]), BOB: ("bob", ["inference"]), NO_INFERENCE: ("alice", ["workloads:read"])}
FAILURES = ["http_500", "http_503", "http_429", "close", "stall_head"]
REPLICA_KEY = "k1-replica-key"  # what the control API's route table gives the gateway for replica k1


backends = backends_fixture(["r1", "r2", "c1", "s1", "f1", "us1", "k1"], api_keys={"k1": REPLICA_KEY})


@pytest.fixture(autouse=True)
def _reset(backends: Backends) -> None:
    backends.reset()


def endpoints(b: Backends, **main: Any) -> list[dict[str, Any]]:
    return [
        {"id": "wl_main", "name": "my-llm", "owner": "alice", "cpu_fallback": True, "fallback_models": ["small"],
         "allow_cross_region": True, "replicas": [replica("r1", b.url("r1")), replica("c1", b.url("c1"), cpu=True)],
         **main},
        {"id": "wl_pool", "name": "m-shared", "owner": "ops", "serverless": True,
         "replicas": [replica("s1", b.url("s1"))]},
        {"id": "wl_small", "name": "small", "owner": "alice", "model": "/models/s",
         "replicas": [replica("f1", b.url("f1"), model="/models/s")]},
    ]


def gateway(table: RouteTable, *, peers: tuple[Peer, ...] = (), clock: Any = None, limiter: Any = None,
            region: str = "local", wall: Any = None, **opts: Any) -> Gateway:
    o = Options(region=region, ttft_s=0.5, deadline_s=4.0, breaker=Policy(consecutive=1000), peers=peers)
    for k, v in opts.items():
        setattr(o, k, v)
    kw = {"clock": clock} if clock is not None else {}
    if wall is not None:
        kw["wall"] = wall
    return Gateway(o, lambda: table, limiter or MemoryLimiter(), None, **kw)


@pytest.fixture(scope="module")
def peer_url(backends: Backends) -> Iterator[str]:
    """Region us: its gateway serves my-llm from its own replica."""
    table = make_table([{"id": "wl_us", "name": "my-llm", "owner": "alice", "region": "us",
                         "replicas": [replica("us1", backends.url("us1"))]}], KEYS, region="us")
    with serving(gateway(table, region="us")) as url:
        yield url


def post(url: str, body: dict[str, Any], key: str = ALICE, **kw: Any) -> httpx.Response:
    return httpx.post(f"{url}/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"},
                      timeout=30, **kw)


TIERS = [  # (what fails, who answers, served_by, model, fallback)
    ([], "r1", "replica", "my-llm", "false"),
    (["r1"], "c1", "cpu", "my-llm", "true"),
    (["r1", "c1"], "s1", "serverless", "m-shared", "true"),
    (["r1", "c1", "s1"], "f1", "fallback-model", "small", "true"),
    (["r1", "c1", "s1", "f1"], "us1", "replica", "my-llm", "true"),
]


@pytest.mark.parametrize("failure", FAILURES)
@pytest.mark.parametrize(("failing", "answers", "served_by", "model", "fallback"), TIERS,
                         ids=["replica", "cpu", "serverless", "fallback-model", "cross-region"])
def test_each_tier_is_reached_in_order(backends: Backends, peer_url: str, failure: str, failing: list[str],
                                       answers: str, served_by: str, model: str, fallback: str) -> None:
    for name in failing:
        backends.mode(name, failure)
    table = make_table(endpoints(backends), KEYS)
    with serving(gateway(table, peers=(Peer("us", peer_url),))) as url:
        r = post(url, chat())
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["choices"][0]["message"]["content"].startswith(f"{answers}:")
    assert body["model"] == model
    assert r.headers["x-tensora-served-by"] == served_by
    assert r.headers["x-tensora-fallback"] == fallback
    assert r.headers["x-tensora-region"] == ("us" if answers == "us1" else "local")
    tried = r.headers["x-tensora-attempts"].split(",")
    kind = {"close": "reset", "stall_head": "timeout"}.get(failure, failure)
    names = {"r1": "my-llm/r1", "c1": "my-llm/c1", "s1": "m-shared/s1", "f1": "small/f1"}
    again = 2 if kind in ("http_500", "http_503", "reset") else 1  # each tier's only backend: tried once more
    assert tried == [f"{names[n]}:{kind}" for n in failing for _ in range(again)] + [
        ("peer:us" if answers == "us1" else names[answers]) + ":ok"]
    assert r.headers["x-request-id"].startswith("req_")


def test_a_refused_connection_moves_on_and_all_failing_is_a_503_with_retry_after(backends: Backends) -> None:
    dead = f"http://127.0.0.1:{free_port()}/v1"
    table = make_table([{"id": "wl_main", "name": "my-llm", "owner": "alice",
                         "replicas": [replica("r0", dead), replica("r1", backends.url("r1"))]}], KEYS)
    with serving(gateway(table, retry_after_s=7)) as url:
        ok = [post(url, chat()) for _ in range(2)]  # rotation: one of them tries the dead replica first
        backends.mode("r1", "http_503")
        before = backends.requests("r1")
        failed = post(url, chat())
        sent = backends.requests("r1") - before
    assert all(r.status_code == 200 and r.headers["x-tensora-served-by"] == "replica" for r in ok)
    assert any("my-llm/r0:connect_refused" in r.headers["x-tensora-attempts"] for r in ok)
    assert failed.status_code == 503 and failed.headers["retry-after"] == "7"
    err = failed.json()["error"]
    assert set(err) >= {"message", "type", "code"} and err["code"] == "service_unavailable"
    assert sorted(failed.headers["x-tensora-attempts"].split(",")) == ["my-llm/r0:connect_refused",
                                                                       "my-llm/r1:http_503"]
    assert sent == 1  # r1 asked once: a tier of two is not retried


@pytest.mark.timeout(20)  # a walk that outlives its deadline by far: a failure, not a wait
def test_everything_stalling_ends_in_a_503_within_the_deadline(backends: Backends) -> None:
    for n in ("r1", "c1", "s1", "f1"):
        backends.mode(n, "stall_head")
    table = make_table(endpoints(backends, allow_cross_region=False), KEYS)
    with serving(gateway(table, ttft_s=0.4, deadline_s=1.0)) as url:
        r = post(url, chat(stream=True))
    assert r.status_code == 503 and int(r.headers["retry-after"]) >= 1
    *timed_out, last = r.headers["x-tensora-attempts"].split(",")
    # three attempts of 0.4 s fit only in part in the 1 s budget: the third one's TTFT is what is left of it,
    # and the fourth finds the deadline passed (or, when the timer fired a hair early, a sliver of it left)
    assert timed_out == ["my-llm/r1:timeout", "my-llm/c1:timeout", "m-shared/s1:timeout"]
    assert last in ("small/f1:deadline", "small/f1:timeout")


def test_streams_hold_the_status_until_the_first_token(backends: Backends) -> None:
    backends.mode("r1", "stall_after_headers")  # a 200 and no token: must not reach the client as a 200
    table = make_table(endpoints(backends), KEYS)
    with serving(gateway(table)) as url:
        r = post(url, chat(stream=True))
        backends.mode("c1", "http_429")
        backends.mode("s1", "stall_after_headers")
        backends.mode("f1", "http_503")
        r2 = post(url, chat(stream=True))
    assert r.status_code == 200 and r.headers["x-tensora-served-by"] == "cpu"
    assert r.headers["x-tensora-attempts"] == "my-llm/r1:timeout,my-llm/c1:ok"
    events = sse_payloads(r.text)
    assert events[-1] == "[DONE]"
    chunks = [orjson.loads(e) for e in events[:-1]]
    assert all(c["model"] == "my-llm" for c in chunks)
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks).startswith("c1:0")
    assert r2.status_code == 503, r2.text  # cross-region has no peers configured here
    assert r2.headers["x-tensora-attempts"] == ("my-llm/r1:timeout,my-llm/c1:http_429,m-shared/s1:timeout,"
                                                "small/f1:http_503,small/f1:http_503")


def test_a_failure_after_the_first_token_ends_the_stream_with_an_error_event(backends: Backends) -> None:
    backends.mode("r1", "die_mid_stream")
    table = make_table(endpoints(backends), KEYS)
    with serving(gateway(table)) as url:
        r = post(url, chat(stream=True))
    assert r.status_code == 200
    events = sse_payloads(r.text)
    assert events[-1] == "[DONE]"
    err = orjson.loads(events[-2])
    assert err["error"]["code"] == "upstream_failed"
    text = "".join(orjson.loads(e)["choices"][0]["delta"].get("content") or "" for e in events[:-2])
    assert text.startswith("r1:0") and "c1" not in text  # never spliced with another backend's output
    assert backends.requests("c1") == 0 or "c1:" not in r.text


def test_streams_end_with_done_and_the_usage_chunk_only_when_asked(backends: Backends) -> None:
    backends.mode("r1", "no_done")  # as transformers serve streams
    table = make_table(endpoints(backends), KEYS)
    with serving(gateway(table)) as url:
        plain = post(url, chat(stream=True, max_tokens=3))
        asked = post(url, chat(stream=True, max_tokens=3, stream_options={"include_usage": True}))
    for r in (plain, asked):
        assert r.status_code == 200 and sse_payloads(r.text)[-1] == "[DONE]"
    plain_chunks = [orjson.loads(e) for e in sse_payloads(plain.text)[:-1]]
    asked_chunks = [orjson.loads(e) for e in sse_payloads(asked.text)[:-1]]
    assert not any("usage" in c for c in plain_chunks)
    assert asked_chunks[-1]["choices"] == [] and asked_chunks[-1]["usage"]["completion_tokens"] == 3


def test_the_breaker_opens_skips_the_backend_probes_after_the_cooldown_and_closes(backends: Backends) -> None:
    clock = FakeClock(1000.0)
    table = make_table([{"id": "wl_main", "name": "my-llm", "owner": "alice",
                         "replicas": [replica("r1", backends.url("r1")), replica("r2", backends.url("r2"))]}], KEYS)
    gw = gateway(table, clock=clock, breaker=Policy(consecutive=3, base_s=30, max_s=300))
    backends.mode("r1", "http_500")
    with serving(gw) as url:
        first = [post(url, chat()) for _ in range(6)]
        assert all(r.status_code == 200 and "r2:ok" in r.headers["x-tensora-attempts"] for r in first)
        assert sum("r1:http_500" in r.headers["x-tensora-attempts"] for r in first) == 3  # then it opened
        hits = backends.requests("r1")
        skipped = post(url, chat())
        assert "my-llm/r1:breaker_open" in skipped.headers["x-tensora-attempts"]
        assert backends.requests("r1") == hits  # skipped at once: nothing sent
        clock.advance(30)  # half-open: one probe; it fails: open again for 60 s
        probe = [post(url, chat()) for _ in range(2)]
        assert sum("r1:http_500" in r.headers["x-tensora-attempts"] for r in probe) == 1
        assert gw.breakers["my-llm/r1"].open_until == pytest.approx(clock.now() + 60)
        backends.mode("r1", "ok")
        clock.advance(60)
        healed = [post(url, chat()) for _ in range(4)]
        backends.mode("r2", "http_503")
        backends.mode("r1", "http_503")
        down = post(url, chat())
    assert sum(r.headers["x-tensora-attempts"].endswith("my-llm/r1:ok") for r in healed) == 2  # closed: rotates
    assert down.status_code == 503 and down.headers["retry-after"] == "5"  # r2's first failure opens nothing


def test_a_503_waits_for_the_soonest_breaker(backends: Backends) -> None:
    clock = FakeClock(1000.0)
    table = make_table([{"id": "wl_main", "name": "my-llm", "owner": "alice",
                         "replicas": [replica("r1", backends.url("r1"))]}], KEYS)
    backends.mode("r1", "http_500")
    with serving(gateway(table, clock=clock, breaker=Policy(consecutive=1, base_s=30))) as url:
        first = post(url, chat())
        clock.advance(12)
        second = post(url, chat())
    assert first.status_code == 503 and first.headers["retry-after"] == "30"
    assert second.status_code == 503 and second.headers["retry-after"] == "18"
    assert second.headers["x-tensora-attempts"] == "my-llm/r1:breaker_open"


def test_keys_scopes_and_models_in_openais_error_shape(backends: Backends) -> None:
    table = make_table(endpoints(backends), KEYS)
    with serving(gateway(table)) as url:
        missing = httpx.post(f"{url}/chat/completions", json=chat(), timeout=10)
        wrong = post(url, chat(), key=apikeys.generate())
        garbled = post(url, chat(), key="tsk_not-a-key")
        scope = post(url, chat(), key=NO_INFERENCE)
        other = post(url, chat(), key=BOB)  # alice's endpoint: bob cannot see it
        shared = post(url, chat(model="m-shared"), key=BOB)
        no_model = post(url, {"messages": []})
        bad_json = httpx.post(f"{url}/chat/completions", content=b"{nope", timeout=10,
                              headers={"Authorization": f"Bearer {ALICE}"})
        models = httpx.get(f"{url}/models", headers={"Authorization": f"Bearer {BOB}"}, timeout=10)
    for r, status, code in ((missing, 401, "invalid_api_key"), (wrong, 401, "invalid_api_key"),
                            (garbled, 401, "invalid_api_key"), (scope, 403, "insufficient_scope"),
                            (other, 404, "model_not_found"), (no_model, 400, "missing_model")):
        assert r.status_code == status, r.text
        assert r.json()["error"]["code"] == code and r.json()["error"]["message"]
        assert r.headers["x-request-id"]
    assert bad_json.status_code == 400
    assert shared.status_code == 200 and shared.headers["x-tensora-served-by"] == "replica"
    assert shared.json()["model"] == "m-shared"
    assert [m["id"] for m in models.json()["data"]] == ["m-shared"]


@pytest.mark.parametrize("pair", [tuple, list], ids=["tuples", "lists"])
def test_the_app_reads_the_headers_an_asgi_server_hands_it_as_any_pairs(backends: Backends, pair: Any) -> None:
    """ASGI lets a server give the request headers as any pairs: the caller's key and request id are read from lists
    as from tuples, and the first of a repeated header counts (the second key here lacks the 'inference' scope)."""
    gw = gateway(make_table(endpoints(backends), KEYS))
    sent: list[dict[str, Any]] = []
    body = orjson.dumps(chat())

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(msg: dict[str, Any]) -> None:
        sent.append(msg)

    headers = [pair(h) for h in ((b"authorization", f"Bearer {ALICE}".encode()), (b"x-request-id", b"mine-1"),
                                 (b"authorization", f"Bearer {NO_INFERENCE}".encode()))]

    async def go() -> None:
        await gw({"type": "http", "method": "POST", "path": "/v1/chat/completions", "headers": headers}, receive, send)
        gw.client.close()  # its pooled connection to the backend, on the loop that made it
        await asyncio.sleep(0)

    asyncio.run(go())
    start = next(m for m in sent if m["type"] == "http.response.start")
    assert start["status"] == 200 and (b"x-request-id", b"mine-1") in start["headers"]


def test_a_keys_scopes_are_those_of_the_route_table_in_force(backends: Backends) -> None:
    """The gateway keeps each key's 'inference' verdict for one route table: a grant is honoured, and a revocation
    takes, on the next table (a verdict kept past it would go on serving a key its owner took the scope from)."""
    grant = {**KEYS, NO_INFERENCE: ("alice", ["workloads:read", "inference"])}
    tables = [make_table(endpoints(backends), KEYS), make_table(endpoints(backends), grant),
              make_table(endpoints(backends), KEYS)]
    now = [tables[0]]
    gw = Gateway(Options(ttft_s=0.5, deadline_s=4.0), lambda: now[0], MemoryLimiter(), None)
    codes = []
    with serving(gw) as url:
        for t in tables:
            now[0] = t
            codes.append([post(url, chat(), key=NO_INFERENCE).status_code for _ in range(2)])
    assert codes == [[403, 403], [200, 200], [403, 403]]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_a_replica_gets_its_own_key_upstream_and_never_the_callers(backends: Backends, stream: bool) -> None:
    table = make_table([{"id": "wl_k", "name": "keyed", "owner": "alice",
                         "replicas": [replica("k1", backends.url("k1"), api_key=REPLICA_KEY)]},
                        {"id": "wl_open", "name": "open", "owner": "alice",
                         "replicas": [replica("r1", backends.url("r1"))]}], KEYS)
    direct = httpx.post(f"{backends.url('k1')}/chat/completions", json=chat(model="/models/m"), timeout=10,
                        headers={"Authorization": f"Bearer {ALICE}"})
    assert direct.status_code == 401  # the model server refuses everyone but the gateway
    with serving(gateway(table)) as url:
        keyed = post(url, chat(stream, model="keyed"))
        assert keyed.status_code == 200, keyed.text
        assert backends.authorization("k1") == f"Bearer {REPLICA_KEY}"
        unkeyed = post(url, chat(stream, model="open"))  # a replica that takes no key gets no Authorization
        assert unkeyed.status_code == 200, unkeyed.text
        assert backends.authorization("r1") is None


UPSTREAM_HEADERS = {"host", "content-type", "content-length", "x-request-id", "authorization", "traceparent",
                    "tracestate"}
"""All a replica may get from the gateway: the request's own framing, its id, the replica's key, trace context."""


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_a_replica_never_gets_the_callers_cookies_or_credentials(backends: Backends, stream: bool) -> None:
    """A browser's request (a page of the dashboard's host calling the gateway with the key) carries the
    dashboard's cookies: none of it, nor the caller's key, reaches a replica, whose server its owner controls."""
    table = make_table([{"id": "wl_k", "name": "keyed", "owner": "alice",
                         "replicas": [replica("k1", backends.url("k1"), api_key=REPLICA_KEY)]},
                        {"id": "wl_open", "name": "open", "owner": "alice",
                         "replicas": [replica("r1", backends.url("r1"))]}], KEYS)
    browser = {"Cookie": f"tensora_key={ALICE}; tensora_session=s3ss10n-value; tensora_csrf=csrf-value",
               "Origin": "http://127.0.0.1:8700", "Referer": "http://127.0.0.1:8700/workloads/wl_k",
               "X-Forwarded-For": "10.9.8.7", "Proxy-Authorization": f"Bearer {ALICE}", "X-Api-Key": ALICE}
    secrets_ = [ALICE, "s3ss10n-value", "csrf-value"]
    with serving(gateway(table)) as url:
        for model, name in (("keyed", "k1"), ("open", "r1")):
            r = httpx.post(f"{url}/chat/completions", json=chat(stream, model=model), timeout=30,
                           headers={"Authorization": f"Bearer {ALICE}", **browser})
            assert r.status_code == 200, r.text
            seen = backends.headers(name)
            assert seen, "the backend recorded no request: nothing was checked"
            assert {k.lower() for k, _ in seen} <= UPSTREAM_HEADERS, seen
            assert [(k, v) for k, v in seen if any(s in v for s in secrets_)] == [], seen


def test_a_replicas_answer_reaches_the_caller_with_only_the_gateways_headers(backends: Backends) -> None:
    """A model server's page never becomes one on Tensora's host: its content type and cookies stay behind."""
    table = make_table([{"id": "wl_open", "name": "open", "owner": "alice",
                         "replicas": [replica("r1", backends.url("r1"))]}], KEYS)
    backends.mode("r1", "http_400", headers={"Set-Cookie": "tenant=planted; Path=/", "Content-Type": "text/html",
                                             "Content-Security-Policy": "script-src *"})
    with serving(gateway(table)) as url:
        r = post(url, chat(model="open"))
    assert r.status_code == 400, r.text  # a client error, passed through: its status and body
    assert "set-cookie" not in r.headers and "content-security-policy" not in r.headers
    assert r.headers.get_list("content-type") == ["application/json"]


# The windows are whole minutes of wall time: a test whose requests straddled a minute's end would see
# two windows (CI once admitted all 16 of the two-gateway test's requests). The rate tests hold the
# wall clock 30 s into a minute.
MID_MINUTE = 1_800_000_030.0


def test_rate_limits_per_key_with_headers_and_token_reservations(backends: Backends) -> None:
    table = make_table(endpoints(backends), KEYS, limits={ALICE: (3, 1000), BOB: (100, 300)})
    with serving(gateway(table, default_max_tokens=100, wall=FakeClock(MID_MINUTE))) as url:
        ok = [post(url, chat()) for _ in range(3)]
        limited = post(url, chat())
        # bob: 300 tokens a minute; each request reserves ~105 (prompt + max_tokens) and uses 7 + 8
        bobs = [post(url, chat(model="m-shared", max_tokens=100), key=BOB) for _ in range(5)]
        too_big = post(url, chat(model="m-shared", max_tokens=400), key=BOB)
    assert [r.status_code for r in ok] == [200, 200, 200]
    assert [r.headers["x-ratelimit-remaining-requests"] for r in ok] == ["2", "1", "0"]
    assert limited.status_code == 429 and limited.headers["retry-after"] == "30"  # the window ends 30 s on
    assert limited.json()["error"]["code"] == "rate_limit_exceeded"
    assert limited.headers["ratelimit-policy"] == '"requests";q=3;w=60, "tokens";q=1000;w=60'
    assert limited.headers["ratelimit"].startswith('"requests";r=0;t=')
    assert limited.headers["x-ratelimit-limit-tokens"] == "1000"
    # settled to what was used (15 a request), so all five fit though five reservations would not
    assert [r.status_code for r in bobs] == [200] * 5
    assert too_big.status_code == 400 and too_big.json()["error"]["param"] == "max_tokens"


@pytest.fixture(scope="module")
def redis_url() -> Iterator[str]:
    from tests.support.services import redis_server

    with redis_server() as url:
        yield url


def test_rate_limits_hold_across_two_gateways_sharing_redis(backends: Backends, redis_url: str) -> None:
    table = make_table(endpoints(backends), KEYS, limits={ALICE: (10, 100_000)})
    prefix = f"t{time.monotonic_ns()}"
    # what is shared is under test, not how long a call may take: a busy machine's Redis is given a second
    def limiter() -> RedisLimiter:
        return RedisLimiter(redis_url, prefix, timeout_s=1.0, connect_timeout_s=1.0)

    with (serving(gateway(table, limiter=limiter(), wall=FakeClock(MID_MINUTE))) as a,
          serving(gateway(table, limiter=limiter(), wall=FakeClock(MID_MINUTE))) as b):
        codes = [post(url, chat()).status_code for url in [a, b] * 8]
    assert codes.count(200) == 10 and codes.count(429) == 6
    assert codes[:10] == [200] * 10


@pytest.mark.parametrize("kind", ["memory", "redis"])
@pytest.mark.parametrize("held", [False, True], ids=["owner", "owner+key"])
def test_a_window_ends_on_the_minute_and_a_late_settle_leaves_the_next_alone(kind: str, held: bool,
                                                                             redis_url: str) -> None:
    async def go() -> list[tuple[bool, int, int, float]]:
        lim = MemoryLimiter() if kind == "memory" else RedisLimiter(redis_url, f"w{time.monotonic_ns()}")
        q, end = Quota(rpm=2, tpm=1000), 1_800_000_060.0  # a minute's end
        c = Caller("o", Quota(5, 5000), "k", q) if held else Caller("o", q)
        try:
            seen = [await lim.admit(c, 100, end - t) for t in (30.0, 0.5, 0.1)]  # 2 fit, the 3rd not
            seen.append(await lim.admit(c, 100, end))  # the next window: admitted again
            await lim.settle(seen[0], 10)  # the old window's reservation settles late
            seen.append(await lim.admit(c, 100, end + 1))
            return [(a.ok, a.requests, a.tokens, round(a.reset_s, 3)) for a in seen]
        finally:
            await lim.close()

    assert asyncio.run(go()) == [(True, 1, 100, 30.0), (True, 2, 200, 0.5), (False, 2, 200, 0.1),
                                 (True, 1, 100, 60.0), (True, 2, 200, 59.0)]


def test_the_openai_client_end_to_end_streaming_and_not(backends: Backends) -> None:
    table = make_table(endpoints(backends), KEYS)
    with serving(gateway(table)) as url:
        client = openai.OpenAI(base_url=url, api_key=ALICE, max_retries=0)
        whole = client.chat.completions.with_raw_response.create(
            model="my-llm", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
        done = whole.parse()
        text = ""
        last = None
        for chunk in client.chat.completions.create(model="my-llm", messages=[{"role": "user", "content": "hi"}],
                                                    max_tokens=4, stream=True, stream_options={"include_usage": True}):
            assert chunk.model == "my-llm"
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
            last = chunk
        completion = client.completions.create(model="my-llm", prompt="once upon", max_tokens=3)
        models = [m.id for m in client.models.list()]
        with pytest.raises(openai.AuthenticationError):
            # the last character changed (to another: a key that ends in "x" already would be the key itself)
            wrong = BOB[:-1] + ("y" if BOB.endswith("x") else "x")
            openai.OpenAI(base_url=url, api_key=wrong, max_retries=0).models.list()
        with pytest.raises(openai.NotFoundError):
            client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}])
    assert whole.headers["x-tensora-served-by"] == "replica" and done.model == "my-llm"
    assert done.usage is not None and done.usage.completion_tokens == 4
    assert text.startswith("r1:0") and last is not None and last.usage is not None
    assert completion.model == "my-llm" and completion.choices[0].text.startswith("r1:")
    assert models == ["my-llm", "small", "m-shared"]


def test_max_tokens_over_the_owners_whole_minute_is_a_400_the_openai_client_does_not_retry(
        backends: Backends) -> None:
    """A request that reserves more tokens than its owner may use in a whole minute can never be admitted: a 400
    naming max_tokens and the limit, which the openai client raises at once (a 429 it would retry)."""
    table = make_table(endpoints(backends), KEYS, limits={BOB: (100, 300)})
    sent: list[httpx.Request] = []
    with (serving(gateway(table, wall=lambda: MID_MINUTE)) as url,
          httpx.Client(event_hooks={"request": [sent.append]}) as http):
        client = openai.OpenAI(base_url=url, api_key=BOB, http_client=http)  # its default retries: 2
        with pytest.raises(openai.BadRequestError) as raised:
            client.chat.completions.create(model="m-shared", messages=[{"role": "user", "content": "hi"}],
                                           max_tokens=400)
        fits = client.chat.completions.create(model="m-shared", messages=[{"role": "user", "content": "hi"}],
                                              max_tokens=100)
    err = raised.value.body
    assert isinstance(err, dict) and err["param"] == "max_tokens" and err["type"] == "invalid_request_error", err
    assert "tokens_per_minute (300" in err["message"] and "lower max_tokens" in err["message"], err
    assert len(sent) == 2, [str(r.url) for r in sent]  # the refused request once, then the one that fits
    assert fits.usage is not None and fits.usage.completion_tokens > 0
