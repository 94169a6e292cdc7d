"""The controller's metric state (control.metrics) from its cycle reports, read as a scrape reads it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tensora.control.metrics import ControllerCollector, ControllerMetrics
from tensora.placement.admission import Queued, Wait
from tensora.placement.kinds import WorkloadKind


@dataclass
class Report:
    leader: bool
    decisions: list[Any] = field(default_factory=list)
    backing_off: int = 0
    decided: bool = True
    queue: dict[tuple[str, str], int] | None = None


def gauge(m: ControllerMetrics, name: str) -> dict[tuple[str, ...], float]:
    return {tuple(s.labels.values()): s.value for f in ControllerCollector(m).collect() if f.name == name
            for s in f.samples}


def test_crash_loops_are_the_last_cycles_and_a_standby_says_nothing() -> None:
    m = ControllerMetrics()
    m.cycle("local", Report(leader=True, backing_off=2), 0.01)
    m.cycle("eu", Report(leader=True, backing_off=0), 0.01)
    assert gauge(m, "tensora_controller_crash_loops") == {("local",): 2, ("eu",): 0}
    m.cycle("local", Report(leader=True, backing_off=1), 0.01)
    assert gauge(m, "tensora_controller_crash_loops")[("local",)] == 1
    m.cycle("local", Report(leader=False), 0.01)  # lost the lease: no stale figure
    assert gauge(m, "tensora_controller_crash_loops") == {("eu",): 0}


def test_a_cycle_that_re_decided_nothing_keeps_the_queue_depth_of_the_last_that_did() -> None:
    m = ControllerMetrics()
    waits = [Wait(Queued(f"w{i}/0", WorkloadKind.NOTEBOOK, "l40s-48gb"), (), None, 0.0) for i in range(3)]
    m.cycle("local", Report(leader=True, decisions=waits), 0.01)
    want = {("local", "l40s-48gb", "notebook"): 3}
    assert gauge(m, "tensora_controller_queue_depth") == want
    m.cycle("local", Report(leader=True, decided=False), 0.01)  # an idle cycle: the waits stand
    assert gauge(m, "tensora_controller_queue_depth") == want
    m.cycle("local", Report(leader=True), 0.01)  # re-decided, and nothing waits any more
    assert gauge(m, "tensora_controller_queue_depth") == {}


def test_the_queue_depth_is_every_standing_wait_not_only_those_decided_again() -> None:
    m = ControllerMetrics()
    one = [Wait(Queued("w0/0", WorkloadKind.NOTEBOOK, "h100-80gb"), (), None, 0.0)]  # decided again this cycle
    m.cycle("local", Report(leader=True, decisions=one, queue={("h100-80gb", "notebook"): 2}), 0.01)
    assert gauge(m, "tensora_controller_queue_depth") == {("local", "h100-80gb", "notebook"): 2}
    m.cycle("local", Report(leader=True, decided=False, queue={("h100-80gb", "notebook"): 1}), 0.01)
    assert gauge(m, "tensora_controller_queue_depth") == {("local", "h100-80gb", "notebook"): 1}
