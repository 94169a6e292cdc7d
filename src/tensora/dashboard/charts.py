"""Usage as an SVG bar chart, rendered on the server: no JavaScript, no charting library, no CDN.

One bar a day, stacked by placed class; each segment has a ``<title>`` (hover text, read by screen
readers) and ``data-class``/``data-seconds`` attributes, and a table beside the chart carries the
same figures for anyone who cannot see it.
"""

from __future__ import annotations

from collections import defaultdict
from html import escape
from typing import Any

PALETTE = ("#4f7cff", "#f5a623", "#22b573", "#e5484d", "#8e6cef", "#14a3b8", "#c2410c", "#64748b")
W, H, PAD, LABEL = 640, 240, 28, 90


def duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.2f} h"


def colors(classes: list[str]) -> dict[str, str]:
    return {c: PALETTE[i % len(PALETTE)] for i, c in enumerate(classes)}


def usage_svg(rows: list[dict[str, Any]], title: str = "Accounted time by placed class, per day") -> str:
    """``rows``: usage rows grouped by placed_class and day (``seconds``)."""
    by_day: dict[str, dict[str, float]] = defaultdict(dict)
    for r in rows:
        by_day[str(r.get("day"))][str(r.get("placed_class"))] = float(r["seconds"])
    days = sorted(by_day)
    classes = sorted({c for d in by_day.values() for c in d})
    color = colors(classes)
    totals = [sum(d.values()) for d in by_day.values()]
    top = max(totals, default=0.0) or 1.0
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {W} {H + 40}" role="img" '
             f'aria-label="{escape(title)}" class="chart" data-total="{sum(totals):.3f}">',
             f"<title>{escape(title)}</title>",
             f'<line x1="{LABEL}" y1="{H}" x2="{W - PAD}" y2="{H}" class="axis"/>',
             f'<text x="{LABEL - 6}" y="{PAD}" text-anchor="end" class="tick">{escape(duration(top))}</text>',
             f'<text x="{LABEL - 6}" y="{H}" text-anchor="end" class="tick">0</text>']
    if not days:
        parts.append(f'<text x="{W / 2}" y="{H / 2}" text-anchor="middle" class="tick">no usage yet</text>')
    slot = (W - PAD - LABEL) / max(len(days), 1)
    bar = min(slot * 0.6, 80)
    for i, day in enumerate(days):
        x = LABEL + i * slot + (slot - bar) / 2
        y = float(H)
        for cls in classes:
            seconds = by_day[day].get(cls, 0.0)
            if seconds <= 0:
                continue
            h = (H - PAD) * seconds / top
            y -= h
            parts.append(f'<rect x="{x:.1f}" y="{y:.1f}" width="{bar:.1f}" height="{max(h, 1):.1f}" '
                         f'fill="{color[cls]}" data-class="{escape(cls)}" data-day="{escape(day)}" '
                         f'data-seconds="{seconds:.3f}"><title>{escape(cls)} on {escape(day)}: '
                         f"{escape(duration(seconds))}</title></rect>")
        parts.append(f'<text x="{x + bar / 2:.1f}" y="{H + 16}" text-anchor="middle" class="tick">{escape(day)}</text>')
    lx = LABEL
    for cls in classes:
        parts.append(f'<rect x="{lx}" y="{H + 26}" width="10" height="10" fill="{color[cls]}"/>'
                     f'<text x="{lx + 14}" y="{H + 35}" class="tick">{escape(cls)}</text>')
        lx += 14 + 8 * len(cls) + 16
    parts.append("</svg>")
    return "".join(parts)


def bars_svg(values: dict[str, float], title: str, empty: str = "none") -> str:
    """One horizontal bar per label (the operator page's counts: fallbacks by requested -> placed, failovers by
    trigger), each with its ``<title>`` and ``data-label``/``data-value``; a table beside it carries the same."""
    rows = sorted(values.items(), key=lambda kv: (-kv[1], kv[0]))
    top = max((v for _, v in rows), default=0.0) or 1.0
    h = max(len(rows), 1) * 24 + 8
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {W} {h}" role="img" aria-label="{escape(title)}"'
             f' class="chart" data-total="{sum(values.values()):g}"><title>{escape(title)}</title>']
    if not rows:
        parts.append(f'<text x="{LABEL}" y="20" class="tick">{escape(empty)}</text>')
    width = W - PAD - 2 * LABEL
    for i, (label, v) in enumerate(rows):
        y = 4 + i * 24
        color = PALETTE[i % len(PALETTE)]
        parts.append(f'<text x="{2 * LABEL - 6}" y="{y + 15}" text-anchor="end" class="tick">{escape(label)}</text>'
                     f'<rect x="{2 * LABEL}" y="{y}" width="{max(width * v / top, 1):.1f}" height="18" fill="{color}" '
                     f'data-label="{escape(label)}" data-value="{v:g}"><title>{escape(label)}: {v:g}</title></rect>'
                     f'<text x="{2 * LABEL + width * v / top + 4:.1f}" y="{y + 15}" class="tick">{v:g}</text>')
    parts.append("</svg>")
    return "".join(parts)
