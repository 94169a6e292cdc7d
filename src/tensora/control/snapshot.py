"""Snapshot: the admission inputs of one cycle, from rows the store (or ``tensora plan``) holds.

Capacity is the nodes' allocatable minus every replica that holds capacity; the queue is each
workload slot without a primary; the running list is each slot whose primary runs (with
``moving`` set while a move back's candidate exists). Pure: rows in, values out.

``take`` is the whole of it (a controller's first cycle, ``tensora plan``); ``changes`` is the same for the
workloads that changed, as events for the admission state the controller keeps between cycles. Both ask
``admit`` of each workload, so the two cannot disagree.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from tensora.config.quotas import Quotas
from tensora.placement.admission import OwnerQuotas, Queued, Running, share
from tensora.placement.admission_state import Event, ReplicaPlaced, Started, Stopped, Submitted
from tensora.placement.capacity import Capacity, GpuReserve, Node, Placed
from tensora.placement.catalog import Catalog
from tensora.placement.kinds import ReplicaRole, ReplicaState, SlotRef, WorkloadKind, WorkloadState
from tensora.store.rows import HeldReplica, ReplicaRow, WorkloadRow

log = logging.getLogger("tensora.controller")

LIVE = (WorkloadState.QUEUED, WorkloadState.STARTING, WorkloadState.RUNNING)
"""The workload states admission looks at."""


@dataclass(frozen=True, slots=True)
class Snapshot:
    capacity: Capacity
    queue: list[Queued]
    running: list[Running]
    workloads: dict[str, WorkloadRow]
    """The workloads read, by id (the apply step's rows)."""
    gone: list[WorkloadRow] = field(default_factory=list)
    """Queued workloads whose class is no longer in the catalog: no placement can come, they fail."""


def take(nodes: Sequence[Node], replicas: Iterable[ReplicaRow], workloads: Iterable[WorkloadRow], catalog: Catalog,
         reserves: Mapping[str, GpuReserve] | None = None, region: str | None = None) -> Snapshot:
    """``replicas``: those that hold capacity; ``region``: the controller's (None: every node, for the plan)."""
    replicas = list(replicas)
    capacity = Capacity([n for n in nodes if region is None or n.region == region], placed(replicas), catalog,
                        reserves)
    rows = {w.id: w for w in workloads}
    by_workload = _by_workload(replicas)
    queue: list[Queued] = []
    running: list[Running] = []
    gone: list[WorkloadRow] = []
    for w in rows.values():
        if not admit(w, by_workload.get(w.id, ()), catalog, queue, running):
            gone.append(w)
    return Snapshot(capacity, queue, running, rows, gone)


def placed(replicas: Iterable[ReplicaRow]) -> list[Placed]:
    """The capacity ``replicas`` hold, each under its slot (``AdmissionState`` forgets a slot's on ``Stopped``)."""
    return [Placed(r.node, r.cls, str(r.ref)) for r in replicas]


def _by_workload(replicas: Iterable[ReplicaRow]) -> dict[str, list[ReplicaRow]]:
    out: dict[str, list[ReplicaRow]] = {}
    for r in replicas:
        out.setdefault(r.workload_id, []).append(r)
    return out


def admit(w: WorkloadRow, held: Sequence[ReplicaRow], catalog: Catalog, queue: list[Queued],
          running: list[Running]) -> bool:
    """What admission sees of one workload, given the replicas it holds: its slots without a primary join
    ``queue``, those whose primary runs join ``running``. False: it is queued for a class the operator removed
    from the catalog (no placement can come; it fails). ``take`` and ``changes`` both ask this."""
    if w.deleted_at is not None:
        return True
    if w.state is WorkloadState.QUEUED and w.gpu_class not in catalog:  # the operator removed it
        return False
    if w.state not in LIVE:
        return True
    fallback = () if w.placement == "requested" else w.fallback
    for slot in range(slots(w)):
        ref = SlotRef(w.id, slot)
        mine = [r for r in held if r.slot == slot]
        primary = next((r for r in mine if r.role is ReplicaRole.PRIMARY and r.state is not ReplicaState.STOPPING),
                       None)
        if primary is None:
            if w.state is WorkloadState.QUEUED or slot > 0:
                since = w.queued_since if w.queued_since is not None else w.created_at
                queue.append(Queued(str(ref), w.kind, w.gpu_class, w.owner, w.region, fallback,
                                    w.fallback_after_s, since, w.model_params, w.model_bytes, w.retry_at or 0.0))
            continue
        if w.state is WorkloadState.RUNNING and primary.state is ReplicaState.RUNNING:
            moving = any(r.role is ReplicaRole.CANDIDATE for r in mine)
            running.append(Running(str(ref), w.kind, w.gpu_class, primary.cls, primary.node, w.owner, w.region,
                                   w.fallback, w.model_params, w.model_bytes, moving))
    return True


@dataclass(frozen=True, slots=True)
class Records:
    """What admission sees of one workload: its slots queued and running, or that its class is gone."""

    queue: tuple[Queued, ...] = ()
    running: tuple[Running, ...] = ()
    gone: bool = False


def admission_records(w: WorkloadRow, held: Iterable[ReplicaRow], catalog: Catalog) -> Records:
    """:func:`admit` as a value (``tensora plan`` compares a changed workload's records with those it told)."""
    queue: list[Queued] = []
    running: list[Running] = []
    kept = admit(w, list(held), catalog, queue, running)
    return Records(tuple(queue), tuple(running), gone=not kept)


def slots(w: WorkloadRow) -> int:
    """How many replica slots the workload has (an endpoint's ``replicas``; one for notebooks and VMs)."""
    return w.replicas if w.kind is WorkloadKind.ENDPOINT else 1


@dataclass(frozen=True, slots=True)
class Changes:
    events: list[Event]
    gone: list[WorkloadRow]
    """As ``Snapshot.gone``: changed workloads queued for a class no longer in the catalog."""


def changes(workloads: Iterable[WorkloadRow], replicas: Iterable[ReplicaRow], catalog: Catalog) -> Changes:
    """What ``AdmissionState`` must be told of workloads that changed, given the replicas they hold now (those
    that hold capacity): each of their slots stopped, then their replicas placed, then their queued and running
    records as ``take`` would list them. Saying all of it again is always right, whatever changed (a state that
    assumed a placement learns the store's truth), and it comes from the same ``admit`` as the snapshot's."""
    by_workload = _by_workload(replicas)
    events: list[Event] = []
    gone: list[WorkloadRow] = []
    for w in workloads:
        held = by_workload.get(w.id, ())
        queue: list[Queued] = []
        running: list[Running] = []
        if not admit(w, held, catalog, queue, running):
            gone.append(w)
        refs = {str(SlotRef(w.id, slot)) for slot in range(slots(w))} | {str(r.ref) for r in held}
        events += [Stopped(ref) for ref in sorted(refs)]
        events += [ReplicaPlaced(p) for p in placed(held)]
        events += [Submitted(q) for q in queue]
        events += [Started(r) for r in running]
    return Changes(events, gone)


def owner_quotas(defaults: Quotas, stored: Mapping[str, Mapping[str, Any]], held: Iterable[HeldReplica],
                 catalog: Catalog) -> OwnerQuotas:
    """Each owner's running quotas (``quotas_by_owner``) and what its replicas hold now (``held_by_owner``)."""
    return running_quotas(defaults, quotas_by_owner(defaults, stored), held_by_owner(held, catalog))


def running_quotas(defaults: Quotas, by_owner: Mapping[str, Quotas],
                   held: Mapping[str, tuple[float, float]] | None = None) -> OwnerQuotas:
    """The validated quotas as admission reads them: each owner's running ones, as plain values."""
    return OwnerQuotas(defaults.running(), {o: q.running() for o, q in by_owner.items()}, held)


def quotas_by_owner(defaults: Quotas, stored: Mapping[str, Mapping[str, Any]]) -> dict[str, Quotas]:
    """The admins' ``stored`` overrides over the server's ``defaults``, for the owners that have some."""
    by_owner: dict[str, Quotas] = {}
    for owner, overrides in stored.items():
        try:  # effective(), validated: a bad row must cost its owner the override, not every owner the cycle
            by_owner[owner] = Quotas.model_validate({**defaults.model_dump(), **dict(overrides)})
        except (TypeError, ValueError) as exc:
            log.warning("owner %r: its stored quotas are not valid, the defaults apply: %s", owner, exc)
    return by_owner


def held_by_owner(held: Iterable[HeldReplica], catalog: Catalog) -> dict[str, tuple[float, float]]:
    """What each owner's replicas hold now in every region, starting and stopping ones too: per replica slot,
    the largest of its replicas (a move back or a restart replaces one; while both exist, the larger counts,
    so no sequence of moves or restarts holds more than one replica's worth per slot against the quota)."""
    per_slot: dict[tuple[str, SlotRef], tuple[float, float]] = {}
    for r in held:
        cls = catalog.get(r.cls)
        if cls is None:
            continue
        key = (r.owner, SlotRef(r.workload_id, r.slot))
        was, now = per_slot.get(key, (0.0, 0.0)), share(cls)
        per_slot[key] = (max(was[0], now[0]), max(was[1], now[1]))
    total: dict[str, tuple[float, float]] = {}
    for (owner, _), (gpus, cpu) in per_slot.items():
        t = total.get(owner, (0.0, 0.0))
        total[owner] = (t[0] + gpus, t[1] + cpu)
    return total
