"""Hardware detection: nvidia-smi rows, GPU names to catalog models, the local node with overrides, and how
it shares a small machine (the quick start's endpoint, a notebook and a VM side by side)."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tensora.config.catalog import default_catalog
from tensora.drivers.hardware import (
    Gpu,
    Hardware,
    NodeOverrides,
    detect,
    gpu_model_for,
    gpu_notes,
    local_node,
    offered,
    parse_nvidia_smi,
)
from tensora.placement.admission import Place, Queued, decide
from tensora.placement.capacity import Capacity, Node, Placed
from tensora.placement.kinds import WorkloadKind

GIB = 2**30
MIB = 2**20
CATALOG = default_catalog()

SMI = {
    "one L40S": ("0, NVIDIA L40S, 46068\n", [(0, "NVIDIA L40S", 46068 * MIB)]),
    "two A100s, blank line": ("0, NVIDIA A100-SXM4-80GB, 81920\n\n1, NVIDIA A100-SXM4-80GB, 81920\n",
                              [(0, "NVIDIA A100-SXM4-80GB", 81920 * MIB), (1, "NVIDIA A100-SXM4-80GB", 81920 * MIB)]),
    "an error line is skipped": ("NVIDIA-SMI has failed because it couldn't communicate with the driver\n", []),
    "memory not a number": ("0, NVIDIA H100, [N/A]\n", []),
    "nothing": ("", []),
}


@pytest.mark.parametrize("case", SMI.values(), ids=SMI.keys())
def test_parse_nvidia_smi(case: tuple[str, list[tuple[int, str, int]]]) -> None:
    text, want = case
    assert parse_nvidia_smi(text) == want


MODELS = {
    "L40S": ("NVIDIA L40S", 46068 * MIB, "L40S"),
    "A100 80GB SXM": ("NVIDIA A100-SXM4-80GB", 81920 * MIB, "A100-80GB"),
    "A100 80GB PCIe": ("NVIDIA A100 80GB PCIe", 81920 * MIB, "A100-80GB"),
    "A100 40GB is not the 80GB class": ("NVIDIA A100-SXM4-40GB", 40960 * MIB, None),
    "H100 HBM3": ("NVIDIA H100 80GB HBM3", 81559 * MIB, "H100"),
    "H200": ("NVIDIA H200", 143771 * MIB, "H200"),
    "a T4 has no class": ("Tesla T4", 15360 * MIB, None),
    "a name merely containing L40": ("NVIDIA L40", 46068 * MIB, None),
}


@pytest.mark.parametrize("case", MODELS.values(), ids=MODELS.keys())
def test_gpu_names_map_to_catalog_models(case: tuple[str, int, str | None]) -> None:
    name, memory, want = case
    assert gpu_model_for(name, memory, CATALOG) == want


def test_this_machine_is_detected() -> None:
    hw = detect(CATALOG)
    assert hw.cpu >= 1 and hw.memory > 256 * 2**20
    assert all(g.memory > 0 for g in hw.gpus)


HW = Hardware(cpu=16, memory=64 * GIB, gpus=(Gpu(0, "NVIDIA L40S", 46068 * MIB, "L40S"),
                                            Gpu(1, "NVIDIA L40S", 46068 * MIB, "L40S"),
                                            Gpu(2, "Tesla T4", 15360 * MIB, None)))


@dataclass(frozen=True)
class Offer:
    overrides: NodeOverrides
    cpu: float  # vCPUs offered
    cores: float  # the cores they share
    memory: int
    gpus: dict[str, int]


NODES = {
    "detected minus the default reserve, overcommitted 4x": Offer(NodeOverrides(name="box"), 60.0, 15.0, 62 * GIB,
                                                                  {"L40S": 2}),
    "a bigger reserve": Offer(NodeOverrides(name="box", reserve_cpu=4, reserve_memory="8Gi"), 48.0, 12.0, 56 * GIB,
                              {"L40S": 2}),
    "no overcommit": Offer(NodeOverrides(name="box", cpu_overcommit=1), 15.0, 15.0, 62 * GIB, {"L40S": 2}),
    "declared less for development": Offer(NodeOverrides(name="box", cpu=4, memory="8Gi", reserve_cpu=0,
                                                         reserve_memory=0, gpus={}), 16.0, 4.0, 8 * GIB, {}),
    "declared small: no core kept back by default": Offer(NodeOverrides(name="box", cpu=2, memory="24Gi", gpus={}),
                                                          8.0, 2.0, 22 * GIB, {}),
    "declared small, reserve set: the operator wins": Offer(NodeOverrides(name="box", cpu=2, reserve_cpu=1,
                                                                          cpu_overcommit=2), 2.0, 1.0, 62 * GIB,
                                                            {"L40S": 2}),
    "declared GPUs it lacks": Offer(NodeOverrides(name="box", gpus={"A100-80GB": 1}), 60.0, 15.0, 62 * GIB,
                                    {"A100-80GB": 1}),
    "reserve larger than the machine": Offer(NodeOverrides(name="box", reserve_cpu=32, reserve_memory="128Gi"),
                                             0.0, 0.0, 0, {"L40S": 2}),
}


@pytest.mark.parametrize("case", NODES.values(), ids=NODES.keys())
def test_local_node_from_hardware_and_overrides(case: Offer) -> None:
    node = local_node(HW, case.overrides, "local")
    assert (node.name, node.region, node.cpu, node.cores, node.memory, dict(node.gpus)) == (
        "box", "local", case.cpu, case.cores, case.memory, case.gpus)


# -- sharing a small machine: the quick start's endpoint, a notebook and a VM -----------------------

TINY = 880_000  # bytes of `tensora dev tiny-model`


def quick_start(node: Node) -> list[str | None]:
    """Where admission puts the quick start's three workloads (each asks for an L40S, CPU fallback at
    once), created one after the other; None for one left waiting."""
    workloads = [Queued("wl_ep", WorkloadKind.ENDPOINT, "l40s-48gb", fallback=("cpu",), model_params=205_000,
                        model_bytes=TINY),
                 Queued("wl_nb", WorkloadKind.NOTEBOOK, "l40s-48gb", fallback=("cpu",)),
                 Queued("wl_vm", WorkloadKind.VM, "l40s-48gb", fallback=("cpu",))]
    placed: list[Placed] = []
    out: list[str | None] = []
    for w in workloads:
        decision = decide([w], Capacity([node], placed, CATALOG), now=0.0)[0]
        if isinstance(decision, Place):
            placed.append(Placed(node.name, decision.cls, w.id))
        out.append(decision.cls if isinstance(decision, Place) else None)
    return out


@dataclass(frozen=True)
class Machine:
    cores: int
    memory_gib: float
    overrides: NodeOverrides
    offered: str  # hardware.offered(node)
    placed: list[str | None]


MACHINES = {
    "1 core, 16 GiB: classes of 1 vCPU, three of them": Machine(
        1, 16, NodeOverrides(), "1 core offered as 4 vCPU (overcommit 4x: replicas share the cores; CPU classes "
        "up to 1 vCPU), 14Gi, no GPUs", ["cpu-1c-4g", "cpu-1c-4g", "cpu-1c-4g"]),
    "2 cores, 24 GiB (the newcomer's machine): all three side by side": Machine(
        2, 23.5, NodeOverrides(), "2 cores offered as 8 vCPU (overcommit 4x: replicas share the cores; CPU classes "
        "up to 2 vCPU), 21.5Gi, no GPUs", ["cpu-2c-8g", "cpu-2c-8g", "cpu-1c-4g"]),
    "2 cores, 16 GiB: memory is never overcommitted, the VM waits": Machine(
        2, 16, NodeOverrides(), "2 cores offered as 8 vCPU (overcommit 4x: replicas share the cores; CPU classes "
        "up to 2 vCPU), 14Gi, no GPUs", ["cpu-2c-8g", "cpu-1c-4g", None]),
    "4 cores, 32 GiB": Machine(
        4, 32, NodeOverrides(), "4 cores offered as 16 vCPU (overcommit 4x: replicas share the cores; CPU classes "
        "up to 4 vCPU), 30Gi, no GPUs", ["cpu-4c-16g", "cpu-2c-8g", "cpu-1c-4g"]),
    "16 cores, 64 GiB: one core kept for the host": Machine(
        16, 64, NodeOverrides(), "15 cores offered as 60 vCPU (overcommit 4x: replicas share the cores; CPU classes "
        "up to 15 vCPU), 62Gi, no GPUs", ["cpu-8c-32g", "cpu-4c-16g", "cpu-2c-8g"]),
    "2 cores, 24 GiB, overcommit 1 (the operator's): only the endpoint runs": Machine(
        2, 23.5, NodeOverrides(cpu_overcommit=1), "2 cores, 21.5Gi, no GPUs", ["cpu-2c-8g", None, None]),
    "2 cores, 24 GiB, a core reserved (the operator's)": Machine(
        2, 23.5, NodeOverrides(reserve_cpu=1), "1 core offered as 4 vCPU (overcommit 4x: replicas share the cores; "
        "CPU classes up to 1 vCPU), 21.5Gi, no GPUs", ["cpu-1c-4g", "cpu-1c-4g", "cpu-1c-4g"]),
}


@pytest.mark.parametrize("case", MACHINES.values(), ids=MACHINES.keys())
def test_the_local_node_shares_a_small_machine(case: Machine) -> None:
    node = local_node(Hardware(case.cores, int(case.memory_gib * GIB)), case.overrides.model_copy(
        update={"name": "box"}), "local")
    assert offered(node) == case.offered
    assert quick_start(node) == case.placed


def test_a_cpu_class_above_the_shared_cores_is_never_offered() -> None:
    """The catalog's view (from nodes as the store keeps them: the cap travels in a label)."""
    node = local_node(Hardware(2, 24 * GIB), NodeOverrides(name="box"), "local")
    stored = Node(node.name, node.region, node.cpu, node.memory, dict(node.gpus), dict(node.labels))
    fits = {c.cls: c.fits for c in Capacity([stored], [], CATALOG).summary("local")}
    assert {k: v for k, v in fits.items() if k.startswith("cpu-")} == {
        "cpu-1c-4g": 5, "cpu-2c-8g": 2, "cpu-4c-16g": 0, "cpu-8c-32g": 0, "cpu-16c-64g": 0, "cpu-32c-128g": 0}


