"""Tracing (OpenTelemetry), its spans caught by the SDK's in-memory exporter: a gateway request
whose replica answers 503 twice (tried again, its tier's only one) and whose CPU replica answers, sent with a
caller's ``traceparent``: one request span (the caller's span its parent), one child per attempt with its tier,
backend and outcome, and the ``traceparent`` each backend got naming its own attempt's span. A controller cycle's
span carries its steps. Off (the default), no header is sent and no opentelemetry module is imported."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from tensora.config.settings import ServeSettings
from tensora.gateway.app import GatewaySettings
from tensora.gateway.breaker import Policy
from tensora.gateway.chain import Peer
from tensora.gateway.limits import MemoryLimiter
from tensora.gateway.proxy import Gateway, Options
from tensora.keys import apikeys
from tensora.telemetry.tracing import Tracing, TracingSettings, setup
from tests.support.gateway_harness import Backends, backends_fixture, chat, make_table, replica, serving
from tests.support.services import free_port
from tests.support.stack import stack

pytestmark = pytest.mark.timeout(120)

ALICE = apikeys.generate()
KEYS = {ALICE: ("alice", ["inference"])}
backends = backends_fixture(["r1", "c1"])
CALLER_TRACE, CALLER_SPAN = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"


@pytest.fixture(autouse=True)
def _reset(backends: Backends) -> None:
    backends.reset()


def traced() -> tuple[Tracing, InMemorySpanExporter]:
    spans = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(spans))
    return Tracing(provider), spans


def gateway(backends: Backends, tracing: Tracing | None) -> Gateway:
    table = make_table([{"id": "wl_main", "name": "my-llm", "owner": "alice", "cpu_fallback": True,
                         "replicas": [replica("r1", backends.url("r1")), replica("c1", backends.url("c1"), cpu=True)]}],
                       KEYS)
    gw = Gateway(Options(retry_delay_s=0.0, breaker=Policy(consecutive=5, base_s=300)), lambda: table,
                 MemoryLimiter(), None)
    gw.tracing = gw.walk.tracing = tracing
    return gw


def test_a_request_and_its_attempts(backends: Backends) -> None:
    tracing, spans = traced()
    backends.mode("r1", "http_503")
    with serving(gateway(backends, tracing)) as url:
        r = httpx.post(f"{url}/chat/completions", json=chat(), timeout=30,
                       headers={"authorization": f"Bearer {ALICE}",
                                "traceparent": f"00-{CALLER_TRACE}-{CALLER_SPAN}-01"})
    assert r.status_code == 200 and r.headers["x-tensora-served-by"] == "cpu"
    done = spans.get_finished_spans()
    [req] = [s for s in done if s.name == "gateway.request"]
    attempts = sorted((s for s in done if s.name == "gateway.attempt"), key=lambda s: s.start_time or 0)
    assert len(done) == 4
    assert req.kind == SpanKind.SERVER and req.parent is not None
    assert (format(req.context.trace_id, "032x"), format(req.parent.span_id, "016x")) == (CALLER_TRACE, CALLER_SPAN)
    assert req.attributes is not None
    assert dict(req.attributes) | {"tensora.request_id": "-"} == {
        "http.route": "/chat/completions", "tensora.request_id": "-", "http.response.status_code": 200,
        "tensora.endpoint": "alice/my-llm", "tensora.stream": False, "tensora.attempts": 2,
        "tensora.served_by": "cpu"}
    assert [(a.attributes or {}).get("tensora.backend") for a in attempts] == ["my-llm/r1", "my-llm/r1", "my-llm/c1"]
    assert [(a.attributes or {}).get("tensora.tier") for a in attempts] == ["replica", "replica", "cpu"]
    assert [(a.attributes or {}).get("tensora.outcome") for a in attempts] == ["http_503", "http_503", "ok"]
    for a in attempts:
        assert a.kind == SpanKind.CLIENT and a.parent is not None and a.parent.span_id == req.context.span_id
        assert a.context.trace_id == req.context.trace_id
    trace = format(req.context.trace_id, "032x")
    assert backends.traceparent("c1") == f"00-{trace}-{format(attempts[2].context.span_id, '016x')}-01"
    assert backends.traceparent("r1") == f"00-{trace}-{format(attempts[1].context.span_id, '016x')}-01"


def test_a_peer_continues_the_trace(backends: Backends) -> None:
    """Region local's one replica refuses connections: the request goes to region us's gateway, whose request
    span is the child of local's attempt span for it (the traceparent it was sent)."""
    tracing, spans = traced()
    us_table = make_table([{"id": "wl_us", "name": "my-llm", "owner": "alice", "region": "us",
                            "replicas": [replica("us1", backends.url("c1"))]}], KEYS, region="us")
    us = Gateway(Options(region="us"), lambda: us_table, MemoryLimiter(), None)
    us.tracing = us.walk.tracing = tracing
    with serving(us) as us_url:
        table = make_table([{"id": "wl_main", "name": "my-llm", "owner": "alice", "allow_cross_region": True,
                             "replicas": [replica("r1", f"http://127.0.0.1:{free_port()}/v1")]}], KEYS)
        local = Gateway(Options(ttft_s=2.0, deadline_s=10.0, peers=(Peer("us", us_url),)), lambda: table,
                        MemoryLimiter(), None)
        local.tracing = local.walk.tracing = tracing
        with serving(local) as url:
            r = httpx.post(f"{url}/chat/completions", json=chat(), timeout=30,
                           headers={"authorization": f"Bearer {ALICE}"})
    assert r.status_code == 200, r.text
    done = spans.get_finished_spans()
    by_backend = {(s.attributes or {}).get("tensora.backend"): s for s in done if s.name == "gateway.attempt"}
    requests = [s for s in done if s.name == "gateway.request"]
    assert len(requests) == 2 and set(by_backend) == {"my-llm/r1", "peer:us", "my-llm/us1"}
    [mine] = [s for s in requests if s.parent is None]
    [theirs] = [s for s in requests if s.parent is not None]
    hop = by_backend["peer:us"]
    assert (by_backend["my-llm/r1"].attributes or {})["tensora.outcome"] == "connect_refused"
    assert (hop.attributes or {})["tensora.tier"] == "peer" and (hop.attributes or {})["tensora.outcome"] == "ok"
    assert hop.parent is not None and hop.parent.span_id == mine.context.span_id
    assert theirs.parent is not None and theirs.parent.span_id == hop.context.span_id
    assert by_backend["my-llm/us1"].parent is not None
    assert by_backend["my-llm/us1"].parent.span_id == theirs.context.span_id
    assert {s.context.trace_id for s in done} == {mine.context.trace_id}


