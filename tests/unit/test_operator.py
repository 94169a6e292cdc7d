"""The operator page's arithmetic (``tensora.api.operator``): quantiles from cumulative buckets as Prometheus'
``histogram_quantile`` reads them, counters differenced over the window (a restart counted as all new), and the
ring of one sample a minute: totals since start until the samples cover an hour, then the last hour, 61 kept."""

from __future__ import annotations

from collections import deque
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tensora.api.operator import KEPT, Sampler, figures, quantile, since, snapshot

QUANTILES = {
    "no observations": (0.5, {}, None),
    "all zero": (0.5, {"1.0": 0, "+Inf": 0}, None),
    "one bucket, median halfway": (0.5, {"1.0": 4, "+Inf": 4}, 0.5),
    "second bucket": (0.5, {"1.0": 1, "2.0": 3, "+Inf": 3}, 1.25),
    "p99 in +Inf: the highest finite bound": (0.99, {"1.0": 1, "2.0": 1, "+Inf": 10}, 2.0),
    "p99 at the top of a bucket": (0.99, {"0.1": 0, "0.5": 100, "+Inf": 100}, 0.1 + 0.4 * 0.99),
}


@pytest.mark.parametrize("case", QUANTILES)
def test_quantile(case: str) -> None:
    q, buckets, want = QUANTILES[case]
    got = quantile(q, {k: float(v) for k, v in buckets.items()})
    assert got == (pytest.approx(want) if want is not None else None)


@given(st.lists(st.integers(0, 50), min_size=1, max_size=8), st.floats(0.01, 1.0))
def test_quantile_lies_within_the_bounds(counts: list[int], q: float) -> None:
    bounds = [0.1 * 2**i for i in range(len(counts))]
    acc, buckets = 0, {}
    for b, n in zip(bounds, counts, strict=True):
        acc += n
        buckets[repr(b)] = float(acc)
    buckets["+Inf"] = float(acc)
    got = quantile(q, buckets)
    assert got is None if acc == 0 else 0.0 <= got <= bounds[-1]


def test_since_counts_a_restart_as_all_new() -> None:
    assert since({"a": 5.0, "b": 2.0, "c": 1.0}, {"a": 3.0, "b": 7.0}) == {"a": 2.0, "b": 2.0, "c": 1.0}


def snap(fallbacks: float, ttft_fast: float = 0.0) -> dict[str, Any]:
    s = snapshot([], None)
    s["fallbacks"] = {"h100-80gb -> cpu": fallbacks}
    s["ttft"] = {"0.1": ttft_fast, "+Inf": ttft_fast}
    return s


def test_totals_since_start_until_a_sample_a_minute_old_then_the_last_hour() -> None:
    ring: deque[tuple[float, dict[str, Any]]] = deque(maxlen=61)
    first = figures(1000.0, snap(3), ring)
    assert first["window_s"] is None and first["fallbacks"] == {"h100-80gb -> cpu": 3}
    assert first["gateway"] is False and first["ttft"] == {"p50": None, "p99": None}
    again = figures(1030.0, snap(4), ring)  # under a minute: no new sample, still since start
    assert len(ring) == 1 and again["window_s"] is None and again["fallbacks"] == {"h100-80gb -> cpu": 4}
    for i in range(1, 100):  # a sample every minute for 99 minutes, two fallbacks a minute
        out = figures(1000.0 + 60 * i, snap(3 + 2 * i, ttft_fast=i), ring)
        if i == 58:  # not an hour yet: since start
            assert out["window_s"] is None and out["fallbacks"] == {"h100-80gb -> cpu": 3 + 2 * 58}
    assert len(ring) == 61  # bounded
    assert out["window_s"] == 3600 and out["fallbacks"] == {"h100-80gb -> cpu": 120}
    assert out["ttft"]["p50"] is not None and out["ttft"]["p50"] <= 0.1


def test_nothing_moved_shows_nothing() -> None:
    ring: deque[tuple[float, dict[str, Any]]] = deque(maxlen=61)
    for t in range(0, 3601, 60):
        out = figures(float(t), snap(3), ring)
    assert out["window_s"] == 3600 and out["fallbacks"] == {}


def test_two_samplers_keep_rings_of_their_own() -> None:
    """Each app has its sampler (``create_app``): a read of one is no sample of the other's hour."""
    a, b = Sampler(every_s=3600), Sampler(every_s=3600)
    try:
        got = a.read({})  # no listeners: nothing scraped, a sample all the same
        assert got["control"] is False and got["window_s"] is None
        assert len(a.ring) == 1 and len(b.ring) == 0 and a.ring.maxlen == b.ring.maxlen == KEPT
        assert a.thread is not None and b.thread is None  # the first read starts the reader's thread alone
    finally:
        a.stop()
        b.stop()
    assert a.thread is not None and not a.thread.is_alive()


def test_a_stopped_sampler_starts_no_thread() -> None:
    s = Sampler()
    s.stop()
    s.read({})
    assert s.thread is None and len(s.ring) == 1
