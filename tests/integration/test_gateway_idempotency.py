"""Idempotency-Key on the gateway's completions, over real HTTP through real gateways and fake backends:
the same key and body replay the first answer (JSON, or the stream's bytes) and are metered once; another
body is 422; a request in flight is 409; no other key can replay or block a record; failures and answers
too large are not kept; records expire (fake clock); two gateways share records through a real Redis, and
with Redis killed each keeps serving on its own disk (never a 500)."""

from __future__ import annotations

import asyncio
import os
import stat
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tensora.gateway import idempotency
from tensora.gateway.app import GatewaySettings, build
from tensora.gateway.idempotency import Answer, DiskStore, Held, Idempotency, RedisStore, fingerprint
from tensora.gateway.limits import MemoryLimiter, RedisLimiter
from tensora.gateway.metering import Meter
from tensora.gateway.proxy import Gateway, Options
from tensora.gateway.routes import RouteTable
from tensora.keys import apikeys
from tests.support.clock import FakeClock
from tests.support.gateway_harness import Backends, backends_fixture, chat, make_table, replica, serving
from tests.support.services import free_port, redis_process

pytestmark = pytest.mark.timeout(120)

ALICE, ALICE2, MALLORY = apikeys.generate(), apikeys.generate(), apikeys.generate()
KEYS = {ALICE: ("alice", ["inference"]), ALICE2: ("alice", ["inference"]), MALLORY: ("mallory", ["inference"])}
REPLAYED = "idempotent-replayed"


backends = backends_fixture(["r1"])


@pytest.fixture(autouse=True)
def _ok(backends: Backends) -> None:
    backends.reset()


def table(b: Backends, owners: dict[str, tuple[int, int]] | None = None) -> RouteTable:
    eps = [{"id": f"wl_{o}", "name": "my-llm", "owner": o, "replicas": [replica("r1", b.url("r1"))]}
           for o in ("alice", "mallory")]
    return make_table(eps, KEYS, owners=owners)


class Spooled:
    """A gateway's meter, and the usage records it spooled."""

    def __init__(self, path: Path) -> None:
        async def never(records: list[bytes]) -> bool:
            return False
        self.meter = Meter(path, never)

    async def close(self) -> None:
        self.meter.close()

    def records(self, want: int) -> list[dict[str, Any]]:
        """The records, once there are ``want`` (a request is metered after its answer is out, and spooled
        within 5 ms), and a while more, so that one too many would be seen."""
        deadline = time.monotonic() + 10
        while len(self._read()) < want and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(0.2)
        return self._read()

    def _read(self) -> list[dict[str, Any]]:
        return [orjson.loads(line) for f in sorted(self.meter.dir.glob("*.jsonl"))
                for line in f.read_bytes().splitlines()]


def gateway(b: Backends, d: Path, wall: FakeClock | None = None, shared: Any = None, *, ttft_s: float = 1.5,
            deadline_s: float = 4, **kw: Any) -> tuple[Gateway, Spooled]:
    t, spool = table(b, kw.pop("owners", None)), Spooled(d / "spool")
    idem = Idempotency(DiskStore(d / "idem", kw.pop("max_total_bytes", 1 << 20), kw.pop("max_owner_bytes", None)),
                       shared,
                       **({"wall": wall} if wall else {}), **kw)
    gw = Gateway(Options(ttft_s=ttft_s, deadline_s=deadline_s), lambda: t, MemoryLimiter(), spool.meter, idem=idem,
                 on_shutdown=[spool.close], **({"wall": wall} if wall else {}))
    return gw, spool


def post(url: str, body: dict[str, Any], key: str = ALICE, ik: str | None = "k-1", path: str = "chat/completions"
         ) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}", **({"Idempotency-Key": ik} if ik is not None else {})}
    return httpx.post(f"{url}/{path}", json=body, headers=headers, timeout=10)


def error(r: httpx.Response) -> dict[str, Any]:
    e: dict[str, Any] = r.json()["error"]
    return e


