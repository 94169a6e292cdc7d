"""The benchmarks still run: each in its quick mode, as a child process, checked for sane output.
(Figures are not asserted: performance lives in the benchmarks, not in timed tests.)"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.mark.slow
def test_admission_benchmark_quick_run() -> None:
    out = subprocess.run([sys.executable, str(BENCH / "admission.py"), "--quick"], capture_output=True, text=True,
                         timeout=240)
    assert out.returncode == 0, out.stderr
    assert "decisions/s" in out.stdout


@pytest.mark.slow
def test_plan_benchmark_quick_run() -> None:
    out = subprocess.run([sys.executable, str(BENCH / "plan.py"), "--quick"], capture_output=True, text=True,
                         timeout=240)
    assert out.returncode == 0, out.stderr
    rows = [line.split() for line in out.stdout.splitlines() if line.split()[:1] in (["200"], ["600"])]
    assert len(rows) == 2 and all(float(r[3]) > 0 and float(r[4]) > 0 for r in rows), out.stdout


@pytest.mark.slow
def test_api_benchmark_quick_run(tmp_path: Path) -> None:
    figures = tmp_path / "api.json"
    out = subprocess.run([sys.executable, str(BENCH / "api.py"), "--quick", "--duration", "1", "--direct-n", "50",
                          "--json", str(figures)], capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stdout + out.stderr
    results = json.loads(figures.read_text())["results"]["sqlite w=1"]
    assert set(results) == {"POST /v1/workloads", "GET /v1/workloads/{id}", "GET /healthz",
                            "direct create (no HTTP)"}
    for name, r in results.items():
        assert r["errors"] == 0, name
        assert r["requests"] > 0 and r["rps"] > 0 and 0 < r["p50_ms"] <= r["p99_ms"], (name, r)


@pytest.mark.slow
def test_gateway_benchmark_quick_run(tmp_path: Path) -> None:
    figures = tmp_path / "gateway.json"
    out = subprocess.run([sys.executable, str(BENCH / "gateway.py"), "--quick", "--json", str(figures)],
                         capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stdout + out.stderr
    results = json.loads(figures.read_text())["results"]
    assert {"direct", "tensora", "tensora dead replica", "tensora breaker open"} <= set(results)
    for name in ("direct", "tensora"):
        r = results[name]
        assert r["c1"]["errors"] == 0 and r["c32"]["errors"] == 0 and r["c32"]["requests"] > 0, name
        assert 0 < r["stream20"]["first_p50_ms"] <= r["stream20"]["total_p50_ms"], name
    assert results["tensora"]["added_over_direct"]["p50_ms"] > 0


@pytest.mark.slow
def test_routes_benchmark_quick_run(tmp_path: Path) -> None:
    figures = tmp_path / "routes.json"
    out = subprocess.run([sys.executable, str(BENCH / "routes.py"), "--quick", "--json", str(figures)],
                         capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stdout + out.stderr
    r = json.loads(figures.read_text())["results"]["sqlite"]
    assert min(r["document_bytes"], r["unchanged_poll_ms"], r["full_build_ms"], r["ratio"]) > 0
    assert "full/unchanged" in out.stdout


@pytest.mark.slow
def test_controller_benchmark_quick_run() -> None:
    out = subprocess.run([sys.executable, str(BENCH / "controller.py"), "--quick"], capture_output=True, text=True,
                         timeout=240)
    assert out.returncode == 0, out.stderr
    assert "spec bytes read by the snapshot: 0" in out.stdout, out.stdout
