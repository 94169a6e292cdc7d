"""The reference generator's pure parts: Markdown escaping of help strings, and settings' types and defaults as a
config file's reader needs them."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import pytest
from pydantic import BaseModel, Field

from tensora.docsgen import markdown as md
from tensora.docsgen import settings

TEXT = {
    "angle brackets are not HTML": ("shared/<root>/<path>", "shared/&lt;root&gt;/&lt;path&gt;"),
    "a pipe does not split a cell": ("simulated | local", "simulated \\| local"),
    "brackets are not a link": ("[default: table]", "\\[default: table\\]"),
    "underscores and stars stay": ("max_in_flight *", "max\\_in\\_flight \\*"),
    "backticks stay": ("`x`", "\\`x\\`"),
}


@pytest.mark.parametrize("case", TEXT.values(), ids=TEXT.keys())
def test_text(case: tuple[str, str]) -> None:
    given, want = case
    assert md.text(given) == want


def test_code_in_a_cell_escapes_its_pipes() -> None:
    assert md.code("a | b") == "`a \\| b`"
    assert md.code("a`b") == "`` a`b ``"


class Inner(BaseModel):
    x: int = 1


class Sample(BaseModel):
    port: int = Field(default=8700, ge=0, le=65535)
    path: Path | None = None
    mode: Literal["a", "b"] = "a"
    flag: bool = False
    roots: dict[str, Path] = Field(default_factory=dict)
    inner: Inner = Field(default_factory=Inner)
    items: list[Inner] = Field(default_factory=list)
    must: str


ROWS = {
    "bounds": ("port", "int (&gt;= 0, &lt;= 65535)", "`8700`"),
    "optional path": ("path", "path or null", "`null`"),
    "literal": ("mode", "one of a, b", "`a`"),
    "bool as YAML": ("flag", "bool", "`false`"),
    "mapping": ("roots", "mapping of str to path", "`{}`"),
    "nested model": ("inner", "mapping", "(below)"),
    "nested key": ("inner.x", "int", "`1`"),
    "list of models": ("items", "list of mapping", "`[]`"),
    "list items' keys": ("items[].x", "int", "`1`"),
    "required": ("must", "str", "(required)"),
}


@pytest.mark.parametrize("case", ROWS.values(), ids=ROWS.keys())
def test_settings_rows(case: tuple[str, str, str]) -> None:
    key, kind, default = case
    rows: dict[str, Any] = {r[0]: r for r in settings.rows(Sample)}
    assert rows[f"`{key}`"][1:3] == [kind, default]
