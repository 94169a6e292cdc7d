"""The dashboard's server-side usage chart and its durations: pure functions, named cases."""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET

import pytest

from tensora.dashboard.charts import PAD, H, duration, usage_svg
from tensora.dashboard.pages import when

DURATIONS = {
    "seconds": (7.4, "7 s"),
    "just under 90 s": (89, "89 s"),
    "minutes": (600, "10.0 min"),
    "hours": (7200, "2.00 h"),
}


@pytest.mark.parametrize(("seconds", "want"), DURATIONS.values(), ids=DURATIONS.keys())
def test_duration(seconds: float, want: str) -> None:
    assert duration(seconds) == want


def test_when_renders_api_times_for_people() -> None:
    assert when("2027-01-15T08:10:00.123456Z") == "2027-01-15 08:10:00 UTC"
    assert when(None) == ""


def _rects(svg: str) -> list[ET.Element]:
    root = ET.fromstring(svg)
    return [r for r in root.iter("{http://www.w3.org/2000/svg}rect") if r.get("data-class") and r.get("data-day")]


def test_no_usage_says_so() -> None:
    svg = usage_svg([])
    assert "no usage yet" in svg and _rects(svg) == []
    assert ET.fromstring(svg).get("data-total") == "0.000"


def test_bars_stack_by_class_per_day_in_proportion() -> None:
    rows = [{"day": "2027-01-15", "placed_class": "cpu-16c-64g", "seconds": 3600.0},
            {"day": "2027-01-15", "placed_class": "l40s-48gb", "seconds": 1800.0},
            {"day": "2027-01-16", "placed_class": "l40s-48gb", "seconds": 900.0}]
    svg = usage_svg(rows)
    rects = _rects(svg)
    assert [(r.get("data-day"), r.get("data-class")) for r in rects] == [
        ("2027-01-15", "cpu-16c-64g"), ("2027-01-15", "l40s-48gb"), ("2027-01-16", "l40s-48gb")]
    heights = [float(r.get("height") or 0) for r in rects]
    assert heights[0] + heights[1] == pytest.approx(H - PAD, abs=0.2)  # the tallest day fills the chart
    assert heights[0] == pytest.approx(2 * heights[1], abs=0.2) and heights[1] == pytest.approx(2 * heights[2], abs=0.2)
    assert rects[1].get("fill") == rects[2].get("fill") != rects[0].get("fill")  # one color a class
    assert float(ET.fromstring(svg).get("data-total") or 0) == pytest.approx(6300)
    assert re.search(r"<title>cpu-16c-64g on 2027-01-15: 60.0 min</title>", svg)


def test_names_are_escaped() -> None:
    svg = usage_svg([{"day": "2027-01-15", "placed_class": "<script>", "seconds": 5.0}])
    assert "<script>" not in svg and "&lt;script&gt;" in svg
    ET.fromstring(svg)  # still well-formed