def test_tensora_node_shows_detected_and_offered(tmp_path: Path) -> None:
    config = tmp_path / "up.yaml"
    config.write_text("node: {cpu: 3, memory: 6Gi, reserve_cpu: 0.5, reserve_memory: 1Gi}\n")
    out = subprocess.run([sys.executable, "-m", "tensora.cli", "node", "--config", str(config), "-o", "json"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout)
    assert info["detected"]["cpu"] == detect(CATALOG).cpu
    assert (info["node"]["cpu"], info["node"]["cores"], info["node"]["memory"]) == (10, 2.5, 5 * GIB)


def test_tensora_node_says_how_a_small_machine_is_shared(tmp_path: Path) -> None:
    config = tmp_path / "up.yaml"
    config.write_text("node: {name: box, cpu: 2, memory: 24Gi, gpus: {}}\n")
    out = subprocess.run([sys.executable, "-m", "tensora.cli", "node", "--config", str(config)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert ("offered as node box (local): 2 cores offered as 8 vCPU (overcommit 4x: replicas share the cores; "
            "CPU classes up to 2 vCPU), 22Gi, no GPUs (after the host reserve of 0 cores, 2Gi)") in out.stdout


# the node -> the notes' telling words (none: no note)
GPU_NOTES = {
    "one H200 on a 128 GiB machine, as seen on the device host: the 240 GiB class never fits": (
        Node("vm", "local", 60, int(123.8 * GIB), {"H200": 1}),
        ["1x H200 offered, but no class of it fits this node (60 vCPU, 123.8Gi): h200-141gb needs 1 GPU, "
         "16 vCPU, 240Gi. Use a catalog with a class that fits, or declare node: memory"]),
    "the same GPU on a machine with the memory: no note": (Node("big", "local", 60, 256 * GIB, {"H200": 1}), []),
    "too few vCPUs for the class": (Node("small", "local", 8, 256 * GIB, {"H200": 1}), ["8 vCPU"]),
    "a GPU model no class uses": (Node("odd", "local", 60, 256 * GIB, {"B200": 2}),
                                  ["2x B200 offered, but no catalog class uses it"]),
    "a CPU-only node: nothing to say": (Node("cpu", "local", 8, 16 * GIB, {}), []),
    "a model declared with none of it: nothing to say": (Node("zero", "local", 8, 16 * GIB, {"H200": 0}), []),
}


@pytest.mark.parametrize("case", GPU_NOTES.values(), ids=GPU_NOTES.keys())
def test_a_gpu_no_class_can_use_is_said(case: tuple[Node, list[str]]) -> None:
    node, words = case
    notes = gpu_notes(node, CATALOG)
    assert len(notes) == len(words) and all(w in n for w, n in zip(words, notes, strict=True)), notes


def test_tensora_node_says_when_its_gpu_fits_no_class(tmp_path: Path) -> None:
    config = tmp_path / "up.yaml"
    config.write_text("node: {cpu: 16, memory: 128Gi, gpus: {H200: 1}}\n")
    out = subprocess.run([sys.executable, "-m", "tensora.cli", "node", "--config", str(config), "-o", "json"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    (note,) = json.loads(out.stdout)["node"]["notes"]
    assert "no class of it fits this node" in note and "h200-141gb needs 1 GPU, 16 vCPU, 240Gi" in note


def test_tensora_node_names_a_bad_override(tmp_path: Path) -> None:
    config = tmp_path / "up.yaml"
    config.write_text("node: {cpus: 3}\n")
    out = subprocess.run([sys.executable, "-m", "tensora.cli", "node", "--config", str(config)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert str(config) in out.stderr and "node.cpus" in out.stderr and "unknown setting" in out.stderr
