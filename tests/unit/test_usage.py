"""Usage sums: table cases and the invariant that splitting by day never changes the total."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tensora.control.usage import DAY, summarize
from tensora.store.rows import SegmentRow

D0 = 1_800_000_000.0 - (1_800_000_000.0 % DAY)  # a UTC midnight


def seg(cls: str, start: float, end: float | None, owner: str = "alice", kind: str = "endpoint") -> SegmentRow:
    return SegmentRow(id=0, workload_id="wl", replica_id="rp", owner=owner, region="local", kind=kind, placed_class=cls,
                      started_at=D0 + start, ended_at=None if end is None else D0 + end)


CASES = {
    "one closed segment": ([seg("l40s-48gb", 0, 3600)], ["placed_class"], 0, 7200,
                           [{"placed_class": "l40s-48gb", "seconds": 3600.0}]),
    "open segment counts up to until": ([seg("cpu-16c-64g", 0, None)], ["placed_class"], 0, 1800,
                                        [{"placed_class": "cpu-16c-64g", "seconds": 1800.0}]),
    "a move splits time by class": ([seg("cpu-16c-64g", 0, 660), seg("l40s-48gb", 630, None)], ["placed_class"],
                                    0, 1000, [{"placed_class": "cpu-16c-64g", "seconds": 660.0},
                                              {"placed_class": "l40s-48gb", "seconds": 370.0}]),
    "clipped to the window": ([seg("a100-80gb", -100, 100)], ["placed_class"], 0, 50,
                              [{"placed_class": "a100-80gb", "seconds": 50.0}]),
    "outside the window -> nothing": ([seg("a100-80gb", 0, 10)], ["placed_class"], 20, 30, []),
    "by owner": ([seg("x", 0, 10, "a"), seg("x", 0, 20, "b"), seg("y", 0, 5, "a")], ["owner"], 0, 100,
                 [{"owner": "a", "seconds": 15.0}, {"owner": "b", "seconds": 20.0}]),
    "by day splits at midnight": ([seg("x", DAY - 60, DAY + 30)], ["day"], 0, 3 * DAY,
                                  [{"day": "2027-01-15", "seconds": 60.0}, {"day": "2027-01-16", "seconds": 30.0}]),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_summarize(case: tuple[Any, ...]) -> None:
    segments, group_by, since, until, want = case
    got = summarize(segments, group_by, D0 + since, D0 + until)
    assert [{k: v for k, v in r.items() if k != "hours"} for r in got] == want
    assert all(r["hours"] == pytest.approx(r["seconds"] / 3600, abs=1e-6) for r in got)


spans = st.tuples(st.floats(0, 5 * DAY), st.floats(0, 2 * DAY), st.booleans(), st.sampled_from(["x", "y", "z"]))


@given(st.lists(spans, max_size=20), st.floats(0, 3 * DAY), st.floats(0, 4 * DAY))
def test_grouping_never_changes_the_total(items: list[tuple[float, float, bool, str]], since: float,
                                          length: float) -> None:
    segments = [seg(c, s, s + d if closed else None) for s, d, closed, c in items]
    lo, hi = D0 + since, D0 + since + length
    totals = [sum(r["seconds"] for r in summarize(segments, g, lo, hi))
              for g in (["placed_class"], ["day"], ["placed_class", "owner", "day"])]
    assert totals[1] == pytest.approx(totals[0], abs=1e-2)
    assert totals[2] == pytest.approx(totals[0], abs=1e-2)
    # each row is rounded to the millisecond, so allow half of one per row
    rows = len(summarize(segments, ["placed_class"], lo, hi))
    assert totals[0] <= len(segments) * length + 0.0005 * rows + 1e-9
