"""The simulated fleet: ``nodes.yaml`` + ``workloads.yaml`` -> who gets placed where, when, and why.

``tensora plan`` is capacity planning without hardware: it replays the workloads'
submissions and stops against the nodes, on a fake clock, with the same admission
the controller uses, and reports each workload's state at ``--at``.

Formats (other tools drive them; keep them stable):

``nodes.yaml``::

    nodes:
      - {name: gpu-1, region: local, labels: {}, allocatable: {cpu: 32, memory: 256Gi, gpus: {L40S: 1}}}

``workloads.yaml``: the control API's create-workload body, plus ``submitted_at`` and
optional ``stop_at`` (offsets such as ``0s``, ``2m``)::

    workloads:
      - {kind: notebook, name: nb, gpu_class: l40s-48gb, fallback: [cpu], fallback_after: 10m, submitted_at: 0s}
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError

from tensora.clock import FakeClock
from tensora.config import yamlsource
from tensora.control.spec import WorkloadSpec, check_against
from tensora.drivers.base import ReplicaSpec, ReplicaState
from tensora.drivers.simulated import SimulatedDriver
from tensora.errors import FleetError, ModelFileError
from tensora.models.validator import read_model
from tensora.placement.admission import Place, Policy, Promote, Queued, RestartAvailable, Running, Wait, decide
from tensora.placement.capacity import Capacity, Node, Placed
from tensora.placement.catalog import Catalog
from tensora.units import format_duration, parse_duration, parse_memory

Memory = Annotated[int, BeforeValidator(parse_memory)]
Offset = Annotated[float, BeforeValidator(parse_duration)]


class _Allocatable(BaseModel):
    model_config = ConfigDict(extra="forbid")
    cpu: float = Field(ge=0)
    memory: Memory = Field(ge=0)
    gpus: dict[str, Annotated[int, Field(ge=0)]] = Field(default_factory=dict)


class _NodeSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(min_length=1, max_length=253)
    region: str = "local"
    labels: dict[str, str] = Field(default_factory=dict)
    allocatable: _Allocatable
    schedulable: bool = True


class _NodesFile(BaseModel):
    model_config = ConfigDict(extra="forbid")
    nodes: list[_NodeSpec]


class _PlannedWorkload(WorkloadSpec):
    submitted_at: Offset = 0.0
    stop_at: Offset | None = None


class _WorkloadsFile(BaseModel):
    model_config = ConfigDict(extra="forbid")
    workloads: list[_PlannedWorkload]


def _load(path: Path, model: type[BaseModel], key: str) -> tuple[Any, yamlsource.Lines]:
    data, lines = yamlsource.load(path, FleetError)
    if not isinstance(data, dict):
        raise FleetError(f"expected a mapping with a '{key}' list", source=str(path), line=1)
    try:
        return model.model_validate(data), lines
    except ValidationError as exc:
        raise yamlsource.validation_error(exc, source=str(path), lines=lines, error=FleetError) from None


def load_nodes(path: Path | str) -> list[Node]:
    """Nodes of a ``nodes.yaml``; errors name the file, line and field."""
    path = Path(path)
    parsed, lines = _load(path, _NodesFile, "nodes")
    seen: set[str] = set()
    out = []
    for i, n in enumerate(parsed.nodes):
        if n.name in seen:
            raise FleetError(f"duplicate node name {n.name!r}", source=str(path),
                             line=lines.line(("nodes", i, "name")), field=f"nodes[{i}].name")
        seen.add(n.name)
        a = n.allocatable
        out.append(Node(n.name, n.region, a.cpu, a.memory, dict(a.gpus), dict(n.labels), n.schedulable))
    return out


@dataclass(frozen=True, slots=True)
class PlannedWorkload:
    """A workload of ``workloads.yaml``, checked against the catalog, with its model size read."""

    spec: WorkloadSpec
    submitted_at: float
    stop_at: float | None


def load_workloads(path: Path | str, catalog: Catalog) -> list[PlannedWorkload]:
    """Workloads of a ``workloads.yaml``, validated like create bodies; errors name file, line, field."""
    path = Path(path)
    parsed, lines = _load(path, _WorkloadsFile, "workloads")
    seen: set[str] = set()
    out = []
    for i, w in enumerate(parsed.workloads):
        where = ("workloads", i)
        if w.name in seen:
            raise FleetError(f"duplicate workload name {w.name!r}", source=str(path),
                             line=lines.line((*where, "name")), field=f"workloads[{i}].name")
        seen.add(w.name)
        for field, message in check_against(w, catalog):
            key = field.split("[")[0]
            raise FleetError(message, source=str(path), line=lines.line((*where, key)), field=f"workloads[{i}].{field}")
        if w.stop_at is not None and w.stop_at < w.submitted_at:
            raise FleetError("stop_at is before submitted_at", source=str(path),
                             line=lines.line((*where, "stop_at")), field=f"workloads[{i}].stop_at")
        spec = WorkloadSpec.model_validate(w.model_dump(exclude={"submitted_at", "stop_at"}))
        if spec.model is not None and spec.model_params is None:
            model_path = (path.parent / spec.model) if not Path(spec.model).is_absolute() else Path(spec.model)
            try:
                size = read_model(model_path)
            except ModelFileError as exc:
                raise FleetError(str(exc), source=str(path), line=lines.line((*where, "model")),
                                 field=f"workloads[{i}].model") from None
            spec = spec.model_copy(update={"model_params": size.params, "model_bytes": size.bytes})
        out.append(PlannedWorkload(spec, w.submitted_at, w.stop_at))
    return out


@dataclass(frozen=True, slots=True)
class PlanRow:
    """One workload at the reported moment (the ``-o json`` shape, plus ``restart_available``)."""

    name: str
    kind: str
    requested_class: str
    placed_class: str | None
    state: str
    reason: str
    fallback_eligible_at: str | None
    node: str | None = None
    restart_available: bool = False

    def as_json(self) -> dict[str, Any]:
        return {
            "name": self.name, "kind": self.kind, "requested_class": self.requested_class,
            "placed_class": self.placed_class, "state": self.state, "reason": self.reason,
            "fallback_eligible_at": self.fallback_eligible_at, "node": self.node,
            "restart_available": self.restart_available,
        }


@dataclass(slots=True)
class _Tracked:
    w: PlannedWorkload
    state: str = "not submitted"
    placed_class: str | None = None
    node: str | None = None
    replica: str | None = None
    reason: str = ""
    eligible_at: float | None = None
    restart_available: bool = False
    restart_reason: str = ""
    generation: int = 0


def plan(
    nodes: Sequence[Node], workloads: Sequence[PlannedWorkload], catalog: Catalog, at: float,
    policy: Policy | None = None,
) -> list[PlanRow]:
    """Replay ``workloads`` on ``nodes`` up to offset ``at`` and report each one's state then.

    Time 0 is the start of the plan; clock times in reasons read as offsets (00:10:00 = 10m).
    """
    clock = FakeClock(0.0)
    driver = SimulatedDriver(nodes, clock)
    tracked = {pw.spec.name: _Tracked(pw) for pw in workloads}
    moments = {0.0, at} | {pw.submitted_at for pw in workloads} | {
        pw.stop_at for pw in workloads if pw.stop_at is not None
    }
    moments = {m for m in moments if m <= at}
    done: set[float] = set()
    while moments - done:
        now = min(moments - done)
        done.add(now)
        clock.set(now)
        for t in tracked.values():
            w = t.w
            if w.stop_at is not None and w.stop_at <= now and t.state != "stopped" and w.submitted_at <= now:
                if t.replica:
                    driver.stop(t.replica)
                t.state, t.reason, t.restart_available = "stopped", f"stopped at {format_duration(w.stop_at)}", False
            elif t.state == "not submitted" and w.submitted_at <= now:
                t.state = "queued"
        for _ in range(8):  # a move frees capacity others may use at the same moment
            later, changed = _cycle(driver, tracked, catalog, now, policy)
            moments.update(m for m in later if m <= at)
            if not changed:
                break
    rows = []
    for t in tracked.values():
        w = t.w
        reason = t.reason or f"submitted at {format_duration(w.submitted_at)}"
        if t.restart_available:
            reason = f"{reason}; {t.restart_reason}"
        eligible = format_duration(t.eligible_at) if t.eligible_at is not None and t.state == "queued" else None
        rows.append(PlanRow(w.spec.name, w.spec.kind.value, w.spec.gpu_class, t.placed_class, t.state, reason,
                            eligible, t.node, t.restart_available))
    return rows


def _cycle(
    driver: SimulatedDriver, tracked: dict[str, _Tracked], catalog: Catalog, now: float, policy: Policy | None
) -> tuple[list[float], bool]:
    """One controller cycle on the simulated fleet: moments worth revisiting, and whether anything moved."""
    # 1. observe
    statuses = [s for s in driver.observe() if s.holds_capacity]
    # 2. capacity
    capacity = Capacity(driver.nodes(), [Placed(s.node, s.cls, s.workload_id) for s in statuses], catalog)
    # 3. decide
    queue, running = [], []
    for t in tracked.values():
        s = t.w.spec
        if t.state == "queued":
            queue.append(Queued(s.name, s.kind, s.gpu_class, s.owner, s.region, tuple(s.fallback),
                                s.fallback_after_s, t.w.submitted_at, s.model_params, s.model_bytes))
        elif t.state == "running" and t.placed_class and t.node:
            running.append(Running(s.name, s.kind, s.gpu_class, t.placed_class, t.node, s.owner, s.region,
                                   tuple(s.fallback), s.model_params, s.model_bytes))
        t.restart_available = False
    decisions = decide(queue, capacity, running, now, policy)
    # 4. apply
    later = []
    for d in decisions:
        if isinstance(d, Place):
            t = tracked[d.workload.id]
            t.replica = _start(driver, t, d.cls, d.node)
            t.state, t.placed_class, t.node, t.reason, t.eligible_at = "running", d.cls, d.node, d.reason, None
        elif isinstance(d, Wait):
            t = tracked[d.workload.id]
            t.reason, t.eligible_at = d.reason, d.fallback_eligible_at
            if d.fallback_eligible_at is not None and d.fallback_eligible_at > now:
                later.append(d.fallback_eligible_at)
        elif isinstance(d, Promote):
            # Start the preferred replica, (instantly) ready, shift traffic, stop the fallback one.
            t = tracked[d.workload.id]
            old = t.replica
            t.replica = _start(driver, t, d.to_class, d.node)
            if old:
                driver.stop(old)
            t.placed_class, t.node, t.reason = d.to_class, d.node, d.reason
        elif isinstance(d, RestartAvailable):
            t = tracked[d.workload.id]
            t.restart_available, t.restart_reason = True, d.reason
    return later, any(isinstance(d, Place | Promote) for d in decisions)


def _start(driver: SimulatedDriver, t: _Tracked, cls: str, node: str) -> str:
    t.generation += 1
    replica_id = f"{t.w.spec.name}-{t.generation}"
    status = driver.start(ReplicaSpec(replica_id, t.w.spec.name, t.w.spec.kind, cls, node, t.w.spec.model))
    assert status.state in (ReplicaState.RUNNING, ReplicaState.STARTING)
    return replica_id
