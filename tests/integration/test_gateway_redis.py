"""Redis failing under the gateway: a real redis-server killed under load and started again, and a Redis that
accepts connections but never answers. Never a 500 and never a hang: ``local`` keeps serving at limit /
replicas per gateway, ``closed`` answers 503 with Retry-After, each transition is logged once, and the
limits are shared again once Redis answers."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tensora.gateway.app import GatewaySettings, build
from tensora.gateway.limits import Admission, Caller, FailMode, MemoryLimiter, Quota, RedisLimiter
from tensora.gateway.proxy import Gateway, Options
from tensora.gateway.routes import RouteTable
from tensora.keys import apikeys
from tests.support.clock import FakeClock
from tests.support.doubles import Silent
from tests.support.gateway_harness import Backends, backends_fixture, chat, make_table, replica, serving
from tests.support.services import free_port, redis_process

pytestmark = pytest.mark.timeout(180)

LOAD, CAROL = apikeys.generate(), apikeys.generate()
KEYS = {LOAD: ("alice", ["inference"]), CAROL: ("carol", ["inference"])}
OWNERS = {"alice": (10**7, 10**10), "carol": (6, 100_000)}  # alice: the load, never limited; carol: counted
MINUTE = 1_800_000_030.0


backends = backends_fixture(["r1"])


def table(b: Backends) -> RouteTable:
    eps = [{"id": f"wl_{o}", "name": "my-llm", "owner": o, "replicas": [replica("r1", b.url("r1"))]}
           for o in ("alice", "carol")]
    return make_table(eps, KEYS, owners=OWNERS)


class Load:
    """``workers`` concurrent clients posting through ``urls`` in turn until stopped: every status seen,
    and every 503 without Retry-After."""

    def __init__(self, urls: list[str], workers: int = 12) -> None:
        self.urls, self.workers = urls, workers
        self.codes: Counter[int] = Counter()
        self.bad_503: list[str] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    async def _run(self) -> None:
        async with httpx.AsyncClient(timeout=10, limits=httpx.Limits(max_connections=self.workers)) as client:
            async def worker(i: int) -> None:
                n = i
                while not self.stop.is_set():
                    n += 1
                    r = await client.post(f"{self.urls[n % len(self.urls)]}/chat/completions", json=chat(),
                                          headers={"Authorization": f"Bearer {LOAD}"})
                    self.codes[r.status_code] += 1
                    if r.status_code == 503 and ("retry-after" not in r.headers
                                                 or r.json()["error"]["code"] != "rate_limiter_unavailable"):
                        self.bad_503.append(r.text)
            await asyncio.gather(*(worker(i) for i in range(self.workers)))

    def __enter__(self) -> Load:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(30)
        assert not self.thread.is_alive()

    def served(self, at_least: int, within_s: float = 20) -> None:
        """Wait until ``at_least`` more answers have come."""
        goal, deadline = sum(self.codes.values()) + at_least, time.monotonic() + within_s
        while sum(self.codes.values()) < goal:
            assert time.monotonic() < deadline and self.thread.is_alive(), self.codes
            time.sleep(0.02)


def carol(url: str, n: int) -> list[int]:
    return [httpx.post(f"{url}/chat/completions", json=chat(), headers={"Authorization": f"Bearer {CAROL}"},
                       timeout=10).status_code for _ in range(n)]


def until(cond: object, within_s: float = 10) -> None:
    deadline = time.monotonic() + within_s
    while not cond():  # type: ignore[operator]
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def transitions(caplog: pytest.LogCaptureFixture) -> tuple[int, int]:
    msgs = [r.getMessage() for r in caplog.records]
    return sum("Redis lost" in m for m in msgs), sum("Redis back" in m for m in msgs)


def no_tracebacks(caplog: pytest.LogCaptureFixture) -> None:
    assert not [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]


@pytest.mark.parametrize("mode", [FailMode.LOCAL, FailMode.CLOSED])
def test_redis_killed_under_load_and_back(backends: Backends, mode: FailMode,
                                          caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="tensora.gateway")
    port = free_port()
    url = f"redis://127.0.0.1:{port}/0"
    proc = redis_process(port)
    wall = FakeClock(MINUTE)
    t = table(backends)
    # a killed Redis refuses at once, whatever the timeout; 0.5 s rather than 50 ms so that a healthy Redis on a
    # loaded test machine is never taken for a lost one (the 50 ms default is the silent Redis's test below)
    lims = [RedisLimiter(url, "t", fail_mode=mode, replicas=2, timeout_s=0.5, connect_timeout_s=0.5)
            for _ in range(2)]
    gws = [Gateway(Options(ttft_s=2, deadline_s=5, retry_after_s=3), lambda: t, lim, None, wall=wall) for lim in lims]
    try:
        with serving(gws[0]) as a, serving(gws[1]) as b, Load([a, b]) as load:
            load.served(100)
            assert carol(a, 4) + carol(b, 4) == [200] * 6 + [429] * 2  # shared: 6 of 8 over both gateways
            proc.kill()  # under load
            proc.wait(10)
            until(lambda: all(lim.down_since is not None for lim in lims))
            load.served(200)
            wall.advance(60)
            down = carol(a, 5)
            proc = redis_process(port)  # back, on the same port, empty
            until(lambda: all(lim.down_since is None for lim in lims))  # the load's requests probe it
            load.served(100)
            wall.advance(60)
            back = carol(a, 7) + carol(b, 1)
    finally:
        proc.kill()
        proc.wait(10)
    assert load.codes[500] == 0 and set(load.codes) <= {200, 503}, load.codes
    if mode is FailMode.LOCAL:
        assert load.codes[503] == 0
        assert down == [200] * 3 + [429] * 2  # each gateway on its own: 6 / 2 replicas
    else:
        assert load.codes[503] > 0 and not load.bad_503
        assert down == [503] * 5
    assert back == [200] * 6 + [429] * 2  # shared again: 6 in all
    assert transitions(caplog) == (2, 2)  # once per gateway each way, never per request
    no_tracebacks(caplog)


@pytest.fixture
def silent() -> Iterator[Silent]:
    s = Silent()
    try:
        yield s
    finally:
        s.close()


@pytest.mark.parametrize("timeout_s", [0.05, 0.4])
def test_a_redis_that_never_answers_costs_its_timeout_once(silent: Silent, timeout_s: float) -> None:
    async def go() -> tuple[int, int, Admission, Admission]:
        lim = RedisLimiter(f"redis://127.0.0.1:{silent.port}/0", "s", timeout_s=timeout_s, clock=FakeClock())
        try:
            first = await lim.admit(Caller("o", Quota(10, 1000)), 10, MINUTE)
            asked = silent.received
            second = await lim.admit(Caller("o", Quota(10, 1000)), 10, MINUTE)  # the clock stands still: no probe
            return asked, silent.received, first, second
        finally:
            await lim.close()

    asked, after, first, second = asyncio.run(go())
    assert asked > 0 and first.ok and first.local  # it asked Redis, timed out, and admitted on its own
    assert after == asked and second.ok and second.local  # the second did not ask: no second timeout


def test_over_http_a_silent_redis_is_no_hang_and_no_500(backends: Backends, silent: Silent,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="tensora.gateway")
    t = table(backends)
    lim = RedisLimiter(f"redis://127.0.0.1:{silent.port}/0", clock=FakeClock())  # it stands still: no probe
    gw = Gateway(Options(ttft_s=2, deadline_s=5), lambda: t, lim, None, wall=FakeClock(MINUTE))
    with serving(gw) as url:
        codes = carol(url, 1)
        asked = silent.received
        codes += carol(url, 7)
    assert codes == [200] * 6 + [429] * 2  # replicas 1: the whole limit, kept in this gateway
    assert asked > 0 and silent.received == asked  # the first request waited on Redis; none after it did
    assert transitions(caplog) == (1, 0)
    no_tracebacks(caplog)


def test_settings_reach_the_limiter(tmp_path: Path) -> None:
    (tmp_path / "admin-key").write_text(apikeys.generate())
    defaults = GatewaySettings(data_dir=tmp_path)
    assert (defaults.redis_timeout_s, defaults.redis_connect_timeout_s, defaults.redis_fail_mode,
            defaults.replicas) == (0.05, 0.05, FailMode.LOCAL, 1)
    assert isinstance(build(defaults).limiter, MemoryLimiter)
    s = GatewaySettings(data_dir=tmp_path, redis_url="redis://127.0.0.1:1/0", redis_timeout_s=0.2,
                        redis_connect_timeout_s=0.1, redis_fail_mode="closed", replicas=3, redis_probe_s=2)
    lim = build(s).limiter
    assert isinstance(lim, RedisLimiter)
    kw = lim.redis.connection_pool.connection_kwargs
    assert (kw["socket_timeout"], kw["socket_connect_timeout"]) == (0.2, 0.1)
    assert (lim.fail_mode, lim.replicas, lim.probe_s) == (FailMode.CLOSED, 3, 2)
    with pytest.raises(ValueError, match="redis_fail_mode"):
        GatewaySettings(data_dir=tmp_path, redis_fail_mode="open")
