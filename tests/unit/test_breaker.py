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


# (what happens, at, then: state, open_until, probes_ok); every case starts ejected at 0 (open until 30)
PROBES = [
    ("one good probe: still open", [("good", 2)], (State.OPEN, 30.0, 1)),
    ("two good probes in a row: closed, at once", [("good", 2), ("good", 4)], (State.CLOSED, None, 0)),
    ("a failed probe between resets the count", [("good", 2), ("bad", 4), ("good", 6)], (State.OPEN, 30.0, 1)),
    ("failed probes never lengthen the ejection", [("bad", t) for t in range(2, 30, 2)], (State.OPEN, 30.0, 0)),
    ("half-open, good probes close it too", [("good", 31), ("good", 33)], (State.CLOSED, None, 0)),
    ("a new ejection starts the count again", [("good", 2), ("live_probe_fails", 31), ("good", 33)],
     (State.OPEN, 91.0, 1)),
]


@pytest.mark.parametrize(("name", "steps", "then"), PROBES, ids=[c[0] for c in PROBES])
def test_active_probes(name: str, steps: list[tuple[str, float]], then: tuple[State, float | None, int]) -> None:
    b = failed(Breaker(P), 5, at=0.0)
    now = 0.0
    for what, now in steps:
        if what == "live_probe_fails":
            assert b.allow(now)
            b.failure(now)
        else:
            b.probed(now, what == "good")
    assert (b.state(now), b.open_until, b.probes_ok) == then, name


def test_a_probe_of_a_closed_breaker_changes_nothing() -> None:
    b = failed(Breaker(P), 3)
    b.probed(1.0, True)
    b.probed(1.0, False)
    assert (b.state(1.0), b.failures, b.probes_ok) == (State.CLOSED, 3, 0)


def test_ejections_stop_growing_at_the_cap_and_decay_on_recovery() -> None:
    b = failed(Breaker(P), 5)
    for _ in range(50):  # a live probe fails at each cooldown's end, fifty times
        assert b.open_until is not None and b.allow(b.open_until)
        b.failure(b.open_until)
    assert b.ejections == 11 and b.open_until is not None  # 300 s / 30 s + 1: the count is bounded too
    now = b.open_until - 299
    b.probed(now, True)
    b.probed(now, True)
    assert b.state(now) is State.CLOSED and b.ejections == 10


def test_rate_limited_it_is_skipped_until_then_without_counting_as_broken() -> None:
    b = failed(Breaker(P), 2)
    b.rate_limited(12.0)
    b.rate_limited(10.0)  # an earlier time does not shorten it
    assert not b.allow(11.9) and b.limited_until(11.9) == 12.0 and b.retry_at(11.9) is None
    assert b.allow(12.0) and b.limited_until(12.0) is None and b.failures == 2 and b.state(12) is State.CLOSED


def test_a_rate_limited_half_open_probe_lets_the_next_probe_go_when_the_limit_ends() -> None:
    b = failed(Breaker(P), 5)
    assert b.allow(30.0)
    b.rate_limited(32.0)
    assert not b.allow(31.0) and b.allow(32.0)


@given(st.lists(st.tuples(st.sampled_from(["ok", "fail", "ask", "good", "bad", "busy"]), st.floats(0, 50)),
                max_size=60))
def test_it_never_lets_a_request_through_while_open(steps: list[tuple[str, float]]) -> None:
    b, now = Breaker(P), 0.0
    for what, dt in steps:
        now += dt
        before, until = b.state(now), b.open_until
        if what == "ok":
            b.success(now)
        elif what == "fail":
            b.failure(now)
        elif what in ("good", "bad"):
            b.probed(now, what == "good")
            assert b.open_until is None or b.open_until == until  # a probe never lengthens an ejection
        elif what == "busy":
            b.rate_limited(now + dt)
        else:
            limited = b.limited_until(now) is not None
            allowed = b.allow(now)
            assert not (allowed and (before is State.OPEN or limited))
        assert b.open_until is None or b.open_until - now <= P.max_s
        assert 0 <= b.failures < P.consecutive and 0 <= b.probes_ok < P.probe_successes
        assert 0 <= b.ejections <= P.max_s // P.base_s + 1


_AT = st.one_of(st.none(), st.sampled_from([0.0, 9.0, 10.0, 11.0, 40.0]))


@given(open_until=_AT, busy_until=_AT, now=st.sampled_from([0.0, 10.0, 10.5, 50.0]))
def test_skipped_is_open_or_limited(open_until: float | None, busy_until: float | None, now: float) -> None:
    """The walk's one-read check says what retry_at and limited_until say together, at any moment."""
    b = Breaker(P, open_until=open_until, busy_until=busy_until)
    assert b.skipped(now) == (b.retry_at(now) is not None or b.limited_until(now) is not None)