def test_another_key_never_replays_or_blocks_a_record(backends: Backends, tmp_path: Path) -> None:
    """The attack: Mallory (and Alice's other key) send Alice's Idempotency-Key with her body, hoping for her
    answer, or to make her retry fail with 422/409. Each gets a fresh answer of its own; Alice's replays."""
    gw, _ = gateway(backends, tmp_path)
    with serving(gw) as url:
        first = post(url, chat())
        assert first.status_code == 200 and REPLAYED not in first.headers
        n = backends.requests("r1")
        for key in (MALLORY, ALICE2):
            other = post(url, chat(), key=key)
            assert other.status_code == 200 and REPLAYED not in other.headers, key
            assert post(url, chat(max_tokens=3), key=key).status_code == 422  # its own record, not Alice's
        assert backends.requests("r1") == n + 2
        again = post(url, chat())
        assert again.status_code == 200 and again.headers[REPLAYED] == "true"
        assert again.content == first.content and backends.requests("r1") == n + 2


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_replay_is_byte_identical_and_metered_once(backends: Backends, tmp_path: Path, stream: bool) -> None:
    gw, spool = gateway(backends, tmp_path)
    with serving(gw) as url:
        first = post(url, chat(stream=stream))
        n = backends.requests("r1")
        time.sleep(1.1)  # the fake backend's ``created`` is the second: a run again would differ
        again = [post(url, chat(stream=stream)) for _ in range(3)]
        assert backends.requests("r1") == n
        for r in again:
            assert r.status_code == 200 and r.headers[REPLAYED] == "true"
            assert r.content == first.content
            assert r.headers["content-type"] == first.headers["content-type"]
            assert r.headers["x-tensora-attempts"] == first.headers["x-tensora-attempts"]
            assert r.headers["x-request-id"] != first.headers["x-request-id"]  # each request its own id
            assert len(r.headers.get_list("x-tensora-region")) == len(r.headers.get_list("x-request-id")) == 1
        if stream:
            assert first.text.endswith("data: [DONE]\n\n") and first.text.count("data: ") > 3
        records = spool.records(1)
        assert len(records) == 1 and records[0]["key_id"] == "key_0" and records[0]["completion_tokens"] > 0
        # the same key on the other path is another record
        assert post(url, {"model": "my-llm", "prompt": "hi"}, path="completions").headers.get(REPLAYED) is None
        assert len(spool.records(2)) == 2


def test_another_body_is_422_naming_the_header(backends: Backends, tmp_path: Path) -> None:
    gw, spool = gateway(backends, tmp_path)
    with serving(gw) as url:
        assert post(url, chat()).status_code == 200
        n = backends.requests("r1")
        r = post(url, chat(max_tokens=5))
        assert r.status_code == 422 and error(r)["param"] == "Idempotency-Key"
        assert error(r)["code"] == "idempotency_key_reused" and error(r)["type"] == "invalid_request_error"
        # the same body with its keys in another order is the same body
        reordered = {"stream": False, "messages": [{"content": "hello", "role": "user"}], "model": "my-llm"}
        assert post(url, reordered).headers[REPLAYED] == "true"
        assert backends.requests("r1") == n and len(spool.records(1)) == 1


def test_replays_count_against_the_request_limit(backends: Backends, tmp_path: Path) -> None:
    """Replays are not metered, but they are requests: else one owner could flood the store for free."""
    gw, spool = gateway(backends, tmp_path, wall=FakeClock(1_800_000_000.0), owners={"alice": (3, 10**6)})
    with serving(gw) as url:
        codes = [post(url, chat()).status_code for _ in range(3)] + [post(url, chat(max_tokens=2)).status_code]
        assert codes == [200, 200, 200, 429]
        assert len(spool.records(1)) == 1


def test_a_client_gone_mid_stream_gets_it_whole_on_its_retry(backends: Backends, tmp_path: Path) -> None:
    gw, spool = gateway(backends, tmp_path)
    with serving(gw) as url, httpx.stream("POST", f"{url}/chat/completions", json=chat(stream=True), timeout=10,
                                          headers={"Authorization": f"Bearer {ALICE}", "Idempotency-Key": "g"}) as r:
        assert r.status_code == 200
        next(r.iter_raw())
        r.close()  # gone after the first bytes
        deadline = time.monotonic() + 10
        while (again := post(url, chat(stream=True), ik="g")).status_code == 409:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert again.headers[REPLAYED] == "true" and again.text.endswith("data: [DONE]\n\n")
        assert len(spool.records(1)) == 1


CASES = {
    "empty": "",
    "too long": "k" * 256,
    "not ASCII": "clé",
}


