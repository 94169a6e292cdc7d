"""Typed rows: what the control plane reads of workloads, replicas, events, nodes, owners and usage.

Immutable values rather than the mapped classes of ``models``: the store speaks SQLAlchemy Core on
a Connection (no Session, no identity map, no lazy loads), a cycle reads hundreds of rows and keeps
none, and a value can be handed to a pure step (snapshot, apply) and compared in a test. A step that
changes a row makes a new one (``_replace``); the store is written by its own statements, never by
mutating a row. The rows a cycle reads by the hundred (workloads, replicas, held replicas) are
``NamedTuple``s, built straight from the result's tuple, the cheapest record to make; the others are frozen
dataclasses. Rows a pure step reads live here; those only the API reads live beside their queries.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, TypedDict

from tensora.placement.capacity import PODS_LABEL, Node
from tensora.placement.kinds import ReplicaRole, ReplicaState, SlotRef, WorkloadKind, WorkloadState

COALESCE_WITHIN = 8
"""An event coalesces with an identical one among its workload's last this many: a crash loop's attempt is
a few events (placed, running, failed), each repeating the attempt before's."""


Spec = Mapping[str, Any]
"""A workload's kind-specific ``spec``, a JSON object as submitted (``tensora.control.spec`` checks it)."""


class WorkloadRow(NamedTuple):
    """A workload as a cycle reads it: every column but ``name``, ``model``, ``restart_reason`` and
    ``spec`` (up to 16 KiB; read only for the workloads that start, ``store.workloads.workload_specs``)."""

    id: str
    owner: str
    kind: WorkloadKind
    region: str
    gpu_class: str
    requested_class: str
    placed_class: str | None
    fallback: tuple[str, ...]
    fallback_after_s: float
    placement: str
    state: WorkloadState
    reason: str
    fallback_eligible_at: float | None
    restart_available: bool
    replicas: int
    model_params: int | None
    model_bytes: int | None
    created_at: float
    updated_at: float
    queued_since: float | None = None
    deleted_at: float | None = None
    released_at: float | None = None
    failures: int = 0
    last_failure: str = ""
    retry_at: float | None = None

    @classmethod
    def of(cls, row: Sequence[Any]) -> WorkloadRow:
        """From the columns in field order (``WORKLOAD_COLUMNS``), as the store selects them."""
        i, owner, kind, region, gpu, requested, placed, fallback, after, placement, state, *rest = row
        return cls(i, owner, _KIND[kind], region, gpu, requested, placed, tuple(fallback or ()), after, placement,
                   _WSTATE[state], *rest)


class WorkloadChanges(TypedDict, total=False):
    """Columns of a workload that change after its creation, any subset: what an update sets."""

    state: WorkloadState
    reason: str
    placement: str
    placed_class: str | None
    queued_since: float | None
    updated_at: float
    restart_available: bool
    restart_reason: str
    fallback_eligible_at: float | None
    failures: int
    last_failure: str
    retry_at: float | None
    deleted_at: float | None


class WorkloadRecord(NamedTuple):
    """A whole workload row, as the API reads and shows one (a page at a time): ``WorkloadRow``'s fields,
    then what a cycle leaves unread (``name``, ``model``, ``restart_reason``, ``spec``)."""

    id: str
    owner: str
    kind: WorkloadKind
    region: str
    gpu_class: str
    requested_class: str
    placed_class: str | None
    fallback: tuple[str, ...]
    fallback_after_s: float
    placement: str
    state: WorkloadState
    reason: str
    fallback_eligible_at: float | None
    restart_available: bool
    replicas: int
    model_params: int | None
    model_bytes: int | None
    created_at: float
    updated_at: float
    queued_since: float | None
    deleted_at: float | None
    released_at: float | None
    failures: int
    last_failure: str
    retry_at: float | None
    name: str
    model: str | None
    restart_reason: str
    spec: Spec

    @classmethod
    def of(cls, row: Sequence[Any]) -> WorkloadRecord:
        """From the columns in field order (``WORKLOAD_RECORD_COLUMNS``), as the store selects them."""
        i, owner, kind, region, gpu, requested, placed, fallback, after, placement, state, *rest = row
        return cls(i, owner, _KIND[kind], region, gpu, requested, placed, tuple(fallback or ()), after, placement,
                   _WSTATE[state], *rest)


