"""Accounted usage: time segments per (workload, placed_class) summed over a window.

A segment is open while its replica holds capacity (from placement until it stops); a move
back closes the old class's segment and the new class has its own, so the split shows.
Pure: segments in, rows out. No prices anywhere: Tensora is free; usage is accounted.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable, Sequence
from typing import Required, TypedDict, cast

from tensora.store.rows import SegmentRow

DAY = 86400.0


class UsageTotal(TypedDict, total=False):
    """One group's time (``/v1/usage``'s row): the group's values (those of ``group_by`` only), then the sum."""

    placed_class: str
    owner: str
    kind: str
    day: str
    seconds: Required[float]
    hours: Required[float]


def _clip(start: float, end: float, lo: float, hi: float) -> tuple[float, float] | None:
    a, b = max(start, lo), min(end, hi)
    return (a, b) if b > a else None


def _days(a: float, b: float) -> Iterable[tuple[str, float]]:
    """(UTC day, seconds) pieces of [a, b)."""
    while a < b:
        day_end = (a // DAY + 1) * DAY
        piece = min(b, day_end)
        yield dt.datetime.fromtimestamp(a, dt.UTC).date().isoformat(), piece - a
        a = piece


def summarize(segments: Sequence[SegmentRow], group_by: Sequence[str], since: float,
              until: float) -> list[UsageTotal]:
    """Seconds per group within [since, until); open segments count up to ``until``. ``group_by`` names
    ``day`` or fields of a segment (``placed_class``, ``owner``, ``kind``)."""
    totals: dict[tuple[str | None, ...], float] = {}
    for s in segments:
        span = _clip(s.started_at, s.ended_at if s.ended_at is not None else until, since, until)
        if span is None:
            continue
        pieces = _days(*span) if "day" in group_by else [(None, span[1] - span[0])]
        for day, seconds in pieces:
            key = tuple(day if g == "day" else getattr(s, g) for g in group_by)
            totals[key] = totals.get(key, 0.0) + seconds
    rows = []
    for key in sorted(totals, key=lambda k: tuple(str(x) for x in k)):
        row = {**dict(zip(group_by, key, strict=True)), "seconds": round(totals[key], 3),
               "hours": round(totals[key] / 3600, 6)}
        rows.append(cast(UsageTotal, row))
    return rows