@pytest.mark.parametrize("ik", CASES.values(), ids=CASES.keys())
def test_a_bad_key_is_400_naming_the_header(backends: Backends, tmp_path: Path, ik: str) -> None:
    gw, _ = gateway(backends, tmp_path)
    with serving(gw) as url:
        headers = [("Authorization", f"Bearer {ALICE}"), ("Idempotency-Key", ik.encode().decode("latin-1"))]
        r = httpx.post(f"{url}/chat/completions", content=orjson.dumps(chat()), timeout=10,
                       headers=[(k.encode(), v.encode("latin-1")) for k, v in headers])
        assert r.status_code == 400 and error(r)["param"] == "Idempotency-Key"


def test_in_flight_is_409_and_a_failure_is_not_kept(backends: Backends, tmp_path: Path) -> None:
    # the first request waits for its head until ttft_s, then fails: long enough for the duplicate to arrive
    # while it waits on a loaded machine (1.5 s was not, once, in CI)
    gw, spool = gateway(backends, tmp_path, ttft_s=5, deadline_s=8)
    backends.mode("r1", "stall_head")
    with serving(gw) as url:
        got: list[httpx.Response] = []
        seen = backends.requests("r1")  # the module's backends: earlier tests' requests are counted too
        t = threading.Thread(target=lambda: got.append(post(url, chat())))
        t.start()
        deadline = time.monotonic() + 5
        while backends.requests("r1") == seen:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        dup = post(url, chat())
        assert dup.status_code == 409 and dup.headers["retry-after"] == "1"
        assert error(dup)["param"] == "Idempotency-Key" and error(dup)["code"] == "idempotency_key_in_use"
        t.join(10)
        assert got[0].status_code == 503 and got[0].headers["x-tensora-idempotency"] == "not-stored"
        backends.mode("r1", "ok")
        retry = post(url, chat())  # the failure was not kept: this one runs
        assert retry.status_code == 200 and REPLAYED not in retry.headers
        assert post(url, chat()).headers[REPLAYED] == "true"
        assert [r["status"] for r in spool.records(1)] == [200]


@pytest.mark.parametrize("mode", ["http_500", "http_429", "http_400", "die_mid_stream"])
def test_errors_are_not_kept(backends: Backends, tmp_path: Path, mode: str) -> None:
    gw, _ = gateway(backends, tmp_path)
    stream = mode == "die_mid_stream"
    # a 429 saying "come back at once", so that the next request is not held off r1 by the 429's own back-off
    backends.mode("r1", mode, **({"headers": {"retry-after-ms": "0"}} if mode == "http_429" else {}))
    with serving(gw) as url:
        bad = post(url, chat(stream=stream))
        assert bad.status_code != 200 or "error" in bad.text
        backends.mode("r1", "ok")
        n = backends.requests("r1")
        good = post(url, chat(stream=stream))
        assert good.status_code == 200 and REPLAYED not in good.headers and backends.requests("r1") == n + 1
        assert post(url, chat(stream=stream)).headers[REPLAYED] == "true"


def test_records_expire_after_keep_s(backends: Backends, tmp_path: Path) -> None:
    wall = FakeClock(1_800_000_000.0)
    gw, spool = gateway(backends, tmp_path, wall=wall)
    with serving(gw) as url:
        assert post(url, chat()).status_code == 200
        wall.advance(24 * 3600 - 1)
        assert post(url, chat(max_tokens=9)).status_code == 422  # still held: 24 h less a second
        assert post(url, chat()).headers[REPLAYED] == "true"
        wall.advance(2)
        n = backends.requests("r1")
        fresh = post(url, chat(max_tokens=9))  # expired: the key is free for another body
        assert fresh.status_code == 200 and REPLAYED not in fresh.headers and backends.requests("r1") == n + 1
        assert len(spool.records(2)) == 2


def test_an_answer_too_large_is_served_not_kept(backends: Backends, tmp_path: Path) -> None:
    gw, spool = gateway(backends, tmp_path, max_answer_bytes=200)
    with serving(gw) as url:
        for _ in range(2):
            r = post(url, chat())
            assert r.status_code == 200 and len(r.content) > 200 and REPLAYED not in r.headers
            assert r.headers["x-tensora-idempotency"] == "not-stored"
        s = [post(url, chat(stream=True), ik="s") for _ in range(2)]  # a stream cannot say so: it runs again
        assert all(r.status_code == 200 and REPLAYED not in r.headers for r in s)
        assert len(spool.records(4)) == 4


