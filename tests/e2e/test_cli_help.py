"""``tensora --help`` and each group's: a command's description is wrapped at the terminal's width, never at the
line breaks of the source it came from (a line that ends mid-sentence with room left on it)."""

from __future__ import annotations

import itertools
import os
import re
import subprocess
import sys

import pytest

GROUPS = [[], ["workloads"], ["notebook"], ["vm"], ["endpoint"], ["keys"], ["owners"], ["files"], ["runtime"],
          ["dev"]]
_ROW = re.compile(r"^│ (\S+)( +)(\S.*?) *│$")
_MORE = re.compile(r"^│ {2,}(\S.*?) *│$")


def help_of(args: list[str], columns: int) -> str:
    env = {**os.environ, "COLUMNS": str(columns), "TERM": "dumb"}
    r = subprocess.run([sys.executable, "-c", "from tensora.cli import main; main()", *args, "--help"],
                       capture_output=True, text=True, timeout=60, env=env, check=False)
    assert r.returncode == 0, r.stderr
    return r.stdout


def short_lines(text: str) -> list[str]:
    """The lines of a command panel's descriptions that end although the next word would have fitted."""
    found: list[str] = []
    lines = text.splitlines()
    for i, line in enumerate(lines):
        row = _ROW.match(line)
        if row is None or row.group(1).startswith("-"):
            continue
        start = len(row.group(1)) + len(row.group(2)) + 2  # where the description column begins
        width = len(line) - 2 - start  # its width: the panel's, less the name column and the borders
        desc = [row.group(3)]
        for nxt in lines[i + 1:]:
            more = _MORE.match(nxt)
            if more is None or len(nxt) - len(nxt.lstrip("│ ")) != start:
                break
            desc.append(more.group(1))
        for here, after in itertools.pairwise(desc):
            if len(here) + 1 + len(after.split()[0]) <= width:
                found.append(f"{row.group(1)}: {here!r} then {after!r}")
    return found


@pytest.mark.parametrize("columns", [80, 120])
@pytest.mark.parametrize("group", GROUPS, ids=lambda g: " ".join(g) or "tensora")
def test_a_description_breaks_only_where_the_terminal_is_full(group: list[str], columns: int) -> None:
    text = help_of(group, columns)
    assert "│" in text
    assert short_lines(text) == [], text


def test_the_check_finds_a_line_broken_early() -> None:
    panel = ("╭─ Commands ───────────────────────────╮\n"
             "│ login  Check a key against the API │\n"
             "│        and save it                 │\n"
             "│ chat   Chat                        │\n"
             "│        with an endpoint through    │\n"
             "│        the gateway.                │\n"
             "╰─────────────────────────────────────╯")
    assert short_lines(panel) == ["chat: 'Chat' then 'with an endpoint through'"]
