"""`tensora plan` end to end: the real command on the shipped examples and on bad files."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from tensora.config.catalog import default_catalog
from tensora.control import fleet
from tensora.control.events import EventType
from tensora.placement.kinds import ReplicaRole, ReplicaState

ROOT = Path(__file__).resolve().parents[2]
EX = ROOT / "examples"
CATALOG = default_catalog()


def tensora(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", "from tensora.cli import main; main()", *args],
                          capture_output=True, text=True, timeout=60, check=False, env={**os.environ, **env})


def plan_json(at: str, workloads: Path = EX / "workloads.yaml") -> dict[str, dict]:
    r = tensora("plan", "--nodes", str(EX / "nodes.yaml"), "--workloads", str(workloads), "--at", at, "-o", "json")
    assert r.returncode == 0, r.stderr
    return {row["name"]: row for row in json.loads(r.stdout)["workloads"]}


def test_plan_example_over_time() -> None:
    at6 = plan_json("6m")
    assert at6["alice-nb"]["placed_class"] == "l40s-48gb"
    assert at6["bob-llm"]["placed_class"] == "cpu-16c-64g"
    assert at6["bob-llm"]["reason"] == "placed on cpu-16c-64g: l40s-48gb unavailable for 5m"
    assert at6["carol-vm"]["state"] == "queued" and at6["carol-vm"]["fallback_eligible_at"] == "12m"
    assert "model too large" in at6["dave-70b"]["reason"]
    at12 = plan_json("12m")
    assert at12["carol-vm"]["placed_class"] == "a100-80gb"
    at25 = plan_json("25m")
    assert at25["alice-nb"]["state"] == "stopped"
    assert at25["dave-70b"]["placed_class"] == "l40s-48gb"  # older than erin, and its own owner
    assert at25["erin-nb"]["state"] == "queued"
    assert at25["bob-llm"]["placed_class"] == "cpu-16c-64g"  # erin still waits for the L40S: no move back


def test_plan_prints_a_plain_row_a_workload_at_80_columns() -> None:
    r = tensora("plan", "--nodes", str(EX / "nodes.yaml"), "--workloads", str(EX / "workloads.yaml"), "--at", "6m",
                COLUMNS="80")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[:2] == ["Placement at 6m", lines[1]] and lines[1].split() == ["name", "kind", "requested", "placed",
                                                                              "state", "reason"]
    rows = {line.split()[0]: line for line in lines[2:]}
    assert list(rows) == list(plan_json("6m")) and len(lines) == 2 + len(rows)
    assert "cpu-16c-64g (fallback)" in rows["bob-llm"] and rows["bob-llm"].endswith("l40s-48gb unavailable for 5m")


def test_plan_moves_an_endpoint_back_when_the_gpu_frees(tmp_path: Path) -> None:
    save_file({"w": np.zeros((64, 64), np.float16)}, str(tmp_path / "tiny.safetensors"))
    wl = tmp_path / "w.yaml"
    wl.write_text(
        "workloads:\n"
        "  - {kind: notebook, name: first, gpu_class: l40s-48gb, submitted_at: 0s, stop_at: 10m}\n"
        "  - {kind: endpoint, name: llm, gpu_class: l40s-48gb, fallback: [cpu], model: tiny.safetensors,"
        " submitted_at: 1m}\n"
        "  - {kind: notebook, name: nb, gpu_class: a100-80gb, fallback: [cpu], submitted_at: 1m}\n"
        "  - {kind: vm, name: hog, gpu_class: a100-80gb, submitted_at: 0s, stop_at: 20m}\n")
    rows = plan_json("11m", wl)
    # the controller's move back: a candidate on the L40S, ready, then primary while the CPU replica drains
    assert rows["llm"]["placed_class"] == "l40s-48gb" and rows["llm"]["reason"].startswith("moved back to l40s-48gb")
    later = plan_json("21m", wl)
    assert later["nb"]["placed_class"].startswith("cpu-") and later["nb"]["restart_available"] is True


MOVE_BACK = ("workloads:\n"
             "  - {kind: notebook, name: first, gpu_class: l40s-48gb, submitted_at: 0s, stop_at: 10m}\n"
             "  - {kind: endpoint, name: llm, gpu_class: l40s-48gb, fallback: [cpu], model_params: 1B,"
             " submitted_at: 1m}\n")


@pytest.mark.parametrize(("at", "old_state"), [pytest.param(600.0, ReplicaState.RUNNING, id="while it drains"),
                                               pytest.param(605.0, ReplicaState.STOPPED, id="drained")])
def test_plan_moves_back_as_the_controller_does_through_candidate_and_draining(
        tmp_path: Path, at: float, old_state: ReplicaState) -> None:
    """The plan runs the controller's apply and reconcile: the L40S replica starts as a candidate, becomes
    the primary when ready, and the CPU replica drains (still holding its capacity) for drain_s, then stops."""
    (tmp_path / "w.yaml").write_text(MOVE_BACK)
    ledger = fleet.replay(fleet.load_nodes(EX / "nodes.yaml"), fleet.load_workloads(tmp_path / "w.yaml", CATALOG),
                          CATALOG, at).ledger
    moved = [e for e in ledger.events if e.workload_id == "llm" and e.type != EventType.TRANSITION]
    assert [(e.type, e.at) for e in moved] == [(EventType.MOVING, 600.0), (EventType.MOVED, 600.0),
                                               *([(EventType.DRAINED, 605.0)] if at >= 605 else [])]
    assert moved[0].reason.startswith("moving back to l40s-48gb from cpu-16c-64g")
    replicas = {r.cls: (r.role, r.state) for r in ledger.replicas.values() if r.workload_id == "llm"}
    assert replicas == {"cpu-16c-64g": (ReplicaRole.DRAINING, old_state),
                        "l40s-48gb": (ReplicaRole.PRIMARY, ReplicaState.RUNNING)}
    assert ledger.workloads["llm"].placed_class == "l40s-48gb"


def test_a_stop_frees_its_capacity_at_the_moment_it_stops(tmp_path: Path) -> None:
    """The simulated replica stops at once: a workload whose fallback timer runs out at that very moment
    gets the GPU it asked for, not its fallback (the stop is seen by the first cycle of the moment)."""
    (tmp_path / "w.yaml").write_text(
        "workloads:\n"
        "  - {kind: notebook, name: first, gpu_class: l40s-48gb, submitted_at: 0s, stop_at: 5m}\n"
        "  - {kind: vm, name: next, gpu_class: l40s-48gb, fallback: [a100-80gb], fallback_after: 4m,"
        " submitted_at: 1m}\n")
    rows = {r.name: r for r in fleet.plan(fleet.load_nodes(EX / "nodes.yaml"),
                                          fleet.load_workloads(tmp_path / "w.yaml", CATALOG), CATALOG, 300.0)}
    assert (rows["first"].state, rows["first"].reason, rows["first"].node) == ("stopped", "stopped at 5m", "gpu-l40s-1")
    assert (rows["next"].state, rows["next"].placed_class, rows["next"].node) == ("running", "l40s-48gb", "gpu-l40s-1")


def test_plan_table_output() -> None:
    r = tensora("plan", "--nodes", str(EX / "nodes.yaml"), "--workloads", str(EX / "workloads.yaml"), "--at", "6m")
    assert r.returncode == 0 and "bob-llm" in r.stdout and "fallback" in r.stdout


def test_bad_files_name_file_line_and_field(tmp_path: Path) -> None:
    bad = tmp_path / "w.yaml"
    bad.write_text("workloads:\n  - {kind: notebook, name: a, gpu_class: l40s-48gb}\n"
                   "  - {kind: notebook, name: b, gpu_class: l40s-48gb, fallback: [tpu-v5]}\n")
    r = tensora("plan", "--nodes", str(EX / "nodes.yaml"), "--workloads", str(bad))
    assert r.returncode == 2 and f"{bad}:3: workloads[1].fallback[0]" in r.stderr and "tpu-v5" in r.stderr
    nodes = tmp_path / "n.yaml"
    nodes.write_text("nodes:\n  - name: x\n    allocatable: {cpu: 4, memory: 8Gi, gpu: {L40S: 1}}\n")
    r = tensora("plan", "--nodes", str(nodes), "--workloads", str(EX / "workloads.yaml"))
    assert r.returncode == 2 and f"{nodes}:3: nodes[0].allocatable.gpu: unknown field" in r.stderr
    r = tensora("plan", "--nodes", str(tmp_path / "missing.yaml"), "--workloads", str(bad))
    assert r.returncode == 2 and "missing.yaml" in r.stderr


def test_model_size_command(tmp_path: Path) -> None:
    save_file({"w": np.zeros((10, 10), np.float32)}, str(tmp_path / "m.safetensors"))
    r = tensora("model-size", str(tmp_path / "m.safetensors"), "-o", "json")
    assert r.returncode == 0 and json.loads(r.stdout)["params"] == 100 and json.loads(r.stdout)["cpu_allowed"]


def test_plan_names_the_resource_short_and_a_class_the_region_lacks(tmp_path: Path) -> None:
    """A 4-vCPU machine whose memory is nearly all taken, and no GPU: the reasons say memory, and "none here"."""
    nodes = tmp_path / "nodes.yaml"
    nodes.write_text("nodes:\n  - {name: laptop, region: local, allocatable: {cpu: 8, memory: 21.5Gi}}\n")
    workloads = tmp_path / "workloads.yaml"
    workloads.write_text(
        "workloads:\n"
        "  - {kind: notebook, name: big, gpu_class: cpu-4c-16g, submitted_at: 0s}\n"
        "  - {kind: notebook, name: small, gpu_class: cpu-1c-4g, submitted_at: 0s}\n"
        "  - {kind: notebook, name: more, gpu_class: cpu-2c-8g, submitted_at: 1m}\n"
        "  - {kind: notebook, name: gpu, gpu_class: l40s-48gb, submitted_at: 1m}\n")
    r = tensora("plan", "--nodes", str(nodes), "--workloads", str(workloads), "--at", "2m", "-o", "json")
    assert r.returncode == 0, r.stderr
    rows = {row["name"]: row for row in json.loads(r.stdout)["workloads"]}
    assert rows["more"]["reason"] == "waiting for cpu-2c-8g (1.5Gi memory free, 8Gi needed); no fallback accepted"
    assert rows["gpu"]["reason"] == ("this region has no l40s-48gb (0 of 0); it waits until one is added, "
                                     "or add a fallback")


def test_plan_counts_a_node_s_pods(tmp_path: Path) -> None:
    """A node that holds two pods: the third workload waits for a pod, with vCPUs and memory to spare."""
    nodes = tmp_path / "nodes.yaml"
    nodes.write_text("nodes:\n  - {name: small, region: local, allocatable: {cpu: 64, memory: 256Gi, pods: 2}}\n")
    workloads = tmp_path / "workloads.yaml"
    workloads.write_text(
        "workloads:\n"
        "  - {kind: notebook, name: one, gpu_class: cpu-1c-4g, submitted_at: 0s}\n"
        "  - {kind: notebook, name: two, gpu_class: cpu-1c-4g, submitted_at: 0s}\n"
        "  - {kind: notebook, name: three, gpu_class: cpu-1c-4g, submitted_at: 1m}\n")
    r = tensora("plan", "--nodes", str(nodes), "--workloads", str(workloads), "--at", "2m", "-o", "json")
    assert r.returncode == 0, r.stderr
    rows = {row["name"]: row for row in json.loads(r.stdout)["workloads"]}
    assert rows["one"]["placed_class"] == rows["two"]["placed_class"] == "cpu-1c-4g"
    assert rows["three"]["reason"] == "waiting for cpu-1c-4g (0 pods free, 1 needed); no fallback accepted"
