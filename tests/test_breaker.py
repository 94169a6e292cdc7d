"""The gateway's circuit breaker: named cases, and invariants under any sequence of outcomes."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tensora.gateway.breaker import Breaker, Policy, State

P = Policy(consecutive=5, base_s=30.0, max_s=300.0)


def failed(b: Breaker, n: int, at: float = 0.0) -> Breaker:
    for _ in range(n):
        b.failure(at)
    return b


@pytest.mark.parametrize(("name", "failures", "state"), [
    ("four failures keep it closed", 4, State.CLOSED),
    ("the fifth in a row opens it", 5, State.OPEN),
])
def test_consecutive_failures(name: str, failures: int, state: State) -> None:
    assert failed(Breaker(P), failures).state(1.0) is state, name


def test_a_success_in_between_resets_the_count() -> None:
    b = failed(Breaker(P), 4)
    b.success(0)
    failed(b, 4)
    assert b.state(0) is State.CLOSED


def test_open_then_half_open_lets_one_probe_through_and_closes_on_success() -> None:
    b = failed(Breaker(P), 5, at=100.0)
    assert not b.allow(129.9) and b.retry_at(129.9) == 130.0
    assert b.state(130.0) is State.HALF_OPEN
    assert b.allow(130.0)  # the probe
    assert not b.allow(130.1)  # one at a time
    b.success(130.5)
    assert b.state(131) is State.CLOSED and b.allow(131) and b.allow(131)


@pytest.mark.parametrize(("name", "ejections", "cooldown"), [
    ("first ejection: base", 1, 30.0),
    ("second: twice the base", 2, 60.0),
    ("third: three times", 3, 90.0),
    ("tenth: capped at max", 10, 300.0),
])
def test_a_failed_probe_opens_it_again_for_longer(name: str, ejections: int, cooldown: float) -> None:
    b = failed(Breaker(P), 5, at=0.0)
    t = 0.0
    for _ in range(ejections - 1):
        t = b.open_until or t
        assert b.allow(t)
        b.failure(t)  # the probe failed
    assert b.ejections == ejections, name
    assert b.open_until is not None and b.open_until - t == cooldown, name


def test_a_busy_probe_released_lets_the_next_probe_go() -> None:
    b = failed(Breaker(P), 5)
    assert b.allow(30.0) and not b.allow(30.0)
    b.release()
    assert b.allow(30.0)


@given(st.lists(st.tuples(st.sampled_from(["ok", "fail", "ask"]), st.floats(0, 50)), max_size=60))
def test_it_never_lets_a_request_through_while_open(steps: list[tuple[str, float]]) -> None:
    b, now = Breaker(P), 0.0
    for what, dt in steps:
        now += dt
        before = b.state(now)
        if what == "ok":
            b.success(now)
        elif what == "fail":
            b.failure(now)
        else:
            allowed = b.allow(now)
            assert not (allowed and before is State.OPEN)
        assert b.open_until is None or b.open_until - now <= P.max_s
        assert 0 <= b.failures < P.consecutive
