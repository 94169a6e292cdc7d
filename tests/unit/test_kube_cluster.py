"""Capacity from a Kubernetes cluster: quantities, pod requests and nodes, as tables of named cases."""

from __future__ import annotations

from decimal import Decimal
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tensora.config.catalog import default_catalog
from tensora.drivers.kubernetes.cluster import WHY_LABEL, nodes_from_cluster, parse_quantity, pod_requests

GI = 2**30

QUANTITIES = {
    "whole cores": ("16", Decimal(16)),
    "millicores": ("15500m", Decimal("15.5")),
    "binary memory": ("64Gi", Decimal(64 * GI)),
    "kibibytes": ("65536Ki", Decimal(64 * 2**20)),
    "decimal memory": ("2G", Decimal(2 * 10**9)),
    "exponent": ("1e3", Decimal(1000)),
    "a bare integer": (4, Decimal(4)),
}


@pytest.mark.parametrize(("text", "want"), QUANTITIES.values(), ids=QUANTITIES.keys())
def test_parse_quantity(text: object, want: Decimal) -> None:
    assert parse_quantity(text) == want


@pytest.mark.parametrize("bad", ["", "Gi", "lots", "-1", "1.2.3Mi", "inf"])
def test_bad_quantities_are_named(bad: str) -> None:
    with pytest.raises(ValueError, match="Kubernetes quantity"):
        parse_quantity(bad)


@given(st.integers(0, 2**50))
def test_mebibytes_round_trip(n: int) -> None:
    assert parse_quantity(f"{n}Mi") == n * 2**20


def pod(node: str, *containers: dict[str, str], init: list[dict[str, str]] | None = None, phase: str = "Running",
        labels: dict[str, str] | None = None, overhead: dict[str, str] | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {"nodeName": node, "containers": [{"resources": {"requests": c}} for c in containers]}
    if init:
        spec["initContainers"] = [{"resources": {"requests": c}} for c in init]
    if overhead:
        spec["overhead"] = overhead
    return {"metadata": {"labels": labels or {}}, "spec": spec, "status": {"phase": phase}}


def test_pod_requests_follow_the_scheduler_rule() -> None:
    p = pod("n", {"cpu": "500m", "memory": "1Gi"}, {"cpu": "1"}, init=[{"cpu": "2", "memory": "512Mi"}],
            overhead={"cpu": "100m"})
    assert pod_requests(p) == {"cpu": Decimal("2.1"), "memory": Decimal(GI)}


def node(name: str, cpu: str = "32", memory: str = "256Gi", gpus: int = 0, labels: dict[str, str] | None = None,
         unschedulable: bool = False, taints: list[dict[str, str]] | None = None,
         ready: str = "True") -> dict[str, Any]:
    alloc = {"cpu": cpu, "memory": memory, **({"nvidia.com/gpu": str(gpus)} if gpus else {})}
    return {"metadata": {"name": name, "labels": labels or {}},
            "spec": {"unschedulable": unschedulable, "taints": taints or []},
            "status": {"allocatable": alloc, "conditions": [{"type": "Ready", "status": ready}]}}


L40S_GFD = {"nvidia.com/gpu.product": "NVIDIA-L40S", "nvidia.com/gpu.memory": "46068",
            "topology.kubernetes.io/region": "eu-west"}

CASES: dict[str, tuple[list[dict[str, Any]], list[dict[str, Any]], dict[str, Any]]] = {
    "GPU model from feature discovery, region from topology": (
        [node("g1", gpus=2, labels=L40S_GFD)], [],
        {"region": "eu-west", "gpus": {"L40S": 2}, "cpu": 32.0, "schedulable": True}),
    "GPU model from a tensora.io/class label": (
        [node("g2", gpus=1, labels={"tensora.io/class": "a100-80gb"})], [],
        {"region": "here", "gpus": {"A100-80GB": 1}}),
    "an unknown GPU is offered as none": (
        [node("g3", gpus=1, labels={"nvidia.com/gpu.product": "Tesla-K80", "nvidia.com/gpu.memory": "12206"})], [],
        {"gpus": {}}),
    "other pods' requests are taken off": (
        [node("c1", cpu="16", memory="64Gi", gpus=1, labels=L40S_GFD)],
        [pod("c1", {"cpu": "3500m", "memory": "8Gi", "nvidia.com/gpu": "1"})],
        {"cpu": 12.5, "memory": 56 * GI, "gpus": {}}),
    "finished pods and Tensora's replica pods are not": (
        [node("c2", cpu="16")],
        [pod("c2", {"cpu": "4"}, phase="Succeeded"), pod("c2", {"cpu": "4"}, labels={"tensora.io/replica": "r1"})],
        {"cpu": 16.0}),
    "a cordoned node offers nothing": ([node("c3", unschedulable=True)], [], {"schedulable": False, "why": "cordoned"}),
    "a node that is not Ready offers nothing": ([node("c4", ready="False")], [], {"schedulable": False,
                                                                                 "why": "not Ready"}),
    "a foreign NoSchedule taint": (
        [node("c5", taints=[{"key": "team", "value": "ml", "effect": "NoSchedule"}])], [],
        {"schedulable": False, "why": "tainted team=ml:NoSchedule"}),
    "the GPU taint is tolerated": (
        [node("g4", gpus=1, labels=L40S_GFD, taints=[{"key": "nvidia.com/gpu", "effect": "NoSchedule"}])], [],
        {"schedulable": True, "gpus": {"L40S": 1}}),
    "a PreferNoSchedule taint does not count": (
        [node("c6", taints=[{"key": "team", "effect": "PreferNoSchedule"}])], [], {"schedulable": True}),
    "more requested than allocatable never goes negative": (
        [node("c7", cpu="2")], [pod("c7", {"cpu": "3"})], {"cpu": 0.0}),
}


@pytest.mark.parametrize(("nodes", "pods", "want"), CASES.values(), ids=CASES.keys())
def test_nodes_from_cluster(nodes: list[dict[str, Any]], pods: list[dict[str, Any]], want: dict[str, Any]) -> None:
    [got] = nodes_from_cluster(nodes, pods, default_catalog(), "here")
    for key, value in want.items():
        if key == "why":
            assert got.labels[WHY_LABEL] == value
        else:
            assert getattr(got, key) == value, key
    if got.schedulable:
        assert WHY_LABEL not in got.labels
