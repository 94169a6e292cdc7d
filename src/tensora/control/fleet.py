"""The simulated fleet: ``nodes.yaml`` + ``workloads.yaml`` -> who gets placed where, when, and why.

``tensora plan`` is capacity planning without hardware: it replays the workloads'
submissions and stops against the nodes, on a fake clock, with the controller's own
steps (reconcile, snapshot, admission, apply) over rows in memory, and reports each
workload's state at ``--at``.

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
from tensora.control import snapshot
from tensora.control.apply import apply
from tensora.control.ledger import MemoryLedger
from tensora.control.reconcile import reconcile
from tensora.control.spec import WorkloadSpec, check_against
from tensora.drivers.base import ReplicaSpec
from tensora.drivers.simulated import SimulatedDriver
from tensora.errors import FleetError, ModelFileError
from tensora.models.validator import read_model
from tensora.placement.admission import Policy, decide
from tensora.placement.capacity import Node
from tensora.placement.catalog import Catalog
from tensora.placement.kinds import ReplicaRole, ReplicaState, WorkloadState
from tensora.store.rows import ReplicaRow, WorkloadRow
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


MAX_CYCLES_PER_MOMENT = 32
"""Cycles replayed at one moment until nothing changes (a placement, its replica ready, a move back's
candidate ready, a replica freed for another): a bound, never reached by a plan that settles."""


def plan(
    nodes: Sequence[Node], workloads: Sequence[PlannedWorkload], catalog: Catalog, at: float,
    policy: Policy | None = None,
) -> list[PlanRow]:
    """Replay ``workloads`` on ``nodes`` up to offset ``at`` and report each one's state then.

    Time 0 is the start of the plan; clock times in reasons read as offsets (00:10:00 = 10m).
    """
    replayed = replay(nodes, workloads, catalog, at, policy)
    ledger, offers = replayed.ledger, replayed.offers
    rows = []
    for pw in workloads:
        spec, w = pw.spec, ledger.workloads.get(pw.spec.name)
        if w is None:
            rows.append(PlanRow(spec.name, spec.kind.value, spec.gpu_class, None, "not submitted",
                                f"submitted at {format_duration(pw.submitted_at)}", None))
            continue
        reason = w.reason or f"submitted at {format_duration(pw.submitted_at)}"
        if w.id in offers:
            reason = f"{reason}; {offers[w.id]}"
        queued = w.state is WorkloadState.QUEUED
        eligible = format_duration(w.fallback_eligible_at) if w.fallback_eligible_at is not None and queued else None
        primary = [r for r in ledger.replicas.values()
                   if r.workload_id == w.id and r.slot == 0 and r.role is ReplicaRole.PRIMARY]
        node = primary[-1].node if primary and w.placed_class is not None else None
        rows.append(PlanRow(spec.name, spec.kind.value, spec.gpu_class, w.placed_class, w.state.value, reason,
                            eligible, node, w.id in offers))
    return rows


@dataclass(frozen=True, slots=True)
class Replayed:
    ledger: MemoryLedger
    """The rows after the replay: workloads by name, every replica, every event."""
    offers: dict[str, str]
    """The restart offers admission made in the last cycle (workload -> reason): what the plan reports."""


def replay(
    nodes: Sequence[Node], workloads: Sequence[PlannedWorkload], catalog: Catalog, at: float,
    policy: Policy | None = None,
) -> Replayed:
    """The state after replaying up to offset ``at``.

    Each cycle is the controller's (``control.reconcile``, ``control.snapshot``, admission,
    ``control.apply``) on a simulated fleet and clock, with the rows in memory: a move back starts a
    candidate, which becomes the primary when ready while the old replica drains, as it does live.
    """
    clock = FakeClock(0.0)
    driver = SimulatedDriver(nodes, clock)
    ledger = MemoryLedger()
    moments = {0.0, at} | {pw.submitted_at for pw in workloads} | {
        pw.stop_at for pw in workloads if pw.stop_at is not None
    }
    moments = {m for m in moments if m <= at}
    done: set[float] = set()
    models = {pw.spec.name: pw.spec.model for pw in workloads}
    offers: dict[str, str] = {}
    while moments - done:
        now = min(moments - done)
        done.add(now)
        clock.set(now)
        for pw in workloads:
            w = ledger.workloads.get(pw.spec.name)
            if w is None and pw.submitted_at <= now:
                w = ledger.workloads[pw.spec.name] = _submitted(pw)
            if w is not None and pw.stop_at is not None and pw.stop_at <= now and w.state not in _STOPPED:
                _stop(ledger, driver, w, now, f"stopped at {format_duration(pw.stop_at)}")
        for _ in range(MAX_CYCLES_PER_MOMENT):
            later, changed, offers = _cycle(driver, ledger, catalog, models, now, policy)
            moments.update(m for m in later if m <= at)
            if not changed:
                break
    return Replayed(ledger, offers)


_STOPPED = (WorkloadState.STOPPING, WorkloadState.STOPPED)


def _submitted(pw: PlannedWorkload) -> WorkloadRow:
    """The row ``POST /v1/workloads`` would make, queued at ``submitted_at`` (one replica: the plan has
    always counted one per workload)."""
    s, t = pw.spec, pw.submitted_at
    return WorkloadRow(s.name, s.owner, s.kind, s.region, s.gpu_class, s.gpu_class, None, tuple(s.fallback),
                       s.fallback_after_s, "policy", WorkloadState.QUEUED, "", None, False, 1, s.model_params,
                       s.model_bytes, t, t, queued_since=t)


def _stop(ledger: MemoryLedger, driver: SimulatedDriver, w: WorkloadRow, now: float, reason: str) -> None:
    """What ``POST .../stop`` records (the workload and its replicas ``stopping``), and the simulated
    replicas stopped at once: the next reconcile sees them gone and frees their capacity."""
    ledger.update_workload(w.id, {"state": WorkloadState.STOPPING, "updated_at": now, "restart_available": False,
                                  "reason": reason})
    for r in ledger.active():
        if r.workload_id == w.id:
            ledger.update_replica(r.id, {"state": ReplicaState.STOPPING, "updated_at": now})
            driver.stop(r.id)


def _cycle(driver: SimulatedDriver, ledger: MemoryLedger, catalog: Catalog, models: dict[str, str | None],
           now: float, policy: Policy | None) -> tuple[list[float], bool, dict[str, str]]:
    """One controller cycle on the simulated fleet: moments worth revisiting, whether anything moved, and
    the restart offers made."""
    # observe and reconcile
    observed = {s.id: s for s in driver.observe()}
    replicas = ledger.active()
    held = {r.workload_id for r in replicas}
    asked = [w for w in ledger.workloads.values() if w.id in held or w.state is WorkloadState.STOPPING]
    done = reconcile(ledger, asked, replicas, observed, now)
    _effects(driver, models, done.start, done.stop)
    # snapshot, decide (no quotas: the plan has no owners' settings), apply
    snap = snapshot.take(driver.nodes(), ledger.active(),
                         [w for w in ledger.workloads.values() if w.state in snapshot.LIVE], catalog)
    applied = apply(ledger, decide(snap.queue, snap.capacity, snap.running, now, policy), snap.workloads, now,
                    snap.gone)
    _effects(driver, models, applied.start, [])
    changed = bool(done.transitions or done.start or done.stop or applied.start)
    return [*applied.later, *done.drains_end], changed, applied.offers


def _effects(driver: SimulatedDriver, models: dict[str, str | None],
             start: Sequence[tuple[WorkloadRow, ReplicaRow]], stop: Sequence[str]) -> None:
    for w, r in start:
        status = driver.start(ReplicaSpec(r.id, w.id, w.kind, r.cls, r.node, models.get(w.id)))
        assert status.state in (ReplicaState.RUNNING, ReplicaState.STARTING)
    for replica_id in stop:
        driver.stop(replica_id)
