"""What keeps a full cycle cheap, as behaviour: the collector is paused for it and restored as it was,
and the waits behind a full class share their attempts (one object each, recounted once)."""

from __future__ import annotations

import gc
from collections.abc import Callable
from dataclasses import dataclass

import pytest

from tensora.placement.admission import Decision, Wait, collector_paused, decide
from tensora.placement.admission_state import AdmissionState, Submitted, step
from tests.support.builders import CATALOG, cap, gpu_node, w


def _decide() -> list[Decision]:
    return decide([w("a"), w("b")], cap([gpu_node("g1")]), now=0.0)


def _step() -> list[Decision]:
    return step(AdmissionState([gpu_node("g1")], [], CATALOG), [Submitted(w("a")), Submitted(w("b"))], 0.0)[1]


def _fails() -> None:
    with collector_paused():
        raise RuntimeError("a cycle that fails")


@dataclass
class Case:
    run: Callable[[], object]
    enabled: bool  # the collector before the call
    raises: bool = False


CASES = {
    "decide, collector on -> on again after": Case(_decide, True),
    "decide, collector off -> left off": Case(_decide, False),
    "step, collector on -> on again after": Case(_step, True),
    "step, collector off -> left off": Case(_step, False),
    "a cycle that raises -> on again after": Case(_fails, True, raises=True),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_the_collector_is_as_it_was_after_a_cycle(case: Case) -> None:
    was = gc.isenabled()
    try:
        (gc.enable if case.enabled else gc.disable)()
        if case.raises:
            with pytest.raises(RuntimeError):
                case.run()
        else:
            case.run()
        assert gc.isenabled() is case.enabled
    finally:
        (gc.enable if was else gc.disable)()


def test_the_waits_behind_a_full_class_share_their_attempts() -> None:
    queue = [w(f"w{i}", fallback=("a100-80gb",), after=600) for i in range(50)]
    decisions = decide(queue, cap([gpu_node("g1")]), now=0.0)
    waits = [d for d in decisions if type(d) is Wait]
    assert len(waits) == 49  # the first is placed on the one L40S
    assert len({id(d.attempts) for d in waits}) == 1
    assert waits[0].reason == ("waiting for l40s-48gb (0 GPU free, 1 needed); fallback to a100-80gb from 00:10:00")
