"""The gateway's metrics: a scripted story against fake backends (requests served, a rate-limit
rejection, a failover on 503s that opens a breaker, a request that skips it, usage the control API refuses), then
a scrape of ``/metrics`` over HTTP on its own listener, parsed with prometheus-client's parser: every counter
moved by exactly what the story did."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tensora.api import operator
from tensora.gateway.breaker import Policy
from tensora.gateway.limits import MemoryLimiter
from tensora.gateway.metering import Meter
from tensora.gateway.metrics import GatewayCollector, GatewayMetrics
from tensora.gateway.proxy import Gateway, Options
from tensora.keys import apikeys
from tensora.telemetry.scrape import Listener
from tests.support.gateway_harness import Backends, backends_fixture, chat, make_table, replica, serving

pytestmark = pytest.mark.timeout(120)

ALICE, ALICE_SLOW = apikeys.generate(), apikeys.generate()
backends = backends_fixture(["r1", "c1"])


@pytest.fixture(autouse=True)
def _reset(backends: Backends) -> None:
    backends.reset()


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of a scrape: (name, sorted labels) -> value."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def value(found: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str) -> float:
    return found.get((name, tuple(sorted(labels.items()))), 0.0)


def scrape(port: int) -> str:
    r = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5)
    assert r.status_code == 200
    return r.text


def test_story_then_scrape(backends: Backends, tmp_path: Path) -> None:
    refused: list[int] = []

    async def control_api_down(records: list[bytes]) -> bool:
        refused.append(len(records))
        return False

    table = make_table([{"id": "wl_main", "name": "my-llm", "owner": "alice", "cpu_fallback": True,
                         "replicas": [replica("r1", backends.url("r1")), replica("c1", backends.url("c1"), cpu=True)]}],
                       {ALICE: ("alice", ["inference"]), ALICE_SLOW: ("alice", ["inference"])},
                       limits={ALICE_SLOW: (1, None)})
    meter = Meter(tmp_path / "spool", control_api_down)
    metrics = GatewayMetrics()
    gw = Gateway(Options(retry_delay_s=0.0, breaker=Policy(consecutive=2, base_s=300)), lambda: table,
                 MemoryLimiter(), meter, metrics=metrics)
    listener = Listener("127.0.0.1:0", GatewayCollector(gw, metrics, gw.clock), process=False)
    assert listener.start()
    try:
        before = samples(scrape(listener.port))
        assert value(before, "tensora_gateway_failovers_total", trigger="5xx") == 0
        with serving(gw) as url:
            def post(key: str, **kw: Any) -> httpx.Response:
                return httpx.post(f"{url}/chat/completions", json=chat(**kw),
                                  headers={"authorization": f"Bearer {key}"}, timeout=30)

            assert [post(ALICE).status_code for _ in range(2)] == [200, 200]
            assert [post(ALICE_SLOW).status_code for _ in range(2)] == [200, 429]  # the key's 1 request a minute
            backends.mode("r1", "http_503")
            r = post(ALICE)  # r1 alone in its tier: tried twice (503, 503), its breaker opens; c1 answers
            assert r.status_code == 200 and r.headers["x-tensora-served-by"] == "cpu"
            assert r.headers["x-tensora-attempts"].count(":http_503") == 2
            r = post(ALICE, stream=True)  # r1 skipped at once: breaker_open
            assert r.status_code == 200 and "my-llm/r1:breaker_open" in r.headers["x-tensora-attempts"]
            time.sleep(0.1)  # the usage records' 5 ms write
        asyncio.run(meter.flush())  # the control API refuses the batch: kept, counted
        found = samples(scrape(listener.port))
        ops = operator.snapshot(None, operator.scrape(f"127.0.0.1:{listener.port}"))  # the operator page's read
    finally:
        listener.close()
        meter.close()
    assert operator.scrape(f"127.0.0.1:{listener.port}") is None  # gone: "gateway metrics unavailable"

    ep = {"endpoint": "alice/my-llm"}
    assert value(found, "tensora_gateway_requests_total", **ep, tier="replica", served_by="replica", status="200") == 3
    assert value(found, "tensora_gateway_requests_total", **ep, tier="cpu", served_by="cpu", status="200") == 2
    assert value(found, "tensora_gateway_requests_total", **ep, tier="none", served_by="none", status="429") == 1
    assert value(found, "tensora_gateway_failovers_total", trigger="5xx") == 2
    assert value(found, "tensora_gateway_failovers_total", trigger="breaker_open") == 1
    assert sum(value(found, "tensora_gateway_failovers_total", trigger=t) for t in ("connect", "ttft", "429")) == 0
    assert value(found, "tensora_gateway_rate_limited_total", owner="alice", reason="requests") == 1
    assert value(found, "tensora_gateway_breakers", state="open") == 1
    assert value(found, "tensora_gateway_breakers", state="closed") == 1  # c1's
    assert value(found, "tensora_gateway_backend_ejected", backend="my-llm/r1", state="open") == 1
    assert value(found, "tensora_gateway_ttft_seconds_count", tier="replica", stream="false") == 3
    assert value(found, "tensora_gateway_ttft_seconds_count", tier="cpu", stream="false") == 1
    assert value(found, "tensora_gateway_ttft_seconds_count", tier="cpu", stream="true") == 1
    assert value(found, "tensora_gateway_ttft_seconds_bucket", tier="cpu", stream="true", le="+Inf") == 1
    assert value(found, "tensora_gateway_request_duration_seconds_count", tier="none", stream="false",
                 code="4xx") == 1
    assert value(found, "tensora_gateway_request_duration_seconds_sum", tier="replica", stream="false",
                 code="2xx") > 0
    assert refused and value(found, "tensora_gateway_usage_send_failures_total") == 1
    assert value(found, "tensora_gateway_spool_batches") == 1 and value(found, "tensora_gateway_spool_bytes") > 0
    assert ops["gateway"] and not ops["control"]
    assert {k: v for k, v in ops["failovers"].items() if v} == {"5xx": 2, "breaker_open": 1}
    assert ops["breakers"] == {"closed": 1, "open": 1, "half_open": 0} and ops["ejected"] == ["my-llm/r1 (open)"]
    assert ops["ttft"]["+Inf"] == 5 and operator.quantile(0.5, ops["ttft"]) is not None
    assert ops["spool"]["batches"] == 1 and ops["spool"]["bytes"] > 0


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool absent (Debian: apt-get install prometheus)")
def test_promtool_accepts_the_exposition(backends: Backends) -> None:
    table = make_table([{"id": "wl_main", "name": "my-llm", "owner": "alice",
                         "replicas": [replica("r1", backends.url("r1"))]}], {ALICE: ("alice", ["inference"])})
    metrics = GatewayMetrics()
    gw = Gateway(Options(), lambda: table, MemoryLimiter(), None, metrics=metrics)
    listener = Listener("127.0.0.1:0", GatewayCollector(gw, metrics, gw.clock))
    assert listener.start()
    try:
        with serving(gw) as url:
            r = httpx.post(f"{url}/chat/completions", json=chat(), headers={"authorization": f"Bearer {ALICE}"})
            assert r.status_code == 200
        text = scrape(listener.port)
    finally:
        listener.close()
    done = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
