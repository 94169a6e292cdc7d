"""``tensora up``'s running quotas from its one node (``quotas.for_node``): half the node, at least its smallest
class of each kind, never what the config set itself. A table of named nodes over the default catalog."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from tensora.config.catalog import default_catalog
from tensora.config.quotas import Quotas, for_node, running_phrase
from tensora.placement.capacity import CORES_LABEL, Node
from tensora.units import GIB

CATALOG = default_catalog()


def node(cpu: float, memory_gib: float = 64, gpus: dict[str, int] | None = None, cores: float | None = None) -> Node:
    labels = {CORES_LABEL: f"{cores:g}"} if cores is not None else {}
    return Node("box", "local", cpu, int(memory_gib * GIB), gpus or {}, labels)


@dataclass(frozen=True)
class Case:
    node: Node
    want: tuple[float, int]
    config: dict[str, Any] = field(default_factory=dict)


CASES = {
    "2 cores offered as 8 vCPU, no GPU -> half the vCPUs, the GPU quota as it was":
        Case(node(8, 22, cores=2), (4, 2)),
    "3 vCPU -> half (1.5), not the whole": Case(node(3, 22), (1.5, 2)),
    "1 vCPU -> its smallest class (1), more than half": Case(node(1, 22), (1, 2)),
    "a GPU no class fits in memory -> no GPUs to run": Case(node(32, 32, {"H200": 1}), (16, 0)),
    "one L40S -> that GPU (half rounds down to 0, one class's worth is 1)": Case(node(32, 256, {"L40S": 1}),
                                                                              (16, 1)),
    "eight H100 -> four, 64 vCPU (not the fixed 2 and 32)": Case(node(128, 2048, {"H100": 8}), (64, 4)),
    "the config's running_cpu is kept": Case(node(8, 22, cores=2), (6, 2), {"running_cpu": 6}),
    "the config's running_gpus is kept": Case(node(32, 256, {"L40S": 1}), (16, 0), {"running_gpus": 0}),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_for_node(case: Case) -> None:
    q = for_node(Quotas(**case.config), case.node, CATALOG)
    assert (q.running_cpu, q.running_gpus) == case.want
    assert q.keys == Quotas().keys and q.workloads == Quotas().workloads  # nothing else moves


def test_the_banner_phrase() -> None:
    assert running_phrase(Quotas(running_cpu=4, running_gpus=0)) == "each owner may run 4 vCPU and 0 GPUs at once"
    assert running_phrase(Quotas(running_cpu=16, running_gpus=1)) == "each owner may run 16 vCPU and 1 GPU at once"
    assert running_phrase(Quotas(running_cpu=4, running_gpus=2), node_has_gpus=False) == (
        "each owner may run 4 vCPU at once")
