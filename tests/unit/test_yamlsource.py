"""YAML with line numbers: the fast read (libyaml, lines found only when asked) gives what the node-by-node read
gives, data, lines and errors alike, on documents of every shape it could read differently."""

from __future__ import annotations

from typing import Any

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from tensora.config import yamlsource
from tensora.errors import ConfigError

DOCS = {
    "flow and block mappings": "a: {b: 1, c: [x, 'y', \"z\"]}\nd:\n  - e: 2.5\n    f: null\n  - true\n",
    "scalars the resolver types": "a: [0, -3, 1.5, 1e5, 1.0e+5, 0x1f, 010, yes, No, ~, '', 2024-01-02, '7', 12:30]\n",
    "a key that is a number": "workloads:\n  - 1: a\n",
    "a key that is null": "null: 1\n",
    "a merge key": "base: &b {x: 1}\nitem:\n  <<: *b\n  y: 2\n",
    "an anchor and its alias": "a: &x [1, 2]\nb: *x\n",
    "an alias of a mapping, and of a scalar as a key": "a: &m {b: &k c}\nd: [*m, *m]\n*k : 1\n",
    "a tagged set": "a: !!set {x, y}\n",
    "an ordered map": "a: !!omap [x: 1, y: 2]\n",
    "an explicit string tag": "a: !!str 123\n",
    "empty": "",
    "a comment only": "# nothing\n",
    "a document marker only": "---\n",
    "quoted scalars that read as numbers": "a: ['1', \"2.5\", 'yes', 'null']\n'3': x\n",
    "a quoted merge key": "'<<': {x: 1}\n",
    "a non-specific tag": "a: ! 12\n",
    "lists of lists": "a:\n- [1, [2, [3, {b: c}]]]\n- []\n- {}\n",
}


@pytest.mark.parametrize("text", DOCS.values(), ids=DOCS.keys())
def test_the_fast_read_gives_what_the_node_by_node_read_gives(text: str) -> None:
    data, lines = yamlsource.load_text(text, "doc.yaml", ConfigError)
    want, want_lines = yamlsource._load_nodes(text, "doc.yaml", ConfigError)
    assert data == want
    for path, line in want_lines.items():
        assert lines.line(path) == line


ERRORS = {
    "a key twice": ("a: 1\nb: 2\na: 3\n", "doc.yaml:3: a: key 'a' appears twice"),
    "a key that is a list": ("? [a]\n: 1\n", "doc.yaml:1: keys must be plain names"),
    "not yaml": ("a: [\n", "doc.yaml:2: not valid YAML"),
    "two documents": ("a: 1\n---\nb: 2\n", "doc.yaml:2: not valid YAML"),
    "an unknown tag": ("a: !nope 1\n", "could not determine a constructor"),
    "an undefined alias": ("a: 1\nb: *x\n", "doc.yaml:2: not valid YAML: found undefined alias"),
    "an anchor twice": ("a: &x 1\nb: &x [2]\nc: *x\n", "doc.yaml:2: not valid YAML: second occurrence"),
}


@pytest.mark.parametrize(("text", "message"), ERRORS.values(), ids=ERRORS.keys())
def test_errors_name_the_line_as_before(text: str, message: str) -> None:
    with pytest.raises(Exception) as got:
        yamlsource.load_text(text, "doc.yaml", ConfigError)
    assert message in str(got.value)


plain_data = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=20)


@given(plain_data, st.booleans())
def test_the_fast_read_reads_what_the_safe_loader_reads(data: Any, flow: bool) -> None:
    """A plain document (names as keys, no tags) is read from the events, never refused to the node read."""
    text = yaml.safe_dump(data, default_flow_style=flow, allow_unicode=True)
    assert yamlsource._read_plain(text) == yaml.safe_load(text) == yamlsource._load_nodes(text, "d", ConfigError)[0]