def test_off_sends_nothing_and_imports_nothing(backends: Backends) -> None:
    with serving(gateway(backends, None)) as url:
        r = httpx.post(f"{url}/chat/completions", json=chat(), timeout=30,
                       headers={"authorization": f"Bearer {ALICE}"})
    assert r.status_code == 200 and backends.traceparent("r1") is None
    code = ("import sys, tensora.gateway.app, tensora.gateway.__main__, tensora.control.controller;"
            "bad = sorted(m for m in sys.modules if m.startswith('opentelemetry'));"
            "assert not bad, bad")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr


def test_a_controller_cycle_and_its_steps(tmp_path: Path) -> None:
    s = stack(str(tmp_path / "t.db"), tmp_path, run_controller=False)
    tracing, spans = traced()
    s.controller.tracing = tracing
    try:
        report = s.controller._traced()
    finally:
        s.services.db.dispose()
    assert report.leader
    [cycle] = spans.get_finished_spans()
    assert cycle.name == "controller.cycle" and cycle.parent is None
    assert dict(cycle.attributes or {}) == {"tensora.region": s.controller.region, "tensora.leader": True,
                                            "tensora.decisions": 0}
    assert [e.name for e in cycle.events] == ["lead", "observe", "reconcile", "changes", "decide", "apply"]


def test_settings_turn_it_on(tmp_path: Path) -> None:
    assert setup(None, "x") is None and setup(TracingSettings(), "x") is None
    on: Any = {"otlp_endpoint": "http://127.0.0.1:9/v1/traces"}
    assert GatewaySettings(data_dir=tmp_path, tracing=on).tracing == TracingSettings(**on)
    assert ServeSettings(tracing=on).tracing == TracingSettings(**on)
    with pytest.raises(ValueError, match="extra"):
        TracingSettings(endpoint="x")  # type: ignore[call-arg]
    t = setup(TracingSettings(**on), "tensora-gateway")
    assert t is not None
    assert t.provider.resource.attributes["service.name"] == "tensora-gateway"
    t.close()
