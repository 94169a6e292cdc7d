"""A validation error in words: what pydantic found wrong with a value, said as a person would (``at most 30 days``,
``lowercase letters, digits and '-', ...``), never as a regular expression or pydantic's own phrasing. The API's
422s, ``tensora plan``'s file errors and the settings' errors all say it this way."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from tensora.names import DOMAIN_PATTERN, NAME_PATTERN

PATTERNS = {
    NAME_PATTERN: "lowercase letters, digits and '-', 1-63 characters, starting and ending with a letter or digit",
    DOMAIN_PATTERN: "a domain name such as notebooks.example.com: labels of lowercase letters, digits and '-'",
    r"^[A-Za-z0-9._@-]+$": "letters, digits and '.', '_', '@' or '-'",
    r"^[A-Za-z0-9._-]+$": "letters, digits and '.', '_' or '-'",
    r"^[^\x00-\x1f\x7f]+$": "text without control characters",
    r"^[\x21-\x7e]([\x20-\x7e]*[\x21-\x7e])?$": "printable ASCII, not starting or ending with a space",
    r"^[a-z0-9]([a-z0-9.-]{0,251}[a-z0-9])?$": "lowercase letters, digits, '.' and '-', 1-253 characters, starting "
                                               "and ending with a letter or digit",
    r"^[1-9][0-9]*-[1-9][0-9]*$": "two whole numbers as FIRST-LAST, such as 100000-165535",
}
"""The patterns of the API's and the files' fields, in words. One not here is said as "not in the expected form"
(a test checks that every pattern in use is here)."""

_ONE_OF = re.compile(r"^\^\(([\w-]+(?:\|[\w-]+)*)\)\$$")
_LIST_OF = re.compile(r"^\^\(([\w-]+(?:\|[\w-]+)*)\)\(,\(\1\)\)\*\$$")

_SIZE = re.compile(r"^\^\[1-9\]\[0-9\]\*\(((?:Ki|Mi|Gi|Ti)(?:\|(?:Ki|Mi|Gi|Ti))*)\)\$$")

_DURATION_UNITS = (("day", 86400), ("hour", 3600), ("minute", 60), ("second", 1))


def pattern_words(pattern: str) -> str:
    """What a value matching ``pattern`` looks like, in words."""
    if pattern in PATTERNS:
        return PATTERNS[pattern]
    if (size := _SIZE.match(pattern)) is not None:
        *first, last = size.group(1).split("|")
        units = f"{', '.join(first)} or {last}" if first else last
        return f"a whole size in {units}, such as 10{last}"
    if (listed := _LIST_OF.match(pattern)) is not None:
        return "one or more of " + ", ".join(listed.group(1).split("|")) + ", separated by commas"
    if (one := _ONE_OF.match(pattern)) is not None:
        return "one of " + ", ".join(one.group(1).split("|"))
    return "not in the expected form"


def seconds_words(seconds: float) -> str:
    """``2592000 -> "30 days"``, ``5400 -> "90 minutes"``, ``0.5 -> "0.5 seconds"``: the largest unit it is a whole
    number of."""
    for unit, size in _DURATION_UNITS:
        if seconds >= size and seconds % size == 0:
            count = int(seconds // size)
            return f"{count} {unit}{'' if count == 1 else 's'}"
    return f"{seconds:g} seconds"


def _number(value: Any, field: str) -> str:
    if field.endswith("_s") and isinstance(value, int | float) and not isinstance(value, bool):
        return seconds_words(value)
    return str(value)  # as it is typed back (a port, a count): no digit grouping


def in_words(error: Mapping[str, Any]) -> str:
    """One of ``ValidationError.errors()``, in words."""
    kind, ctx = str(error.get("type", "")), error.get("ctx") or {}
    loc = error.get("loc") or ()
    field = str(loc[-1]) if loc else ""
    if kind == "extra_forbidden":
        return "unknown field"
    if kind == "missing":
        return "field required"
    if kind == "string_pattern_mismatch":
        return pattern_words(str(ctx.get("pattern", "")))
    bounds = {"less_than_equal": ("at most", "le"), "less_than": ("less than", "lt"),
              "greater_than_equal": ("at least", "ge"), "greater_than": ("more than", "gt")}
    if kind in bounds:
        words, key = bounds[kind]
        return f"{words} {_number(ctx.get(key), field)}"
    if kind in ("string_too_short", "string_too_long", "too_short", "too_long"):
        limit = ctx.get("min_length" if kind.endswith("short") else "max_length")
        what = "character" if kind.startswith("string") else "item"
        if kind.endswith("short") and limit == 1:
            return "must not be empty"
        words = "at least" if kind.endswith("short") else "at most"
        return f"{words} {limit} {what}{'' if limit == 1 else 's'}"
    if kind in ("int_type", "int_parsing", "int_from_float"):
        return "must be a whole number"
    if kind in ("float_type", "float_parsing", "finite_number"):
        return "must be a number"
    if kind in ("bool_type", "bool_parsing"):
        return "must be true or false"
    if kind == "string_type":
        return "must be a string"
    if kind in ("list_type", "tuple_type"):
        return "must be a list"
    if kind in ("dict_type", "model_type", "model_attributes_type"):
        return "must be a mapping of names to values"
    return str(error.get("msg", "invalid")).removeprefix("Value error, ")
