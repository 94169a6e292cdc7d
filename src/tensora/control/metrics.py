"""The controller's metrics, from what a cycle already has: its decisions, its report, its duration.

The controller calls its ``ControllerMetrics``' ``cycle`` once a cycle (from its loop) and ``moved_back`` /
``replica_failed`` where those happen; everything else is derived here from the admission decisions, so the
controller itself carries no metrics code. Counted in plain dicts, each controller its own (``Controller.metrics``),
exposed by ``ControllerCollector`` on ``tensora serve``'s ``metrics_listen``. Labels: region, classes (the
catalog's names: bounded), kind, outcome.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from tensora.placement.admission import Place, Promote, RestartAvailable, Wait

# seconds from created (or queued again) to placed: an idle cluster places at once, a fallback waits its timer
PLACED_BUCKETS = (0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0, 4 * 3600.0)
CYCLE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class _Hist:
    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts: dict[tuple[str, ...], list[int]] = {}
        self.sums: dict[tuple[str, ...], float] = {}

    def observe(self, key: tuple[str, ...], v: float) -> None:
        c = self.counts.setdefault(key, [0] * (len(self.bounds) + 1))
        c[bisect.bisect_left(self.bounds, v)] += 1
        self.sums[key] = self.sums.get(key, 0.0) + v

    def family(self, name: str, doc: str, labels: list[str]) -> HistogramMetricFamily:
        f = HistogramMetricFamily(name, doc, labels=labels)
        for key, counts in list(self.counts.items()):
            acc, buckets = 0, []
            for le, n in zip((*(repr(float(b)) for b in self.bounds), "+Inf"), list(counts), strict=True):
                acc += n
                buckets.append((le, acc))
            f.add_metric(list(key), buckets, self.sums.get(key, 0.0))
        return f


class ControllerMetrics:
    """The counts of one controller (``Controller.metrics``), by region."""

    def __init__(self) -> None:
        self.lock = threading.Lock()  # the controller's thread writes, the listener's reads
        self.leader: dict[str, int] = {}
        self.queue: dict[str, dict[tuple[str, str], int]] = {}  # region -> (class, kind) -> waiting
        self.restarts_offered: dict[str, int] = {}
        self.crash_loops: dict[str, int] = {}  # region -> replicas waiting out a back-off
        self.placed = _Hist(PLACED_BUCKETS)  # region, outcome (requested, fallback)
        self.fallbacks: dict[tuple[str, str, str], int] = {}  # region, requested, placed
        self.moves_started: dict[tuple[str, str, str], int] = {}  # region, from, to
        self.moves_finished: dict[str, int] = {}
        self.failures: dict[tuple[str, str, str], int] = {}  # region, kind, role
        self.cycles = _Hist(CYCLE_BUCKETS)  # region, leader

    def cycle(self, region: str, report: Any, duration_s: float) -> None:
        """One cycle's report (``leader``, ``decisions``, ``decided``, and ``queue``: the waits that stand, all of
        them, where ``decisions`` hold only those decided again) and how long it took."""
        leader = bool(report.leader)
        decisions: Sequence[Any] = getattr(report, "decisions", ()) if leader else ()
        queue: dict[tuple[str, str], int] = {}
        offered = 0
        with self.lock:
            self.leader[region] = int(leader)
            self.cycles.observe((region, "leader" if leader else "standby"), duration_s)
            if not leader:  # a standby knows no queue: its gauges say nothing rather than something stale
                self.queue.pop(region, None)
                self.restarts_offered.pop(region, None)
                self.crash_loops.pop(region, None)
                return
            self.crash_loops[region] = int(getattr(report, "backing_off", 0))
            decided = bool(getattr(report, "decided", True))  # False: the last cycle's waits stand, and its gauges
            for d in decisions:
                if isinstance(d, Wait):
                    k = (d.workload.gpu_class, str(d.workload.kind))
                    queue[k] = queue.get(k, 0) + 1
                elif isinstance(d, Place):
                    w = d.workload
                    fell_back = d.cls != w.gpu_class
                    self.placed.observe((region, "fallback" if fell_back else "requested"),
                                        max(0.0, d.now - w.queued_since))
                    if fell_back:
                        k3 = (region, w.gpu_class, d.cls)
                        self.fallbacks[k3] = self.fallbacks.get(k3, 0) + 1
                elif isinstance(d, Promote):
                    k3 = (region, d.workload.placed_class, d.to_class)
                    self.moves_started[k3] = self.moves_started.get(k3, 0) + 1
                elif isinstance(d, RestartAvailable):
                    offered += 1
            if decided:
                self.queue[region] = queue
                self.restarts_offered[region] = offered
            standing = getattr(report, "queue", None)  # every wait that stands, not only those decided again
            if standing is not None:
                self.queue[region] = dict(standing)

    def moved_back(self, region: str) -> None:
        with self.lock:
            self.moves_finished[region] = self.moves_finished.get(region, 0) + 1

    def replica_failed(self, region: str, kind: str, role: str) -> None:
        with self.lock:
            k = (region, kind, role)
            self.failures[k] = self.failures.get(k, 0) + 1


class ControllerCollector(Collector):
    """The families of one controller's counts."""

    def __init__(self, m: ControllerMetrics) -> None:
        self.m = m

    def collect(self) -> Iterator[Metric]:
        m = self.m
        with m.lock:
            leader = dict(m.leader)
            queue = {r: dict(q) for r, q in m.queue.items()}
            offered = dict(m.restarts_offered)
            loops = dict(m.crash_loops)
            fallbacks, started = dict(m.fallbacks), dict(m.moves_started)
            finished, failures = dict(m.moves_finished), dict(m.failures)
            placed = m.placed.family("tensora_controller_time_to_placement_seconds", "From a workload's creation "
                                     "(or its queueing again) to its placement, by outcome: the requested class "
                                     "or a fallback", ["region", "outcome"])
            cycles = m.cycles.family("tensora_controller_cycle_duration_seconds", "One controller cycle, by role",
                                     ["region", "role"])
        g = GaugeMetricFamily("tensora_controller_leader", "1 while this controller holds its region's lease, 0 "
                              "on standby", labels=["region"])
        for region, v in leader.items():
            g.add_metric([region], v)
        yield g
        g = GaugeMetricFamily("tensora_controller_queue_depth", "Workload replicas waiting for placement after "
                              "the last cycle, by requested class and kind", labels=["region", "class", "kind"])
        for region, q in queue.items():
            for (cls, kind), n in q.items():
                g.add_metric([region, cls, kind], n)
        yield g
        g = GaugeMetricFamily("tensora_controller_restarts_offered", "Notebooks and VMs on a fallback class that "
                              "could restart on their requested class now", labels=["region"])
        for region, n in offered.items():
            g.add_metric([region], n)
        yield g
        g = GaugeMetricFamily("tensora_controller_crash_loops", "Workload replicas waiting out a crash-loop back-off "
                              "(their replicas kept failing) after the last cycle", labels=["region"])
        for region, n in loops.items():
            g.add_metric([region], n)
        yield g
        yield placed
        yield cycles
        yield _counter("tensora_controller_fallback_placements", "Placements on a fallback class, by requested and "
                       "placed class", ["region", "requested", "placed"], fallbacks)
        yield _counter("tensora_controller_move_backs_started", "Move-backs started (a replica on the preferred "
                       "class), by from and to class", ["region", "from", "to"], started)
        yield _counter("tensora_controller_move_backs_finished", "Move-backs whose replica became the primary",
                       ["region"], {(k,): v for k, v in finished.items()})
        yield _counter("tensora_controller_replica_failures", "Replicas that failed, by workload kind and role "
                       "(a crash loop shows as a steady rate here)", ["region", "kind", "role"], failures)


def _counter(name: str, doc: str, labels: list[str], values: Mapping[Any, int]) -> CounterMetricFamily:
    f = CounterMetricFamily(name, doc, labels=labels)
    for key, n in values.items():
        f.add_metric(list(key), n)
    return f