def test_the_store_total_is_bounded(backends: Backends, tmp_path: Path) -> None:
    gw, _ = gateway(backends, tmp_path, max_total_bytes=2500)
    with serving(gw) as url:
        kept = [post(url, chat(), ik=f"k{i}").status_code for i in range(6)]
        assert kept == [200] * 6
        replayed = [REPLAYED in post(url, chat(), ik=f"k{i}").headers for i in range(6)]
    assert replayed[0] and not replayed[-1], replayed  # the first kept, the last past the bound not
    files = list((tmp_path / "idem").iterdir())
    assert sum(f.stat().st_size for f in files) <= 2500
    assert all(stat.S_IMODE(f.stat().st_mode) == 0o600 for f in files)
    assert stat.S_IMODE((tmp_path / "idem").stat().st_mode) == 0o700


def test_an_owner_past_its_share_does_not_stop_another_owners_answers_being_kept(backends: Backends,
                                                                                   tmp_path: Path) -> None:
    gw, _ = gateway(backends, tmp_path, max_total_bytes=100_000, max_owner_bytes=2500)
    with serving(gw) as url:
        assert [post(url, chat(), key=MALLORY, ik=f"m{i}").status_code for i in range(8)] == [200] * 8
        mallory = [REPLAYED in post(url, chat(), key=MALLORY, ik=f"m{i}").headers for i in range(8)]
        alice = [post(url, chat(), ik=f"a{i}").status_code for i in range(3)]
        replayed = [REPLAYED in post(url, chat(), ik=f"a{i}").headers for i in range(3)]
    assert mallory[0] and not mallory[-1], mallory  # its first answers kept, those past its share not
    assert alice == [200] * 3 and all(replayed), replayed


@settings(max_examples=30, deadline=None)
@given(st.lists(st.sampled_from(["claim-a", "claim-b", "done-a", "release-a", "release-b", "tick"]), max_size=12))
def test_disk_store_one_holder_at_a_time(tmp_path_factory: pytest.TempPathFactory, steps: list[str]) -> None:
    """Whatever the order of claims, completions, releases and time: a claim wins only when no live record is
    there, and completion or release by a holder that lost its claim changes nothing."""
    store = DiskStore(tmp_path_factory.mktemp("idem"))
    now, holder, done = 1000.0, None, False

    async def go() -> None:
        nonlocal now, holder, done
        for s in steps:
            op, _, who = s.partition("-")
            if op == "tick":
                now += 100
                if holder is not None and not done and now >= 1050:
                    holder = None  # its claim lapsed
                continue
            if op == "claim":
                held = await store.claim("n", "fp", who, now, now + 50)
                assert (held is None) == (holder is None)
                if held is None:
                    holder, done = who, False
            elif op == "done":
                ok = await store.complete("n", who, b"answer", now, now + 10**6)
                assert ok == (holder == who)
                done = done or ok
            else:
                await store.release("n", who)
                if holder == who:
                    holder, done = None, False
    asyncio.run(go())


