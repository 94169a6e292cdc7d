"""The crash-loop back-off: its schedule and reset (pure), admission leaving a backing-off workload alone,
and the sentences it is told in."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tensora.control import backoff
from tensora.control.events import BackingOff, FailedForGood, render
from tensora.placement.admission import Place, Wait, decide
from tensora.placement.capacity import Capacity, Node
from tests.support.builders import CATALOG, cap, cpu_node, ep, gpu_node, outcomes
from tests.support.stack import T0
from tests.support.strategies import nodes_st, queue_st


@pytest.mark.parametrize(("failures", "wait"), [
    pytest.param(1, 10, id="first failure: 10 s"),
    pytest.param(2, 20, id="second: doubled"),
    pytest.param(3, 40, id="third"),
    pytest.param(5, 160, id="fifth"),
    pytest.param(6, 300, id="sixth: capped at 5 min"),
    pytest.param(40, 300, id="a long loop: still 5 min"),
    pytest.param(10_000, 300, id="a huge count does not overflow"),
])
def test_schedule(failures: int, wait: float) -> None:
    assert backoff.delay(failures) == wait
    assert backoff.next_try(failures, T0) == T0 + wait


@pytest.mark.parametrize(("retry_at", "created_at", "running_since", "now", "healed"), [
    pytest.param(100.0, 100.0, 110.0, 710.0, True, id="placed at the next try, ran 10 min"),
    pytest.param(100.0, 100.0, 110.0, 709.0, False, id="ran a second short of 10 min"),
    pytest.param(100.0, 50.0, 50.0, 5000.0, False, id="a replica from before the failures: another slot's loop"),
    pytest.param(None, 100.0, 110.0, 5000.0, False, id="no back-off: nothing to end"),
])
def test_reset(retry_at: float | None, created_at: float, running_since: float, now: float, healed: bool) -> None:
    assert backoff.healed(retry_at, created_at, running_since, now) is healed


@pytest.mark.parametrize(("happened", "sentence"), [
    pytest.param(BackingOff(1, "exit code 1", T0 + 10), "failed 1 time: exit code 1; next try at 08:00:10", id="one"),
    pytest.param(BackingOff(4, "CUDA error", T0 + 80), "failed 4 times: CUDA error; next try at 08:01:20", id="four"),
    pytest.param(FailedForGood("gpu-9 is no longer in the catalog"),
                 "failed: gpu-9 is no longer in the catalog (retrying cannot fix this)", id="for good"),
])
def test_sentences(happened: BackingOff | FailedForGood, sentence: str) -> None:
    assert render(happened) == sentence


def test_admission_skips_a_workload_backing_off_and_places_it_when_due() -> None:
    nodes = [gpu_node("g1"), cpu_node("c1")]
    backing = replace(ep("crashy/0", since=0), not_before=100.0)
    other = ep("other/0", since=50)  # queued later: placed first while the older one backs off
    got, _ = outcomes(decide([backing, other], cap(nodes), [], 99.0))
    assert got == {"other/0": "l40s-48gb"}  # no decision at all for the one backing off: its reason stays
    got, _ = outcomes(decide([backing, other], cap(nodes), [], 100.0))
    assert got["crashy/0"] == "l40s-48gb" and got["other/0"] != "l40s-48gb"


@settings(max_examples=100, deadline=None)
@given(nodes=nodes_st, queue=queue_st(), now=st.integers(0, 2000), backing=st.sets(st.integers(0, 25)),
       until=st.integers(0, 4000))
def test_backing_off_is_the_same_as_absent(nodes: list[Node], queue: list, now: int, backing: set[int],
                                           until: int) -> None:
    """Admission with workloads backing off decides exactly as without them: nothing else changes."""
    marked = [replace(q, not_before=float(until)) if i in backing else q for i, q in enumerate(queue)]
    absent = [q for q, m in zip(queue, marked, strict=True) if m.not_before <= now]
    with_them = decide(marked, Capacity(nodes, [], CATALOG), [], now)
    without = decide(absent, Capacity(nodes, [], CATALOG), [], now)
    assert _ids(with_them) == _ids(without)
    assert [_strip(d) for d in with_them] == [_strip(d) for d in without]


def _ids(decisions: list) -> list[str]:
    return [d.workload.id for d in decisions]


def _strip(d: object) -> object:
    """A decision, its workload's ``not_before`` put back to 0 (the two runs differ only in it)."""
    if isinstance(d, Place | Wait):
        return replace(d, workload=replace(d.workload, not_before=0.0))
    return d
