"""The gateway's metrics, pure parts: X-Tensora-Attempts' markers to failover triggers, capped labels, and the
histogram's exposition (cumulative buckets, parsed back by prometheus-client)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import CollectorRegistry

from tensora.gateway.metrics import OTHER, TRIGGERS, Capped, GatewayMetrics, trigger

MARKERS = [  # (marker, trigger): every kind walk.py and relay.py put in X-Tensora-Attempts
    ("my-llm/r1:connect_refused", "connect"),
    ("my-llm/r1:connect_timeout", "connect"),
    ("my-llm/r1:connect_error", "connect"),
    ("peer:eu:tls_error", "connect"),
    ("my-llm/r1:http_500", "5xx"),
    ("my-llm/r1:http_503", "5xx"),
    ("my-llm/r1:timeout", "ttft"),
    ("my-llm/r1:http_429", "429"),
    ("my-llm/r1:rate_limited", "429"),
    ("my-llm/r1:breaker_open", "breaker_open"),
    ("my-llm/r1:context_length_exceeded", "context_length"),
    ("my-llm/r1:context_too_small", "context_length"),
    ("my-llm/r1:reset", "reset"),
    ("my-llm/r1:deadline", "deadline"),
    ("my-llm/r1:bad_response", OTHER),
    ("my-llm/r1:stream_error", OTHER),
    ("my-llm/r1:ok", None),  # served: not a failover
    ("my-llm/r1:http_400", None),  # a client error passed through as it came
    ("my-llm/r1:http_422", None),
]


@pytest.mark.parametrize(("marker", "expected"), MARKERS, ids=[m for m, _ in MARKERS])
def test_trigger(marker: str, expected: str | None) -> None:
    assert trigger(marker) == expected


@given(st.text(max_size=40))
def test_any_marker_maps_into_the_bounded_set(marker: str) -> None:
    assert trigger(marker) in (*TRIGGERS, None)


@given(st.lists(st.text(max_size=8), max_size=60), st.integers(1, 10))
def test_capped_keeps_the_first_values_and_never_more(values: list[str], cap: int) -> None:
    c = Capped(cap)
    out = [c(v) for v in values]
    first = list(dict.fromkeys(values))[:cap]
    assert set(out) - {OTHER} <= set(first)  # never more than ``cap`` values, and only the first seen
    assert all(o == v for v, o in zip(values, out, strict=True) if v in first)
    assert all(o == OTHER for v, o in zip(values, out, strict=True) if v not in first)


def test_histogram_exposition_parses_back() -> None:
    m = GatewayMetrics()
    for v in (0.05, 0.1, 0.5, 3.0):
        m.served("a/x", "replica", "replica", 200, False, 10.0, None, 10.0 + v, [])
    _, _, h = m.families()
    reg = CollectorRegistry()

    class One:
        def collect(self):  # type: ignore[no-untyped-def]
            yield h.family("t_seconds", "t", ["tier", "stream", "code"])

    reg.register(One())  # type: ignore[arg-type]
    from prometheus_client import generate_latest

    fam = next(text_string_to_metric_families(generate_latest(reg).decode()))
    got = {(s.name, s.labels.get("le")): s.value for s in fam.samples}
    assert got[("t_seconds_bucket", "0.1")] == 2  # le is inclusive
    assert got[("t_seconds_bucket", "1.0")] == 3
    assert got[("t_seconds_bucket", "+Inf")] == 4 == got[("t_seconds_count", None)]
    assert got[("t_seconds_sum", None)] == pytest.approx(3.65)


def test_endpoint_label_is_capped() -> None:
    m = GatewayMetrics(max_labels=2)
    for name in ("a/x", "b/y", "c/z", "d/w", "a/x"):
        m.served(name, "replica", "replica", 200, False, 0.0, 0.01, 0.02, [])
    requests = m.families()[0]
    assert {k[0] for k in requests} == {"a/x", "b/y", OTHER}
    assert requests[(OTHER, "replica", "replica", 200)] == 2


def test_rows_stay_as_few_as_the_labels() -> None:
    m = GatewayMetrics(max_labels=2)
    for i in range(1000):  # a tenant making endpoints, a peer saying anything
        m.served(f"o/e{i}", "peer", f"said {i}", 200, i % 2 == 0, 0.0, 0.01, 0.02, [])
    assert set(m.rows) == {("o/e0", "peer", OTHER, 200, True), ("o/e1", "peer", OTHER, 200, False),
                           (OTHER, "peer", OTHER, 200, True), (OTHER, "peer", OTHER, 200, False)}
    assert sum(r.requests for r in m.rows.values()) == 1000


def test_a_peers_served_by_is_bounded() -> None:
    m = GatewayMetrics()
    m.served("a/x", "peer", "replica", 200, False, 0.0, 0.01, 0.02, [])
    m.served("a/x", "peer", "anything a peer says", 200, False, 0.0, 0.01, 0.02, [])
    assert set(m.families()[0]) == {("a/x", "peer", "replica", 200), ("a/x", "peer", OTHER, 200)}
