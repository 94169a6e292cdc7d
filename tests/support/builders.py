"""Builders for domain objects, so each test says only what matters to it."""

from __future__ import annotations

from collections.abc import Iterable

from tensora.config.catalog import default_catalog
from tensora.placement.admission import Place, Promote, Queued, RestartAvailable, Running, Wait
from tensora.placement.capacity import CORES_LABEL, Capacity, Node, Placed
from tensora.placement.catalog import Catalog
from tensora.placement.kinds import WorkloadKind

GI = 2**30
CATALOG = default_catalog()


def gpu_node(name: str, model: str = "L40S", count: int = 1, cpu: float = 32, mem_gi: int = 256) -> Node:
    return Node(name, "local", cpu, mem_gi * GI, {model: count})


def cpu_node(name: str, cpu: float = 64, mem_gi: int = 256) -> Node:
    return Node(name, "local", cpu, mem_gi * GI)


def cores_node(name: str, cpu: float, cores: float, mem_gi: int) -> Node:
    """A node whose ``cpu`` vCPUs share fewer ``cores`` (the local profile's overcommit)."""
    return Node(name, "local", cpu, mem_gi * GI, labels={CORES_LABEL: f"{cores:g}"})


def cap(nodes: Iterable[Node], placed: Iterable[Placed] = (), catalog: Catalog = CATALOG) -> Capacity:
    return Capacity(list(nodes), list(placed), catalog)


def w(
    id: str, cls: str = "l40s-48gb", *, fallback: tuple[str, ...] = (), after: float = 0, since: float = 0,
    kind: WorkloadKind = WorkloadKind.NOTEBOOK, owner: str | None = None, params: float | None = None,
    region: str = "local",
) -> Queued:
    p = int(params) if params is not None else None
    return Queued(id, kind, cls, owner or id, region, fallback, after, since, p, p * 2 if p else None)


def ep(id: str, cls: str = "l40s-48gb", **kw: object) -> Queued:
    return w(id, cls, kind=WorkloadKind.ENDPOINT, **kw)  # type: ignore[arg-type]


def running(
    id: str, placed: str, node: str, cls: str = "l40s-48gb", *, fallback: tuple[str, ...] = ("cpu",),
    kind: WorkloadKind = WorkloadKind.ENDPOINT, moving: bool = False,
) -> Running:
    return Running(id, kind, cls, placed, node, id, "local", fallback, None, None, moving)


def outcomes(decisions: Iterable[object]) -> tuple[dict[str, str], dict[str, str]]:
    """What ``decide`` said, as table tests compare it: (workload -> placed class or "wait", workload ->
    the class it moves to, or "restart:<class>" for a restart offered)."""
    got: dict[str, str] = {}
    moves: dict[str, str] = {}
    for d in decisions:
        if isinstance(d, Place):
            got[d.workload.id] = d.cls
        elif isinstance(d, Wait):
            got[d.workload.id] = "wait"
        elif isinstance(d, Promote):
            moves[d.workload.id] = d.to_class
        elif isinstance(d, RestartAvailable):
            moves[d.workload.id] = f"restart:{d.to_class}"
    return got, moves
