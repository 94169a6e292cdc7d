"""The small pure parts admission is built of: what a fallback entry stands for, the timers of a kept state, the
running quotas admission reads (and the validated ones they come from)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest

from tensora.config.quotas import Quotas
from tensora.placement.catalog import entry_classes
from tensora.placement.quotas import RunningQuotas
from tensora.placement.timers import Timers, starving_from
from tests.support.builders import CATALOG

CPU_SMALLEST_FIRST = ["cpu-1c-4g", "cpu-2c-8g", "cpu-4c-16g", "cpu-8c-32g", "cpu-16c-64g", "cpu-32c-128g"]


@dataclass(frozen=True)
class EntryCase:
    entry: str
    want: list[str]


ENTRIES = {
    "the word cpu -> every CPU class, smallest first": EntryCase("cpu", CPU_SMALLEST_FIRST),
    "a GPU class -> that class": EntryCase("a100-80gb", ["a100-80gb"]),
    "a CPU class -> that class alone": EntryCase("cpu-4c-16g", ["cpu-4c-16g"]),
    "a name not in the catalog -> none": EntryCase("no-such-class", []),
}


@pytest.mark.parametrize("case", ENTRIES.values(), ids=ENTRIES.keys())
def test_what_a_fallback_entry_stands_for(case: EntryCase) -> None:
    assert [c.name for c in entry_classes(case.entry, CATALOG)] == case.want


@dataclass(frozen=True)
class TimerCase:
    set_: list[tuple[float, str]]
    now: float
    want: list[str]
    left: int


TIMERS = {
    "none due -> nothing, all kept": TimerCase([(10.0, "a"), (20.0, "b")], 5.0, [], 2),
    "due at now -> given": TimerCase([(10.0, "a"), (20.0, "b")], 10.0, ["a"], 1),
    "several due -> in time order": TimerCase([(30.0, "c"), (10.0, "a"), (20.0, "b")], 25.0, ["a", "b"], 1),
    "many due (one pass) -> each id once": TimerCase(
        [(float(t), f"w{t % 40}") for t in range(100)], 1000.0, [f"w{i}" for i in range(40)], 0),
}


@pytest.mark.parametrize("case", TIMERS.values(), ids=TIMERS.keys())
def test_timers_give_what_came_due(case: TimerCase) -> None:
    timers = Timers()
    timers.later += case.set_
    assert timers.due(case.now) == case.want
    assert len(timers.heap) == case.left and timers.later == []


@pytest.mark.parametrize(("since", "after"), [(0.0, 300.0), (0.1, 0.2), (1e9 + 0.3, 600.0), (5.0, 0.0)])
def test_starving_from_is_the_first_moment_decide_calls_it_starving(since: float, after: float) -> None:
    t = starving_from(since, after)
    assert t - since >= after
    assert math.nextafter(t, -math.inf) - since < after


def test_the_validated_quotas_give_admission_their_running_part_and_share_its_defaults() -> None:
    assert Quotas().running() == RunningQuotas()
    assert Quotas(running_gpus=3, running_cpu=8.5, keys=1).running() == RunningQuotas(3, 8.5)
