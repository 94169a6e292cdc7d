"""Validation errors in words: each kind of problem said as a person would, and every pattern a field of the API
or of a file uses has its words (none is ever shown as a regular expression)."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import BaseModel, Field, ValidationError

from tensora.config.wording import in_words, pattern_words, seconds_words
from tensora.control.spec import parse_spec
from tensora.errors import SpecError


def _first(model: type[BaseModel], data: dict[str, Any]) -> dict[str, Any]:
    with pytest.raises(ValidationError) as got:
        model.model_validate(data)
    return dict(got.value.errors()[0])


class _Sample(BaseModel):
    wait_s: float = Field(default=0, ge=0, le=30 * 86400)
    count: int = Field(default=1, ge=1, le=100_000)
    label: str = Field(default="a", min_length=1, max_length=8, pattern=r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")
    tags: list[str] = Field(default_factory=list, max_length=2)
    on: bool = False


CASES = {  # (field, value) -> the words
    "a wait over its bound": (("wait_s", 31 * 86400), "at most 30 days"),
    "a wait under its bound": (("wait_s", -1), "at least 0 seconds"),
    "a count over a large bound": (("count", 10**6), "at most 100000"),
    "a count under its bound": (("count", 0), "at least 1"),
    "a name of the wrong form": (("label", "Bad_Name"), "lowercase letters, digits and '-', 1-63 characters, "
                                                        "starting and ending with a letter or digit"),
    "an empty name": (("label", ""), "must not be empty"),
    "a name too long": (("label", "a" * 9), "at most 8 characters"),
    "too many tags": (("tags", ["a", "b", "c"]), "at most 2 items"),
    "text for a count": (("count", "many"), "must be a whole number"),
    "text for a flag": (("on", "perhaps"), "must be true or false"),
    "a number for a list": (("tags", 3), "must be a list"),
    "a field nobody has": (("colour", "red"), "unknown field"),
}


@pytest.mark.parametrize(("given", "want"), CASES.values(), ids=CASES.keys())
def test_in_words(given: tuple[str, Any], want: str) -> None:
    class Strict(_Sample, extra="forbid"):
        pass

    assert in_words(_first(Strict, {given[0]: given[1]})) == want


PATTERNS = {
    "one of an enum's values": (r"^(queued|running|stopped)$", "one of queued, running, stopped"),
    "a comma-separated list": (r"^(placed_class|owner|day)(,(placed_class|owner|day))*$",
                               "one or more of placed_class, owner, day, separated by commas"),
    "an owner": (r"^[A-Za-z0-9._@-]+$", "letters, digits and '.', '_', '@' or '-'"),
    "a size in some units": (r"^[1-9][0-9]*(Mi|Gi|Ti)$", "a whole size in Mi, Gi or Ti, such as 10Ti"),
    "one nobody wrote words for": (r"^x+y$", "not in the expected form"),
}


@pytest.mark.parametrize(("pattern", "want"), PATTERNS.values(), ids=PATTERNS.keys())
def test_pattern_words(pattern: str, want: str) -> None:
    assert pattern_words(pattern) == want


SECONDS = {"thirty days": (30 * 86400, "30 days"), "one hour": (3600, "1 hour"), "ninety minutes": (5400, "90 minutes"),
           "a second and a half": (1.5, "1.5 seconds"), "none": (0, "0 seconds")}


@pytest.mark.parametrize(("seconds", "want"), SECONDS.values(), ids=SECONDS.keys())
def test_seconds_words(seconds: float, want: str) -> None:
    assert seconds_words(seconds) == want


def _patterns(doc: Any) -> list[str]:
    if isinstance(doc, dict):
        return [*([doc["pattern"]] if isinstance(doc.get("pattern"), str) else []),
                *(p for v in doc.values() for p in _patterns(v))]
    if isinstance(doc, list):
        return [p for v in doc for p in _patterns(v)]
    return []


def test_every_pattern_of_the_api_and_the_settings_has_words() -> None:
    from tensora.config.settings import ServeSettings
    from tensora.docsgen.httpapi import document

    found = sorted(set(_patterns(document())) | set(_patterns(ServeSettings.model_json_schema())))
    assert found, "the API's document names no pattern: the check would check nothing"
    assert [p for p in found if pattern_words(p) == "not in the expected form"] == []


def test_a_create_body_says_its_problem_in_words() -> None:
    with pytest.raises(SpecError) as got:
        parse_spec({"kind": "notebook", "name": "nb", "gpu_class": "l40s-48gb", "fallback_after": "31d"})
    assert (got.value.field, got.value.message) == ("fallback_after_s", "at most 30 days")
