"""Hardware detection: nvidia-smi rows, GPU names to catalog models, the local node with overrides."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tensora.catalog import default_catalog
from tensora.hardware import Gpu, Hardware, NodeOverrides, detect, gpu_model_for, local_node, parse_nvidia_smi

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

NODES = {
    "detected minus the default reserve": (NodeOverrides(name="box"), 15.0, 62 * GIB, {"L40S": 2}),
    "a bigger reserve": (NodeOverrides(name="box", reserve_cpu=4, reserve_memory="8Gi"), 12.0, 56 * GIB,
                         {"L40S": 2}),
    "declared less for development": (NodeOverrides(name="box", cpu=4, memory="8Gi", reserve_cpu=0,
                                                    reserve_memory=0, gpus={}), 4.0, 8 * GIB, {}),
    "declared GPUs it lacks": (NodeOverrides(name="box", gpus={"A100-80GB": 1}), 15.0, 62 * GIB,
                               {"A100-80GB": 1}),
    "reserve larger than the machine": (NodeOverrides(name="box", reserve_cpu=32, reserve_memory="128Gi"), 0.0, 0,
                                        {"L40S": 2}),
}


@pytest.mark.parametrize("case", NODES.values(), ids=NODES.keys())
def test_local_node_from_hardware_and_overrides(case: tuple[NodeOverrides, float, int, dict[str, int]]) -> None:
    overrides, cpu, memory, gpus = case
    node = local_node(HW, overrides, "local")
    assert (node.name, node.region, node.cpu, node.memory, dict(node.gpus)) == ("box", "local", cpu, memory, gpus)


def test_tensora_node_shows_detected_and_offered(tmp_path: Path) -> None:
    config = tmp_path / "up.yaml"
    config.write_text("node: {cpu: 3, memory: 6Gi, reserve_cpu: 0.5, reserve_memory: 1Gi}\n")
    out = subprocess.run([sys.executable, "-m", "tensora.cli", "node", "--config", str(config), "-o", "json"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout)
    assert info["detected"]["cpu"] == detect(CATALOG).cpu
    assert (info["node"]["cpu"], info["node"]["memory"]) == (2.5, 5 * GIB)


def test_tensora_node_names_a_bad_override(tmp_path: Path) -> None:
    config = tmp_path / "up.yaml"
    config.write_text("node: {cpus: 3}\n")
    out = subprocess.run([sys.executable, "-m", "tensora.cli", "node", "--config", str(config)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert str(config) in out.stderr and "node.cpus" in out.stderr and "unknown setting" in out.stderr
