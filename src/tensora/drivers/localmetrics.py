"""The local driver's metrics, read at scrape time: replicas by kind and state (from their ``replica.json``), the
processes its sandboxes lost to their memory limit, and which runtimes are installed (``tensora runtime install``
runs in a process of its own: what the server can tell is what is there)."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from tensora.drivers.local import LocalDriver
from tensora.models import runtimes


class LocalCollector(Collector):
    def __init__(self, driver: LocalDriver) -> None:
        self.driver = driver

    def collect(self) -> Iterator[Metric]:
        counts: dict[tuple[str, str], int] = {}
        for record in self.driver.records.all():
            k = (record.kind.value, record.state.value)
            counts[k] = counts.get(k, 0) + 1
        g = GaugeMetricFamily("tensora_local_replicas", "This machine's replicas by workload kind and state (stopped "
                              "and failed ones for a while after they end)", labels=["kind", "state"])
        for (kind, state), n in sorted(counts.items()):
            g.add_metric([kind, state], n)
        yield g
        yield CounterMetricFamily("tensora_local_sandbox_oom_kills", "Processes of replicas' sandboxes killed for "
                                  "their memory limit (since this server started)", value=self.driver.oom_kills)
        g = GaugeMetricFamily("tensora_local_runtimes_installed", "1 for each model-server runtime installed on this "
                              "machine (tensora runtime install NAME), 0 for the others", labels=["runtime"])
        for name in sorted(runtimes.REGISTRY):
            g.add_metric([name], int(runtimes.installed(self.driver.runtimes, name)))
        yield g
