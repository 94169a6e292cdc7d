"""The metrics reference: every family each part of Tensora exposes on its ``/metrics``, read from the collectors
themselves (the control API's registry, the controller's, the gateway's and the local driver's collectors), with
its type, labels and help."""

from __future__ import annotations

import tempfile
from collections.abc import Iterable
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.registry import Collector

from tensora.docsgen import markdown as md

SERIES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "summary": ("_sum", "_count")}


def _labels(family: Any, declared: dict[str, tuple[str, ...]]) -> tuple[str, ...]:
    # a family built at scrape time keeps its label names; the client library's own metrics are declared ones
    names = getattr(family, "_labelnames", None)
    if names is None:
        names = declared.get(family.name, ())
    return tuple(names)


def _table(collector: Collector, declared: dict[str, tuple[str, ...]] | None = None) -> str:
    rows = []
    for family in sorted(collector.collect(), key=lambda f: f.name):
        series = " ".join(md.code(family.name + s) for s in SERIES.get(family.type, ("",)))
        labels = ", ".join(md.code(n) for n in _labels(family, declared or {}))
        rows.append([series, family.type, labels, md.cell(family.documentation)])
    return md.table(["Series", "Type", "Labels", "Help"], rows)


def _declared(metrics: Iterable[Any]) -> dict[str, tuple[str, ...]]:
    """The label names of prometheus-client's own metrics (a Counter's, a Histogram's), by family name."""
    return {m._name: tuple(m._labelnames) for m in metrics if isinstance(m, MetricWrapperBase)}


def _api() -> str:
    from tensora.api import metrics

    return _table(metrics.REGISTRY, _declared(vars(metrics).values()))


def _controller() -> str:
    from tensora.control.metrics import ControllerCollector, ControllerMetrics

    return _table(ControllerCollector(ControllerMetrics()))


def _gateway() -> str:
    from tensora.gateway.metrics import GatewayCollector, GatewayMetrics, Watched

    # a gateway as the collector reads it, with a usage spool and a prober: every family it can yield
    meter = SimpleNamespace(batches=list, sent=0, failures=0, dropped=0, bad=0)
    gw = SimpleNamespace(breakers={}, meter=meter, prober=SimpleNamespace(ok=0, failed=0))
    return _table(GatewayCollector(cast(Watched, gw), GatewayMetrics(), lambda: 0.0))


def _local() -> str:
    from tensora.drivers.local import LocalDriver
    from tensora.drivers.localmetrics import LocalCollector

    with tempfile.TemporaryDirectory() as empty:  # no replicas, no runtimes: every family, each runtime at 0
        driver = SimpleNamespace(records=SimpleNamespace(all=list), oom_kills=0, runtimes=Path(empty))
        return _table(LocalCollector(cast(LocalDriver, driver)))


def render() -> str:
    return "\n".join([
        "# Metrics reference\n", md.HEADER,
        "Prometheus' text format. Counters are exposed with `_total`, histograms as `_bucket`, `_sum` and "
        "`_count`. Labels are bounded: route templates rather than paths, catalog class names, and endpoint and "
        "owner names capped at `gateway.metrics_max_labels` (the rest count as `other`).\n",
        "## Control API\n",
        "On `tensora serve`'s `metrics_listen` (default `127.0.0.1:<port + 10>`, 8710), with the controller's.\n",
        _api(),
        "## Controller\n",
        "On the same listener, from the process that runs the region's controller.\n",
        _controller(),
        "## Gateway\n",
        "On the gateway's `gateway.metrics_listen` (default `127.0.0.1:<port + 10>`, 8711).\n",
        _gateway(),
        "## Local driver\n",
        "On `metrics_listen` where the server runs the local driver (`tensora up`).\n",
        _local(),
    ])
