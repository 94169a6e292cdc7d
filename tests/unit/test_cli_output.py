"""How the CLI prints, as pure functions: tables and fields that never wrap or cut an id (on an
80-column terminal and piped), no trailing spaces; times with their zone, waits as they are typed; API fields said
as the flags that set them;
which API URLs are this machine's (where ``tensora login`` looks for the local admin key)."""

from __future__ import annotations

import datetime as dt
import io
import json
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from rich.console import Console
from rich.table import Table
from rich.text import Text

from tensora.cli.common import Col, api_error_text, emit, fields, flag_for, json_text, table, width_for
from tensora.cli.create import CREATE_FLAGS, ENDPOINT_FLAGS
from tensora.cli.keys import KEY_FLAGS
from tensora.cli.profile import is_loopback
from tensora.cli.root import fallback_text, local_time
from tensora.cli.usage import USAGE_FLAGS

ID1, ID2 = "wl_0mx8lgimfaxUqHu6V", "wl_0mx8ucmpppUIOXJf5eD"
URL = "http://127.0.0.1:40123/lab?token=3f1c9a8b7e6d5c4b3a291807f6e5d4c3b2a19081"
REASON = "placed on cpu-16c-64g: l40s-48gb unavailable for 10m; also tried a100-80gb (0 GPU free, 1 needed)"


def workloads(name: str = "nb") -> Table:
    return table(["id", "name", "state", "placed", Col("reason", wrap=True)],
                 [(ID1, name, "running", Text.assemble(("cpu-16c-64g", "yellow"), " (fallback)"), REASON),
                  (ID2, "vm1", "queued", "-", "waiting for a100-80gb (0 GPU free, 1 needed)")])


def one() -> Table:
    return fields([("id", ID1), ("reason", REASON), ("url", URL), ("replica", f"rp_abc cpu-2c-8g running {URL}")])


@dataclass
class Case:
    build: object  # () -> the renderable
    terminal: int | None  # the terminal's width; None: piped
    whole: dict[str, int] = field(default_factory=lambda: {ID1: 1, ID2: 1})  # words that stay whole: how often
    lines: int | None = None  # how many lines, when that is the point
    fits: bool = False  # every line within the terminal's width


