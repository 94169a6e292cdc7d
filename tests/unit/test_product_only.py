"""The tree speaks of the product only: no text about how the work on it was organised.

Code, comments, tests, docs and deployment files say what Tensora does and why, never which issue asked for it,
which session or helper did it, or how a figure moved from one run to the next: that history is git's. The
benchmarks page (docs/benchmarks.md, which quotes dated runs) is left out. Each named pattern below is
proven able to fail on an example of its own; the few legitimate uses it would flag are allowed by file and by a
piece of the line, and an allowance that no longer matches anything fails too, so the list cannot rot.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

LEFT_OUT = {"docs/benchmarks.md", "tests/unit/test_product_only.py"}
"""Files this rule does not read: the benchmarks page (its figures are dated), and this test (it spells them)."""

WALKED = ("src", "tests", "bench", "docs", "scripts", "deploy", ".ci")
"""Where to look when the tree is not a git checkout (a source archive): these folders and the top-level files."""

PATTERNS: dict[str, re.Pattern[str]] = {
    "an issue number": re.compile(r"\bissues? #?\d+", re.IGNORECASE),
    "a tracker reference": re.compile(r"(?:^|(?<=[\s(]))(?<!: )#\d{1,5}\b(?![\w;-])"),  # not a CSS colour
    "a session of work": re.compile(
        r"\b(this|that|the previous|an earlier|the last|the next) session(?:'s)?\b"
        r"|\bsession (before|after)\b|\bsessions (of|before|ago)\b|\btwo sessions\b", re.IGNORECASE),
    "a helper or assistant at work": re.compile(
        r"\b(?:the|a|another|each|this|that|other|one) helpers?(?:'s)?\b|\bhelper's\b(?! pid)"
        r"|\b(?:the|an|this) assistant\b(?! message| role)", re.IGNORECASE),
    "a round of work": re.compile(r"\b(this|last|previous|earlier|that) round\b(?! of )", re.IGNORECASE),
    "a review of the work": re.compile(r"\b(the|a|this) review of\b|\breviewers?\b|\bcode review\b", re.IGNORECASE),
    "who did what": re.compile(r"\b(the lead|the brief|this task|other engineers'?|we measured|we found)\b",
                               re.IGNORECASE),
    "a figure's history": re.compile(
        r"\bwas ~?\d[\d.,]* ?(?:ns|µs|us|ms|s|x|%|req/s|KiB|MiB|KB|MB)\b"
        r"|\b(?:before|after) (?:this|the) (?:change|fix)\b", re.IGNORECASE),
    "the time of a run": re.compile(r"(?<![:\d])\d{2}:\d{2} UTC\b"),
}
"""Each kind of work-organisation text, by name."""

EXAMPLES: dict[str, list[str]] = {
    "an issue number": ["Before issue 18 each poll built the document", "the targets (issue #36)", "issues 19"],
    "a tracker reference": ["fixed in #36", "(see #1114)"],
    "a session of work": ["This session's changes", "measured the session before", "0.59 s two sessions ago"],
    "a helper or assistant at work": ["the helper's A/B in the same runs", "another helper measured it",
                                      "the assistant wrote this"],
    "a round of work": ["the code of this round", "before the last round"],
    "a review of the work": ["as the review of 2026-12-05 asked", "a reviewer noticed"],
    "who did what": ["the lead merges it", "we measured 2 ms"],
    "a figure's history": ["the head was 0.8 µs, now 0.6", "before this change it took longer"],
    "the time of a run": ["last results (2026-12-05 07:03 UTC)"],
}
"""Text each pattern must flag: proof that it can fail."""

PRODUCT: dict[str, list[str]] = {
    "a tracker reference": ["color: #333;", "border: 1px solid #333;", "fill='#000'", "&#39;", "the page's #anchor",
                            "a list item #1-a"],
    "a session of work": ["the session's principal", "Who this session acts as"],
    "a helper or assistant at work": ["its network helper's pid", "the assistant message", "an assistant role"],
    "the time of a run": ["2027-01-15 08:10:00 UTC"],
}
"""Product text a pattern must let through (one of them only by its allowance below, where said so)."""

ALLOWED: dict[str, dict[str, list[str]]] = {
    "src/tensora/api/sessions.py": {"a session of work": ["Who this session acts as"]},
    "tests/unit/test_gateway_compiled_rules.py": {"an issue number": ["mypyc issues #1114, #1177"],
                                                  "a tracker reference": ["mypyc issues #1114, #1177"]},
    "tests/__init__.py": {"a helper or assistant at work": ["the helpers they share"]},
}
"""Legitimate uses, by file, pattern and a piece of the line: a dashboard session, mypyc's tracker, test helpers."""


