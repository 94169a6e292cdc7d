"""The controller's metric state (control.metrics) from its cycle reports, read as a scrape reads it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tensora.control.metrics import ControllerCollector, ControllerMetrics


@dataclass
class Report:
    leader: bool
    decisions: list[Any] = field(default_factory=list)
    backing_off: int = 0


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
