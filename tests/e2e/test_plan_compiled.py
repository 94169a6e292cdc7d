"""`tensora plan` compiled (``tensora.native``) and from source print the same, byte for byte: the shipped examples
at moments where every kind of decision shows, and a generated fleet of 400 workloads over 90 minutes (the
benchmark's draw: fallbacks, timers, stops, moves back, endpoints too large for CPU)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tensora import native

ROOT = Path(__file__).resolve().parents[2]
EX = ROOT / "examples"

pytestmark = pytest.mark.skipif(native.why_pure() is not None,
                                reason=f"admission is not compiled here: {native.why_pure()}")


def plan(nodes: Path, workloads: Path, at: str, *, pure: bool) -> str:
    env = {**os.environ, native.PURE_ENV: "1" if pure else ""}
    code = ("import sys, tensora.native as n; from tensora.cli import main\n"
            f"assert n.compiled() is {not pure}, n.why_pure()\n"
            "sys.argv[0] = 'tensora'; main()")
    r = subprocess.run([sys.executable, "-c", code, "plan", "--nodes", str(nodes), "--workloads", str(workloads),
                        "--at", at, "-o", "json"], capture_output=True, text=True, timeout=120, env=env, check=False)
    assert r.returncode == 0, r.stderr
    return r.stdout


@pytest.mark.parametrize("at", ["0s", "6m", "12m", "25m", "2h"])
def test_the_examples_plan_alike_compiled_and_from_source(at: str) -> None:
    compiled = plan(EX / "nodes.yaml", EX / "workloads.yaml", at, pure=False)
    assert compiled == plan(EX / "nodes.yaml", EX / "workloads.yaml", at, pure=True)


def test_a_generated_fleet_plans_alike_compiled_and_from_source(tmp_path: Path) -> None:
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        from plan import write_files  # bench/plan.py: the benchmark's fleets
    finally:
        sys.path.remove(str(ROOT / "bench"))
    nodes, workloads = write_files(tmp_path, 400, 40, 90 * 60)
    compiled = plan(nodes, workloads, "90m", pure=False)
    assert '"state": "running"' in compiled and '"state": "queued"' in compiled
    assert compiled == plan(nodes, workloads, "90m", pure=True)