def tracked_text_files() -> dict[str, str]:
    """Path (relative, with slashes) -> text of every tracked text file the rule reads."""
    try:
        listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
        paths = [p for p in listed.decode().split("\0") if p]
    except (OSError, subprocess.CalledProcessError):
        paths = [p.relative_to(ROOT).as_posix() for d in WALKED for p in (ROOT / d).rglob("*") if p.is_file()]
        paths += [p.name for p in ROOT.iterdir() if p.is_file()]
    texts: dict[str, str] = {}
    for path in paths:
        if path in LEFT_OUT or not (ROOT / path).is_file():
            continue
        data = (ROOT / path).read_bytes()
        if b"\0" in data:
            continue
        try:
            texts[path] = data.decode("utf-8")
        except UnicodeDecodeError:
            continue
    return texts


def offences(texts: dict[str, str]) -> list[tuple[str, int, str, str]]:
    """(path, line number, pattern name, line) of every line a pattern flags that no allowance covers."""
    found: list[tuple[str, int, str, str]] = []
    for path, text in texts.items():
        for number, line in enumerate(text.splitlines(), 1):
            for name, pattern in PATTERNS.items():
                if pattern.search(line) and not any(piece in line for piece in ALLOWED.get(path, {}).get(name, [])):
                    found.append((path, number, name, line.strip()[:160]))
    return found


@pytest.fixture(scope="module")
def texts() -> dict[str, str]:
    return tracked_text_files()


def test_the_tree_speaks_of_the_product_only(texts: dict[str, str]) -> None:
    assert "src/tensora/__init__.py" in texts and "docs/index.md" in texts, "the rule reads the tree"
    found = offences(texts)
    assert not found, "text about how the work was organised (rewrite it as a product statement):\n" + "\n".join(
        f"{path}:{number}: [{name}] {line}" for path, number, name, line in found)


@pytest.mark.parametrize(("name", "text"), [(n, t) for n, ts in EXAMPLES.items() for t in ts])
def test_each_pattern_flags_its_examples(name: str, text: str) -> None:
    assert PATTERNS[name].search(text), f"{name!r} misses {text!r}"


def test_every_pattern_has_an_example() -> None:
    assert set(EXAMPLES) == set(PATTERNS)


@pytest.mark.parametrize(("name", "text"), [(n, t) for n, ts in PRODUCT.items() for t in ts])
def test_product_text_passes_or_is_allowed(name: str, text: str) -> None:
    allowed = any(text.startswith(piece) or piece in text for by in ALLOWED.values() for piece in by.get(name, []))
    assert allowed or not PATTERNS[name].search(text), f"{name!r} flags product text {text!r}"


def test_a_planted_sentence_is_found() -> None:
    planted = {"src/tensora/planted.py": '"""Fast now (issue 22): this session cut it; it was 0.8 µs."""\n'}
    assert {name for _, _, name, _ in offences(planted)} == {"an issue number", "a session of work",
                                                           "a figure's history"}


def test_every_allowance_still_matches_a_line(texts: dict[str, str]) -> None:
    for path, by in ALLOWED.items():
        for name, pieces in by.items():
            for piece in pieces:
                lines = [line for line in texts.get(path, "").splitlines() if piece in line]
                assert any(PATTERNS[name].search(line) for line in lines), (
                    f"{path}: the allowance {piece!r} for {name!r} matches nothing flagged: drop it")
