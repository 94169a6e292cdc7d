"""Parsing and rendering of the sizes and durations people write in YAML and on the CLI.

Durations: ``0``, ``90``, ``"90s"``, ``"10m"``, ``"1h30m"``, ``"2d"``.
Memory: ``"64Gi"``, ``"512Mi"``, ``"80GB"``, or a plain number of bytes.
Parameter counts: ``7000000000``, ``"7B"``, ``"350M"``, ``"8.5e9"``.

At the top of the package: pure code (placement) and every edge (config, CLI, drivers, API) read and write these.
"""

from __future__ import annotations

import functools
import math
import re
from datetime import UTC, datetime

GIB = 2**30
"""One GiB in bytes: memory is bytes everywhere, and GiB is how people read it."""

_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h|d)")
_DURATION_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}

_MEMORY = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGTP]i?|[KMGTP]B|B)?\s*$", re.IGNORECASE)
_BINARY = {"": 1, "b": 1, "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40, "pi": 2**50}
_DECIMAL = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12, "p": 10**15}

_PARAMS = re.compile(r"^\s*(\d+(?:\.\d+)?(?:e\d+)?)\s*([KMBT])?\s*$", re.IGNORECASE)
_PARAM_UNITS = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "t": 10**12}


def parse_duration(value: object) -> float:
    """Seconds from ``0``, ``90``, ``"90s"``, ``"10m"``, ``"1h30m"``; ValueError if malformed."""
    if isinstance(value, bool):
        raise ValueError(f"expected a duration such as 90s or 10m, got {value!r}")
    if isinstance(value, int | float):
        if value < 0 or not math.isfinite(value):
            raise ValueError(f"a duration must be finite and >= 0, got {value!r}")
        return float(value)
    if not isinstance(value, str):
        raise ValueError(f"expected a duration such as 90s or 10m, got {value!r}")
    return _parse_duration_text(value)


@functools.lru_cache(maxsize=1024)
def _parse_duration_text(value: str) -> float:
    """A duration's text, parsed once (a plan's files repeat a few texts tens of thousands of times); bounded, as
    texts come from users."""
    text = value.strip().lower().replace(" ", "")
    if re.fullmatch(r"\d+(\.\d+)?", text):
        return float(text)
    pos, total = 0, 0.0
    for match in _DURATION_PART.finditer(text):
        if match.start() != pos:
            break
        total += float(match.group(1)) * _DURATION_UNITS[match.group(2)]
        pos = match.end()
    if pos != len(text) or not text:
        raise ValueError(f"expected a duration such as 90s, 10m or 1h30m, got {value!r}")
    return total


def format_duration(seconds: float) -> str:
    """``600 -> "10m"``, ``90 -> "1m30s"``, ``3700 -> "1h1m40s"``, ``0 -> "0s"``."""
    whole = round(seconds)
    if whole <= 0:
        return "0s"
    out = []
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60), ("s", 1)):
        if whole >= size:
            count, whole = divmod(whole, size)
            out.append(f"{count}{unit}")
    return "".join(out)


def parse_memory(value: object) -> int:
    """Bytes from ``"64Gi"``, ``"80GB"``, ``"512Mi"`` or a number of bytes."""
    if isinstance(value, bool):
        raise ValueError(f"expected a size such as 64Gi, got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"a size must be >= 0, got {value!r}")
        return value
    if isinstance(value, float):
        if value < 0 or not math.isfinite(value):
            raise ValueError(f"a size must be finite and >= 0, got {value!r}")
        return int(value)
    if not isinstance(value, str):
        raise ValueError(f"expected a size such as 64Gi, got {value!r}")
    match = _MEMORY.match(value)
    if not match:
        raise ValueError(f"expected a size such as 64Gi or 512Mi, got {value!r}")
    number, unit = float(match.group(1)), (match.group(2) or "").lower()
    if unit.endswith("b") and len(unit) == 2:
        factor = _DECIMAL[unit[0]]
    elif unit in _BINARY:
        factor = _BINARY[unit]
    else:
        factor = _DECIMAL[unit]
    return int(number * factor)


def format_memory(size: int) -> str:
    """Bytes rendered in the largest binary unit that keeps a short number, one decimal unless exact: ``64Gi``,
    ``1.5Gi``, ``833.2Ki``. The one style of every size a person reads (CLI, API messages, reasons, dashboard), in
    the form size flags and settings accept, so that a value can be copied back."""
    for unit, factor in (("Ti", 2**40), ("Gi", 2**30), ("Mi", 2**20), ("Ki", 2**10)):
        if size >= factor:  # "1.0Mi" only for a size that is not exactly 1Mi: "1.0Mi is over the 1Mi cap"
            value = size / factor
            return f"{value:.0f}{unit}" if value == int(value) else f"{value:.1f}{unit}"
    return f"{size}B"


def parse_params(value: object) -> int:
    """A parameter count from ``7000000000``, ``"7B"``, ``"350M"`` or ``"8.5e9"``."""
    if isinstance(value, bool):
        raise ValueError(f"expected a parameter count such as 7B, got {value!r}")
    if isinstance(value, int | float):
        if value < 0 or not math.isfinite(value):
            raise ValueError(f"a parameter count must be >= 0, got {value!r}")
        return int(value)
    if not isinstance(value, str):
        raise ValueError(f"expected a parameter count such as 7B, got {value!r}")
    match = _PARAMS.match(value)
    if not match:
        raise ValueError(f"expected a parameter count such as 7B or 350M, got {value!r}")
    return int(float(match.group(1)) * _PARAM_UNITS[(match.group(2) or "").lower()])


def format_params(count: float) -> str:
    """``8_030_000_000 -> "8.0B"``."""
    for unit, factor in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if count >= factor:
            return f"{count / factor:.1f}{unit}"
    return str(int(count))


def format_clock(epoch_seconds: float) -> str:
    """A wall-clock time in UTC, as people read it in a reason: ``14:32:10``."""
    return datetime.fromtimestamp(epoch_seconds, tz=UTC).strftime("%H:%M:%S")