CASES = {
    "piped: one line per row, as wide as the content": Case(workloads, None, lines=3),
    "80-col terminal, the rest fits: the reason wraps at spaces, ids whole": Case(workloads, 80, fits=True),
    "80-col terminal, too wide even wrapped: one line per row": Case(lambda: workloads("a" * 50), 80, lines=3),
    "wide terminal: one line per row": Case(workloads, 300, lines=3),
    "fields piped: a line each": Case(one, None, whole={ID1: 1, URL: 2}, lines=4),
    "fields on 120 cols: the reason wraps under itself, the URL stays whole": Case(one, 120, whole={ID1: 1, URL: 2},
                                                                                  fits=True),
    "fields on 80 cols: narrower than the URL, so a line each": Case(one, 80, whole={ID1: 1, URL: 2}, lines=4),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_render(case: Case) -> None:
    buf = io.StringIO()
    console = Console(file=buf, width=case.terminal or 80, force_terminal=case.terminal is not None,
                      color_system=None, highlight=False, soft_wrap=True)
    emit(case.build(), console)  # type: ignore[operator]
    lines = buf.getvalue().split("\n")
    assert lines[-1] == "", buf.getvalue()
    lines = lines[:-1]
    assert [line for line in lines if line != line.rstrip()] == []
    for word, times in case.whole.items():
        assert sum(line.count(word) for line in lines) == times, buf.getvalue()
    if case.lines is not None:
        assert len(lines) == case.lines, buf.getvalue()
    if case.fits:
        assert case.terminal is not None and max(len(line) for line in lines) <= case.terminal, buf.getvalue()
        assert len(lines) > 3, buf.getvalue()  # something did wrap


WIDTHS = {
    "piped: the content's width": ((40, 200, None), 200),
    "terminal wider than the content: the content's": ((40, 60, 80), 60),
    "fits when wrapped: the terminal's": ((40, 200, 80), 80),
    "too wide even wrapped: the content's, one line per row": ((100, 200, 80), 200),
    "exactly the minimum: the terminal's": ((80, 200, 80), 80),
    "nothing to draw: one column": ((0, 0, None), 1),
}


@pytest.mark.parametrize(("args", "want"), WIDTHS.values(), ids=WIDTHS.keys())
def test_width_for(args: tuple[int, int, int | None], want: int) -> None:
    assert width_for(*args) == want


FLAGS = {
    "a field the command has a flag for": ("gpu_class", CREATE_FLAGS, "--gpu-class"),
    "fallback_after is stored as fallback_after_s": ("fallback_after_s", CREATE_FLAGS, "--fallback-after"),
    "an item of a list: the list's flag": ("fallback[0]", CREATE_FLAGS, "--fallback"),
    "the name: the NAME argument": ("name", CREATE_FLAGS, "NAME"),
    "an endpoint's model": ("model", ENDPOINT_FLAGS, "--model"),
    "fallback_models is said --fallback-model": ("fallback_models[1]", ENDPOINT_FLAGS, "--fallback-model"),
    "a key under spec: --spec KEY": ("spec.ttft_deadline_s", CREATE_FLAGS, "--spec ttft_deadline_s"),
    "scopes of a key: --scope": ("scopes[2]", KEY_FLAGS, "--scope"),
    "requests_per_minute is --rpm": ("requests_per_minute", KEY_FLAGS, "--rpm"),
    "usage's group_by": ("group_by", USAGE_FLAGS, "--group-by"),
    "a field the command sets itself: none": ("kind", CREATE_FLAGS, None),
    "model on a notebook: none": ("model", CREATE_FLAGS, None),
    "no field: none": (None, CREATE_FLAGS, None),
    "a nested field under a flag that has no sub-keys: the flag": ("region.x", CREATE_FLAGS, "--region"),
}


@pytest.mark.parametrize(("api_field", "flags", "want"), FLAGS.values(), ids=FLAGS.keys())
def test_flag_for(api_field: str | None, flags: dict[str, str], want: str | None) -> None:
    assert flag_for(api_field, flags) == want


ERRORS = {
    "a field with a flag: the flag first, the field after":
        ((422, "unknown class 'x'", "gpu_class", "req_1"), "422 --gpu-class: unknown class 'x' (API field gpu_class) "
                                                           "[request req_1]"),
    "a field without a flag: the field": ((422, "unknown field", "kind", None), "422 unknown field (field kind)"),
    "no field": ((404, "no workload 'x'", None, "req_2"), "404 no workload 'x' [request req_2]"),
    "no status (no answer)": ((None, "cannot reach it", None, None), "cannot reach it"),
}


@pytest.mark.parametrize(("args", "want"), ERRORS.values(), ids=ERRORS.keys())
def test_api_error_text(args: tuple[int | None, str, str | None, str | None], want: str) -> None:
    assert api_error_text(*args, CREATE_FLAGS) == want


LOOPBACK = {
    "127.0.0.1": ("http://127.0.0.1:8700", True),
    "another 127/8 address": ("http://127.1.2.3:8700", True),
    "localhost": ("http://localhost:8700", True),
    "IPv6 ::1": ("http://[::1]:8700", True),
    "a LAN address": ("http://192.168.1.10:8700", False),
    "all interfaces is not a client's address": ("http://0.0.0.0:8700", False),
    "a DNS name": ("https://api.tensora.example", False),
    "a name that starts like localhost": ("http://localhost.example.com", False),
    "no host": ("http:///x", False),
    "not a URL": ("http://[::1", False),
}


@pytest.mark.parametrize(("url", "want"), LOOPBACK.values(), ids=LOOPBACK.keys())
def test_is_loopback(url: str, want: bool) -> None:
    assert is_loopback(url) is want


def _containers(inner: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """Lists and mappings of ``inner`` (a function, not a lambda: hypothesis reads its source to check that it
    recurses, and a lambda's source is not always found)."""
    return st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4)


json_docs = st.recursive(st.none() | st.booleans() | st.integers(-(2**63), 2**63 - 1) | st.text(), _containers,
                         max_leaves=20)

JSON_CASES = {
    "a plan's row": {"workloads": [{"name": "a", "placed_class": None, "restart_available": False, "node": "n-1"}]},
    "empty containers": {"a": [], "b": {}, "c": [[], {}]},
    "accents": {"reason": "placé"},
    "a line separator": {"reason": "a\u2028b"},
    "delete": {"reason": "a\x7fb"},
    "controls and quotes": {"reason": "a\x01\"\\\n\t"},
}


@pytest.mark.parametrize("doc", JSON_CASES.values(), ids=JSON_CASES.keys())
def test_json_text_is_what_json_writes(doc: Any) -> None:
    assert json_text(doc) == json.dumps(doc, indent=2)


@given(json_docs)
def test_json_text_is_what_json_writes_of_any_document(doc: Any) -> None:
    assert json_text(doc) == json.dumps(doc, indent=2)


CET = dt.timezone(dt.timedelta(hours=1), "CET")
TIMES = {  # (API time, zone) -> as the CLI shows it: the zone always named
    "UTC": (("2026-12-07T14:32:10Z", dt.UTC), "2026-12-07 14:32:10 UTC"),
    "a named zone": (("2026-12-07T14:32:10Z", CET), "2026-12-07 15:32:10 CET"),
    "a zone known by its offset only": (("2026-12-07T14:32:10+00:00", dt.timezone(dt.timedelta(hours=5.5))),
                                        "2026-12-07 20:02:10 +0530"),
    "no time": ((None, dt.UTC), "-"),
}


@pytest.mark.parametrize(("args", "want"), TIMES.values(), ids=TIMES.keys())
def test_local_time_names_its_zone(args: tuple[str | None, dt.tzinfo], want: str) -> None:
    assert local_time(*args) == want


FALLBACKS = {  # (fallback list, seconds) -> as shown: the wait as it is typed
    "ten minutes": ((["cpu"], 600.0), "cpu, after 10m"),
    "at once": ((["a100-80gb", "cpu"], 0.0), "a100-80gb, cpu, after 0s"),
    "an hour and a half": ((["cpu"], 5400.0), "cpu, after 1h30m"),
    "none": (([], 600.0), "none (waits for its class)"),
}


@pytest.mark.parametrize(("args", "want"), FALLBACKS.values(), ids=FALLBACKS.keys())
def test_fallback_text_says_the_wait_as_typed(args: tuple[list[str], float], want: str) -> None:
    assert fallback_text(*args) == want