def test_disk_claims_race_safely_across_processes(tmp_path: Path) -> None:
    """Eight processes claim one record at once: exactly one wins."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(8) as pool:
        won = pool.map(_claim_in_process, [(str(tmp_path), i) for i in range(8)])
    assert sum(won) == 1


def _claim_in_process(arg: tuple[str, int]) -> bool:
    d, i = arg
    store = DiskStore(Path(d))
    time.sleep(max(0.0, 0.3 - (time.time() % 0.3)))  # line them up
    return asyncio.run(store.claim("n", "fp", str(i), time.time(), time.time() + 60)) is None


def test_a_torn_record_counts_as_none(tmp_path: Path) -> None:
    store = DiskStore(tmp_path)
    (tmp_path / "n").write_bytes(b'{"fp": "x", "ex')
    assert asyncio.run(store.claim("n", "fp", "t", 1000.0, 1060.0)) is None


@pytest.mark.parametrize("kind", ["disk", "redis"])
def test_both_stores_keep_the_same_rules(tmp_path: Path, kind: str) -> None:
    """One scenario on each store, on a fake clock: atomic claims, tokens, the total bound, expiry."""
    import redis.asyncio as aioredis

    from tests.support.services import redis_server

    async def scenario(store: Any) -> None:
        now, answer = 1_000.0, b"x" * 600
        assert await store.claim("a", "fp", "t1", now, now + 10) is None
        assert await store.claim("a", "fp", "t2", now, now + 10) == Held("fp", None)  # in flight
        assert not await store.complete("a", "t2", answer, now, now + 100)  # not its claim
        assert await store.complete("a", "t1", answer, now, now + 100)
        assert await store.claim("a", "other", "t3", now + 1, now + 11) == Held("fp", answer)
        assert await store.claim("b", "fp", "t4", now, now + 10) is None
        assert not await store.complete("b", "t4", answer, now, now + 100)  # past the total: not kept
        await store.release("b", "t4")
        assert await store.claim("b", "fp", "t5", now, now + 10) is None  # released: free again
        await store.release("a", "t9")  # not its holder: nothing happens
        assert (await store.claim("a", "fp", "t6", now + 2, now + 12)) == Held("fp", answer)
        now += 101  # a expired: its bytes are free, its key too
        assert await store.complete("b", "t5", answer, now, now + 100) is False  # b's claim lapsed
        assert await store.claim("b", "fp", "t7", now, now + 10) is None
        assert await store.complete("b", "t7", answer, now, now + 100)
        assert await store.claim("a", "new", "t8", now, now + 10) is None

    if kind == "disk":
        asyncio.run(scenario(DiskStore(tmp_path, max_total_bytes=1000)))
        return
    with redis_server() as url:
        async def on_redis() -> None:
            client = aioredis.from_url(url)
            try:
                await scenario(RedisStore(client, max_total_bytes=1000))
            finally:
                await client.aclose()
        asyncio.run(on_redis())


@pytest.mark.parametrize("kind", ["disk", "redis"])
def test_one_owner_cannot_fill_the_store_for_the_others(tmp_path: Path, kind: str) -> None:
    """Nothing kept is evicted, so a store one owner filled would deny every other owner's keeps: each owner has a
    bound of its own, below the total. Its expired answers free its share again (the disk's at its next sweep)."""
    import redis.asyncio as aioredis

    from tests.support.services import redis_server

    async def scenario(store: Any) -> None:
        now, answer = 1_000.0, b"x" * 600
        for i, expected in enumerate([True, True, False]):  # two of ~650 bytes fit in 1500, a third does not
            assert await store.claim(f"m{i}", "fp", f"t{i}", now, now + 10) is None
            assert await store.complete(f"m{i}", f"t{i}", answer, now, now + 100, "mallory") is expected, i
        for i in range(2):  # the total (10,000) has room: other owners keep theirs
            assert await store.claim(f"a{i}", "fp", f"u{i}", now, now + 10) is None
            assert await store.complete(f"a{i}", f"u{i}", answer, now, now + 100, f"owner-{i}")
        assert await store.claim("m0", "other", "t9", now, now + 10) == Held("fp", answer)  # kept ones replay
        now += 101 + idempotency.SWEEP_S  # mallory's answers expired: its share is free again
        assert await store.claim("m3", "fp", "t3", now, now + 10) is None
        assert await store.complete("m3", "t3", answer, now, now + 100, "mallory")

    if kind == "disk":
        asyncio.run(scenario(DiskStore(tmp_path, max_total_bytes=10_000, max_owner_bytes=1500)))
        return
    with redis_server() as url:
        async def on_redis() -> None:
            client = aioredis.from_url(url)
            try:
                await scenario(RedisStore(client, max_total_bytes=10_000, max_owner_bytes=1500))
            finally:
                await client.aclose()
        asyncio.run(on_redis())


def test_the_relay_error_event_is_what_capture_refuses_to_keep() -> None:
    """The relay ends a failed stream with this event; Capture keys on its start (keep the two in step)."""
    from tensora.gateway import idempotency, sse
    from tensora.gateway.proxy import error_body

    assert sse.event(error_body("failed", "server_error", "upstream_failed")).startswith(idempotency._STREAM_ERROR)


def test_answer_round_trip() -> None:
    a = Answer(200, [(b"content-type", b"text/event-stream"), (b"x-tensora-attempts", b"r1:ok")],
               b"data: {}\n\n\ndata: [DONE]\n\n")
    assert Answer.decode(a.encode()) == a
    assert fingerprint({"a": 1, "b": [1, 2]}) == fingerprint({"b": [1, 2], "a": 1}) != fingerprint({"a": 2})


# -- two gateways on one Redis -------------------------------------------------------------------------------


def redis_gateway(b: Backends, d: Path, url: str) -> tuple[Gateway, Spooled]:
    t, spool = table(b), Spooled(d / "spool")
    lim = RedisLimiter(url, "t", timeout_s=0.5, connect_timeout_s=0.5)
    gw = Gateway(Options(ttft_s=1.5, deadline_s=4), lambda: t, lim, spool.meter,
                 idem=Idempotency(DiskStore(d / "idem"), RedisStore(lim.redis), probe_s=0.2), on_shutdown=[spool.close])
    return gw, spool


def test_two_gateways_share_records_through_redis(backends: Backends, tmp_path: Path) -> None:
    port = free_port()
    proc = redis_process(port)
    url = f"redis://127.0.0.1:{port}/0"
    (ga, sa), (gb, sb) = redis_gateway(backends, tmp_path / "a", url), redis_gateway(backends, tmp_path / "b", url)
    try:
        with serving(ga) as a, serving(gb) as b:
            for stream in (False, True):
                ik = f"k-{stream}"
                first = post(a, chat(stream=stream), ik=ik)
                n = backends.requests("r1")
                again = post(b, chat(stream=stream), ik=ik)
                assert again.headers[REPLAYED] == "true" and again.content == first.content
                assert post(b, chat(stream=stream, max_tokens=4), ik=ik).status_code == 422
                assert post(b, chat(stream=stream), ik=ik, key=MALLORY).headers.get(REPLAYED) is None
                assert backends.requests("r1") == n + 1
            assert len(sa.records(2)) == 2 and len(sb.records(2)) == 2  # Mallory's two, through b
            backends.mode("r1", "stall_head")  # in flight on a: 409 on b
            held = backends.requests("r1") + 1
            t = threading.Thread(target=lambda: post(a, chat(), ik="slow"))
            t.start()
            deadline = time.monotonic() + 10
            while backends.requests("r1") < held:  # claimed on a, and sent on: in flight
                assert time.monotonic() < deadline
                time.sleep(0.02)
            assert post(b, chat(), ik="slow").status_code == 409
            t.join(10)
            backends.mode("r1", "ok")

            proc.kill()  # Redis gone: each gateway keeps records on its own disk, says so, never a 500
            proc.wait(10)
            down = [post(a, chat(), ik="down") for _ in range(2)]
            assert [r.status_code for r in down] == [200, 200]
            assert down[0].headers["x-tensora-idempotency"] == "local" and down[1].headers[REPLAYED] == "true"
            proc = redis_process(port)  # back, empty
            time.sleep(0.3)
            first = post(a, chat(), ik="back")
            assert first.status_code == 200 and "x-tensora-idempotency" not in first.headers
            assert post(b, chat(), ik="back").headers[REPLAYED] == "true"
            assert ga.idem is not None and ga.idem.down_since is None
    finally:
        proc.kill()
        proc.wait(10)


def test_a_redis_that_never_answers_costs_a_timeout_not_a_500(backends: Backends, tmp_path: Path) -> None:
    from tests.support.doubles import Silent

    silent = Silent()
    try:
        t, spool = table(backends), Spooled(tmp_path / "spool")
        # the defaults: 50 ms a call; its clock stands still: it does not probe again
        lim = RedisLimiter(f"redis://127.0.0.1:{silent.port}/0", "t", clock=FakeClock())
        gw = Gateway(Options(ttft_s=1.5, deadline_s=4), lambda: t, lim, spool.meter,
                     idem=Idempotency(DiskStore(tmp_path / "idem"), RedisStore(lim.redis), probe_s=60),
                     on_shutdown=[spool.close])
        with serving(gw) as url:
            got = [post(url, chat())]
            asked = silent.received
            got += [post(url, chat()) for _ in range(2)]
        assert asked > 0 and silent.received == asked  # the first request waited on Redis; none after it did
        assert [r.status_code for r in got] == [200] * 3
        assert got[0].headers["x-tensora-idempotency"] == "local"
        assert got[1].headers[REPLAYED] == got[2].headers[REPLAYED] == "true"
        assert len(spool.records(1)) == 1
    finally:
        silent.close()


def test_settings_build_the_stores(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TENSORA_GATEWAY_KEY", "x")
    gw = build(GatewaySettings(data_dir=tmp_path, idempotency_keep_s=60, idempotency_max_answer_bytes=10))
    assert gw.idem is not None and gw.idem.shared is None and (gw.idem.keep_s, gw.idem.max_answer_bytes) == (60, 10)
    assert (tmp_path / "gateway" / "idempotency").is_dir()
    gw = build(GatewaySettings(data_dir=tmp_path, redis_url="redis://127.0.0.1:1/0"))
    assert gw.idem is not None and isinstance(gw.idem.shared, RedisStore)
    assert os.environ["TENSORA_GATEWAY_KEY"] == "x"