class ReplicaRow(NamedTuple):
    id: str
    workload_id: str
    slot: int
    cls: str
    node: str
    region: str
    state: ReplicaState
    role: ReplicaRole
    created_at: float
    updated_at: float
    url: str | None = None
    detail: str = ""
    served_model: str | None = None

    @property
    def ref(self) -> SlotRef:
        return SlotRef(self.workload_id, self.slot)

    @classmethod
    def of(cls, row: Sequence[Any]) -> ReplicaRow:
        """From the columns in field order (``REPLICA_COLUMNS``), as the store selects them."""
        i, wid, slot, cls_, node, region, state, role, *rest = row
        return cls(i, wid, slot, cls_, node, region, _RSTATE[state], _ROLE[role], *rest)

    @classmethod
    def of_mapping(cls, m: Mapping[str, Any]) -> ReplicaRow:
        return cls.of([m[k] for k in REPLICA_COLUMNS])


@dataclass(frozen=True, slots=True)
class EventRow:
    """One event of a workload; ``id`` is None until the store numbered it."""

    workload_id: str
    at: float
    type: str
    reason: str
    from_state: WorkloadState | None = None
    to_state: WorkloadState | None = None
    id: int | None = None
    count: int = 1
    """Times it happened in a row, identically; the last at ``last_at``."""
    last_at: float | None = None

    @classmethod
    def of(cls, m: Mapping[Any, Any]) -> EventRow:
        return cls(m["workload_id"], m["at"], m["type"], m["reason"], _state(m["from_state"]), _state(m["to_state"]),
                   m["id"], m.get("count") or 1, m.get("last_at"))


@dataclass(frozen=True, slots=True)
class NodeRow:
    """A node as the region's controller last observed it."""

    name: str
    region: str
    cpu: float
    memory: int
    gpus: dict[str, int] = field(default_factory=dict)
    labels: dict[str, str] = field(default_factory=dict)
    schedulable: bool = True
    updated_at: float = 0.0

    @classmethod
    def of_node(cls, n: Node) -> NodeRow:
        """``n`` as stored: its pod limit, where it has one, in its labels (``tensora.io/pods``), so the nodes
        table keeps its columns (as a node's cores do)."""
        labels = dict(n.labels) if n.pods is None else {**n.labels, PODS_LABEL: str(n.pods)}
        return cls(n.name, n.region, n.cpu, n.memory, dict(n.gpus), labels, n.schedulable)

    def node(self) -> Node:
        labels = dict(self.labels)
        raw = labels.pop(PODS_LABEL, None)
        pods = int(raw) if raw is not None and raw.isdigit() else None
        return Node(self.name, self.region, self.cpu, self.memory, dict(self.gpus), labels, self.schedulable, pods)


@dataclass(frozen=True, slots=True)
class SessionRow:
    """A dashboard session (``dashboard_sessions``): ``id`` is the SHA-256 of the id the browser holds."""

    id: str
    key_id: str
    owner: str
    created_at: float
    expires_at: float
    last_seen_at: float
    revoked_at: float | None = None

    def live(self, now: float, idle_s: float) -> bool:
        """Not signed out, within its lifetime, and used within the idle timeout."""
        return self.revoked_at is None and now < self.expires_at and now < self.last_seen_at + idle_s


Overrides = Mapping[str, Any]
"""An admin's partial overrides of an owner's quotas or gateway limits, a JSON object as stored
(``tensora.placement.quotas.effective`` lays it over the defaults)."""


@dataclass(frozen=True, slots=True)
class OwnerRow:
    """What the operator said of an owner (``owners``, but the controller's change stamp)."""

    owner: str
    trusted: bool
    updated_at: float
    quotas: Overrides | None = None
    limits: Overrides | None = None


@dataclass(frozen=True, slots=True)
class SegmentRow:
    """Time a replica held ``placed_class`` (``usage_segments``): open while ``ended_at`` is None."""

    id: int
    workload_id: str
    replica_id: str
    owner: str
    region: str
    kind: str
    placed_class: str
    started_at: float
    ended_at: float | None


class HeldReplica(NamedTuple):
    """A replica that holds capacity, with its workload's owner (running quotas)."""

    owner: str
    workload_id: str
    slot: int
    cls: str


def _state(v: str | None) -> WorkloadState | None:
    return None if v is None else WorkloadState(v)


WORKLOAD_COLUMNS = WorkloadRow._fields
WORKLOAD_RECORD_COLUMNS = WorkloadRecord._fields
REPLICA_COLUMNS = ReplicaRow._fields
NODE_COLUMNS = ("name", "region", "cpu", "memory", "gpus", "labels", "schedulable", "updated_at")
_KIND = {k.value: k for k in WorkloadKind}  # a dict lookup rather than Enum(value): once per row read
_WSTATE = {s.value: s for s in WorkloadState}
_RSTATE = {s.value: s for s in ReplicaState}
_ROLE = {r.value: r for r in ReplicaRole}
