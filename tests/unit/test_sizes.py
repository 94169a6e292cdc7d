"""One style for every size a person reads: ``units.format_memory``'s ``Ki``/``Mi``/``Gi`` (what ``--memory`` flags
and size settings accept, so a value can be copied back), in the CLI, the API's messages, the reasons, the banner
and the dashboard; and no second formatter in the tree writing ``KiB`` or ``GiB``."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from rich.progress import Progress

from tensora.cli.files import SizeColumn
from tensora.config.catalog import default_catalog
from tensora.control.spec import SPEC_MAX_BYTES, parse_spec
from tensora.dashboard.pages import templates
from tensora.drivers.hardware import gpu_notes, offered
from tensora.errors import ConfigError, ModelFileError
from tensora.models.validator import read_file
from tensora.placement.capacity import Node
from tensora.sandbox.host import detect_host
from tensora.sandbox.runc import CONFIG, Runc
from tensora.storage import OverQuota
from tensora.units import GIB, format_memory, parse_memory

KI, MI = 2**10, 2**20
SRC = Path(__file__).resolve().parents[2] / "src" / "tensora"
ANOTHER_STYLE = re.compile(r"\d ?[KMGTP]iB|\} ?[KMGTP]iB|\d(\.\d)? (KB|MB|GB|kB)\b")
"""A size written as ``835.4 KiB``, ``{x} GiB`` or rich's ``835.4 kB``: not the one style."""


@dataclass(frozen=True)
class Case:
    said: Callable[[Path], str]
    want: str


def _oom_reason(tmp: Path) -> str:
    """The reason ``Runc`` gives for a sandbox its cgroup killed for memory: its limit, from its bundle."""
    runc = Runc(tmp / "root", tmp / "bundles", host=detect_host())
    (tmp / "bundles" / "hog").mkdir(parents=True)
    (tmp / "bundles" / "hog" / CONFIG).write_text(json.dumps({"linux": {"resources": {"memory": {
        "limit": 1536 * MI}}}}))
    runc.oom_killed = lambda sandbox_id: True  # type: ignore[method-assign]
    return runc.exit_reason("hog") or ""


def _header_over_cap(tmp: Path) -> str:
    path = tmp / "big.safetensors"
    path.write_bytes((17 * MI).to_bytes(8, "little") + b"{}")
    with pytest.raises(ModelFileError) as got:
        read_file(path)
    return got.value.message


def _progress(tmp: Path) -> str:
    with Progress(SizeColumn(), disable=True) as bar:
        task = bar.add_task("x", total=855_450, completed=853_197)
        return str(SizeColumn().render(bar.tasks[task]))


def _spec_too_big(tmp: Path) -> str:
    body = {"kind": "notebook", "name": "nb", "gpu_class": "cpu-1c-4g", "spec": {"x": "y" * SPEC_MAX_BYTES}}
    with pytest.raises(ConfigError) as got:
        parse_spec(body)
    return got.value.message


NODE = Node("box", "local", 8, int(21.5 * GIB), {"H200": 1}, {"tensora.io/cores": "2"})
CASES = {
    "storage quota refusal (API 413, CLI)": Case(
        lambda t: str(OverQuota(8 * MI, 5 * MI, 853_197)),
        "over your storage quota of 8Mi: 5Mi is used by your other files, 833.2Ki by your uploads in flight "
        "(delete some with tensora files rm)"),
    "a sandbox's out-of-memory reason": Case(_oom_reason, "out of memory: limit 1.5Gi"),
    "tensora up's node line": Case(lambda t: offered(NODE), "2 cores offered as 8 vCPU (overcommit 4x: replicas "
                                   "share the cores; CPU classes up to 2 vCPU), 21.5Gi, 1x H200"),
    "a GPU no class fits": Case(
        lambda t: gpu_notes(NODE, default_catalog())[0],
        "1x H200 offered, but no class of it fits this node (8 vCPU, 21.5Gi): h200-141gb needs 1 GPU, 16 vCPU, "
        "240Gi. Use a catalog with a class that fits, or declare node: memory"),
    "a create's spec over its bound (API 422)": Case(
        _spec_too_big, f"at most 16384 bytes of JSON (16Ki); this one is {SPEC_MAX_BYTES + 8}"),
    "a model header over the cap": Case(_header_over_cap, f"header length {17 * MI} exceeds the 16Mi cap on "
                                        "safetensors headers"),
    "the upload progress bar": Case(_progress, "833.2Ki/835.4Ki"),
    "the dashboard's size filter": Case(lambda t: templates.env.from_string("{{ n | size }}").render(n=853_197),
                                        "833.2Ki"),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_every_size_a_person_reads_is_in_the_one_style(case: Case, tmp_path: Path) -> None:
    said = case.said(tmp_path)
    assert said == case.want
    assert not ANOTHER_STYLE.search(said)


def test_the_one_style_reads_back() -> None:
    for size in (853_197, 5 * MI, 1536 * MI, 240 * GIB):
        text = format_memory(size)
        assert abs(parse_memory(text) - size) <= size * 0.001, text  # one decimal: copied back, the same size


def test_no_module_writes_sizes_in_another_style() -> None:
    """Every size a module renders goes through ``units.format_memory``: no f-string writes ``{...} GiB``, and no
    second formatter exists (comments and docstrings may say ``16 MiB`` in prose)."""
    found = []
    for path in sorted(SRC.rglob("*.py")):
        text = path.read_text()
        found += [f"{path.relative_to(SRC)}: def {m[1]}" for m in re.finditer(r"def (format_bytes|human_size)\b",
                                                                               text)]
        found += [f"{path.relative_to(SRC)}: {m[0]}" for m in re.finditer(r"\} ?[KMGTP]iB", text)]
    assert found == []


@pytest.mark.parametrize(("size", "text"), [(16 << 30, "16Gi"), (1536 << 20, "1.5Gi"), (64 << 20, "64Mi"),
                                            (853_197, "833.2Ki"), (100, "100B"), (0, "0B")])
def test_format_memory(size: int, text: str) -> None:
    assert format_memory(size) == text


def test_only_an_exact_size_has_no_decimal() -> None:
    assert format_memory(2 * MI) == "2Mi"
    assert format_memory(2 * MI + 700) == "2.0Mi"  # not exactly 2Mi: "2.0Mi is over the 2Mi cap" reads true
