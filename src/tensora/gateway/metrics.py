"""The gateway's metrics: counted in plain dicts on the request path, turned into Prometheus families at scrape time.

prometheus-client's ``labels(...).inc()`` takes a lock and looks its child up on every call; here a request costs
one dict lookup (its labels' ``Row``), a few increments and one bisect per histogram (the event loop is the only
writer, so no lock), and ``Collector`` sums the rows into the families when ``/metrics`` is read (from the
listener's thread: it copies the rows first). Breaker states and the spool are read at scrape time, never counted
per request. (A dict and a histogram each, keyed by label tuples built per request, cost a share of the gateway's
CPU per request that showed under load: the benchmarks page.)

Labels are bounded: ``endpoint`` (``owner/name``) and ``owner`` keep the first ``max_labels`` values seen and count
the rest as ``other`` (first seen, not top N: a value that moved from ``other`` to its own series would make
``other``'s counter go down); ``tier``, ``served_by``, ``status``, ``trigger`` and ``reason`` are small fixed sets;
no request ids, no free-form input.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any, Protocol

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

if TYPE_CHECKING:
    from tensora.gateway.breaker import Breaker
    from tensora.gateway.metering import Meter

log = logging.getLogger("tensora.gateway")

OTHER = "other"
NONE = "none"  # tier / served_by of an answer no backend gave (401, 429, 503...)
# seconds: time to the first token spans 10 ms (a warm small model) to the ttft deadline (30 s by default)
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
# X-Tensora-Attempts' markers (walk.py) -> the trigger of a failover
_TRIGGERS = {"connect_timeout": "connect", "connect_refused": "connect", "connect_error": "connect",
             "tls_error": "connect", "timeout": "ttft", "http_429": "429", "rate_limited": "429",
             "breaker_open": "breaker_open", "context_length_exceeded": "context_length",
             "context_too_small": "context_length", "reset": "reset", "deadline": "deadline"}


SERVED_BY = frozenset(("replica", "cpu", "serverless", "fallback-model", NONE))  # a peer's header says it: bounded
TRIGGERS = ("connect", "5xx", "ttft", "429", "breaker_open", "context_length", "reset", "deadline", OTHER)


class ProbeCounts(Protocol):
    """What the metrics read of the prober (``probe.Prober``): its probes by outcome."""

    ok: int
    failed: int


class Watched(Protocol):
    """What the collector reads of a gateway (``proxy.Gateway``): a protocol, so that compiled code checks no
    class at the door and anything of this shape serves (the docs' generator hands it a stand-in)."""

    @property
    def breakers(self) -> dict[str, Breaker]: ...

    @property
    def meter(self) -> Meter | None: ...

    @property
    def prober(self) -> ProbeCounts | None: ...


def trigger(marker: str) -> str | None:
    """The failover trigger of one X-Tensora-Attempts marker (``<backend>:<kind>``); None when it is not a
    failover (``ok``, or a client error passed through as it came)."""
    kind = marker.rpartition(":")[2]
    found = _TRIGGERS.get(kind)
    if found is not None:
        return found
    if kind.startswith("http_5"):
        return "5xx"
    if kind == "ok" or kind.startswith("http_4"):
        return None
    return OTHER


class Capped:
    """A label's first ``cap`` values, then ``other``."""

    __slots__ = ("cap", "seen")

    def __init__(self, cap: int) -> None:
        self.cap, self.seen = cap, set[str]()

    def __call__(self, value: str) -> str:
        if value in self.seen:
            return value
        if len(self.seen) < self.cap:
            self.seen.add(value)
            return value
        return OTHER


class Row:
    """The counts of the requests of one set of labels: endpoint (capped), tier, served_by (bounded), status, and
    whether it streamed. A histogram's counts are per bucket (not cumulative)."""

    __slots__ = ("labels", "latency", "latency_sum", "requests", "ttft", "ttft_sum")

    def __init__(self, labels: tuple[str, str, str, int, bool]) -> None:
        self.labels = labels
        self.requests = 0
        self.ttft = [0] * (len(TTFT_BUCKETS) + 1)
        self.ttft_sum = 0.0
        self.latency = [0] * (len(LATENCY_BUCKETS) + 1)
        self.latency_sum = 0.0


class Histogram:
    """Rows' counts summed by the labels of one family, at scrape time."""

    __slots__ = ("bounds", "counts", "sums")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts: dict[tuple[str, ...], list[int]] = {}
        self.sums: dict[tuple[str, ...], float] = {}

    def add(self, labels: tuple[str, ...], counts: list[int], total: float) -> None:
        c = self.counts.get(labels)
        if c is None:
            self.counts[labels], self.sums[labels] = list(counts), total
            return
        for i, n in enumerate(counts):
            c[i] += n
        self.sums[labels] += total

    def family(self, name: str, doc: str, labels: list[str]) -> HistogramMetricFamily:
        f = HistogramMetricFamily(name, doc, labels=labels)
        for key, counts in self.counts.items():
            acc, buckets = 0, []
            for le, n in zip((*map(_le, self.bounds), "+Inf"), counts, strict=True):
                acc += n
                buckets.append((le, acc))
            f.add_metric(list(key), buckets, self.sums[key])
        return f


def _le(v: float) -> str:
    return repr(float(v))


def _counter(name: str, doc: str, labels: list[str], values: dict[Any, int]) -> CounterMetricFamily:
    f = CounterMetricFamily(name, doc, labels=labels)
    for key, n in list(values.items()):
        f.add_metric([str(k) for k in (key if isinstance(key, tuple) else (key,))], n)
    return f


class GatewayMetrics:
    """What the gateway counts per request; ``Collector`` exposes it with what it reads at scrape time."""

    def __init__(self, max_labels: int = 100) -> None:
        self.max_labels = max_labels
        self.endpoint, self.owner = Capped(max_labels), Capped(max_labels)
        self.rows: dict[tuple[str, str, str, int, bool], Row] = {}  # by their labels
        self.failovers: dict[str, int] = dict.fromkeys(TRIGGERS, 0)
        self.rejected: dict[tuple[str, str], int] = {}  # owner, reason

    def served(self, endpoint: str, tier: str, served_by: str, status: int, stream: bool, start: float,
               first: float | None, end: float, attempts: list[str]) -> None:
        row = self.rows.get((endpoint, tier, served_by, status, stream))  # found when the values are their labels
        if row is None:
            row = self._row(endpoint, tier, served_by, status, stream)
        row.requests += 1
        if first is not None and status == 200:
            v = first - start
            row.ttft[bisect.bisect_left(TTFT_BUCKETS, v)] += 1
            row.ttft_sum += v
        v = end - start
        row.latency[bisect.bisect_left(LATENCY_BUCKETS, v)] += 1
        row.latency_sum += v
        if attempts:
            f = self.failovers
            for m in attempts:
                t = trigger(m)
                if t is not None:
                    f[t] += 1

    def refused(self, owner: str, reason: str) -> None:
        key = (self.owner(owner), reason)
        self.rejected[key] = self.rejected.get(key, 0) + 1

    def _row(self, endpoint: str, tier: str, served_by: str, status: int, stream: bool) -> Row:
        """The row of these values' labels. Kept under the values themselves only where they are its labels, so the
        rows stay as few as the labels (an endpoint past the cap, a peer's unknown served_by: looked up here)."""
        labels = (self.endpoint(endpoint), tier, served_by if served_by in SERVED_BY else OTHER, status, stream)
        row = self.rows.get(labels)
        if row is None:
            row = self.rows[labels] = Row(labels)
        return row

    def families(self) -> tuple[dict[tuple[str, str, str, int], int], Histogram, Histogram]:
        """The rows summed by each family's labels: requests (endpoint, tier, served_by, status), time to the first
        token (tier, stream; 200s only) and duration (tier, stream, status class)."""
        requests: dict[tuple[str, str, str, int], int] = {}
        ttft, latency = Histogram(TTFT_BUCKETS), Histogram(LATENCY_BUCKETS)
        for row in list(self.rows.values()):
            endpoint, tier, served_by, status, stream = row.labels
            key = (endpoint, tier, served_by, status)
            requests[key] = requests.get(key, 0) + row.requests
            s = "true" if stream else "false"
            if any(row.ttft):
                ttft.add((tier, s), row.ttft, row.ttft_sum)
            latency.add((tier, s, f"{status // 100}xx"), row.latency, row.latency_sum)
        return requests, ttft, latency


class GatewayCollector:
    """The families of one gateway: its counts, and its breakers, spool and prober as they are now. A
    prometheus-client ``Collector`` by its ``collect`` (a protocol): a compiled class subclasses no dependency's
    class (the build sees dependencies as ``Any``, and mypyc's class built on ``Any`` crashed at run time)."""

    def __init__(self, gw: Watched, metrics: GatewayMetrics, clock: Callable[[], float]) -> None:
        self.gw, self.metrics, self.clock = gw, metrics, clock

    def collect(self) -> Iterator[Metric]:
        m, gw = self.metrics, self.gw
        requests, ttft, latency = m.families()
        yield _counter("tensora_gateway_requests", "Inference requests answered, by endpoint (owner/name, capped), "
                       "the chain's tier that answered, what served it and the HTTP status",
                       ["endpoint", "tier", "served_by", "status"], requests)
        yield ttft.family("tensora_gateway_ttft_seconds", "Time from a request's arrival to its answer's "
                            "head (a stream's first content event), 200s only", ["tier", "stream"])
        yield latency.family("tensora_gateway_request_duration_seconds", "Time from a request's arrival to "
                               "its answer's last byte", ["tier", "stream", "code"])
        yield _counter("tensora_gateway_failovers", "Attempts that did not answer and moved the request on (or "
                       "ended it), by trigger (X-Tensora-Attempts' markers)", ["trigger"], m.failovers)
        yield _counter("tensora_gateway_rate_limited", "Requests refused by the gateway's rate limits, by owner "
                       "(capped) and reason (requests, tokens, too_large, unavailable)", ["owner", "reason"],
                       m.rejected)
        yield from self._breakers()
        yield from self._meter()
        prober = gw.prober
        if prober is not None:
            yield _counter("tensora_gateway_probes", "Active probes of ejected backends, by outcome",
                           ["outcome"], {"ok": prober.ok, "failed": prober.failed})

    def _breakers(self) -> Iterable[Metric]:
        now = self.clock()
        states = {"closed": 0, "open": 0, "half_open": 0}
        ejected = GaugeMetricFamily("tensora_gateway_backend_ejected", "1 for each backend whose breaker is open "
                                    "or half-open, by backend (endpoint/replica or peer:region) and state",
                                    labels=["backend", "state"])
        for key, b in list(self.gw.breakers.items()):
            state = b.state(now).value
            states[state] += 1
            if state != "closed":
                ejected.add_metric([key, state], 1)
        yield ejected
        g = GaugeMetricFamily("tensora_gateway_breakers", "Backends' breakers by state (read at scrape time)",
                              labels=["state"])
        for state, n in states.items():
            g.add_metric([state], n)
        yield g

    def _meter(self) -> Iterable[Metric]:
        meter = self.gw.meter
        if meter is None:
            return
        try:
            sizes = [f.stat().st_size for f in meter.batches()]
        except OSError:  # a batch sent (deleted) while it was listed
            sizes = []
        yield GaugeMetricFamily("tensora_gateway_spool_batches", "Usage batches on disk not yet taken by the "
                                "control API", value=len(sizes))
        yield GaugeMetricFamily("tensora_gateway_spool_bytes", "Bytes of those batches", value=sum(sizes))
        yield CounterMetricFamily("tensora_gateway_usage_records_sent", "Usage records the control API took",
                                  value=meter.sent)
        yield CounterMetricFamily("tensora_gateway_usage_send_failures", "Usage batches the control API did not "
                                  "take (down, refused, 5xx): kept and sent again", value=meter.failures)
        yield CounterMetricFamily("tensora_gateway_usage_records_dropped", "Usage records dropped: the spool was "
                                  "over usage_spool_max_bytes", value=meter.dropped)
        yield CounterMetricFamily("tensora_gateway_usage_records_bad", "Unreadable spool lines moved to spool/bad",
                                  value=meter.bad)
