"""Snapshot: the admission inputs of one cycle, from rows the store (or ``tensora plan``) holds.

Capacity is the nodes' allocatable minus every replica that holds capacity; the queue is each
workload slot without a primary; the running list is each slot whose primary runs (with
``moving`` set while a move back's candidate exists). Pure: rows in, values out.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from tensora.placement.admission import OwnerQuotas, Queued, Running, share
from tensora.placement.capacity import Capacity, GpuReserve, Node, Placed
from tensora.placement.catalog import Catalog
from tensora.placement.kinds import ReplicaRole, ReplicaState, SlotRef, WorkloadKind, WorkloadState
from tensora.placement.quotas import Quotas
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
    placed = [Placed(r.node, r.cls, r.workload_id) for r in replicas]
    capacity = Capacity([n for n in nodes if region is None or n.region == region], placed, catalog, reserves)
    rows = {w.id: w for w in workloads}
    by_workload: dict[str, list[ReplicaRow]] = {}
    for r in replicas:
        by_workload.setdefault(r.workload_id, []).append(r)
    queue: list[Queued] = []
    running: list[Running] = []
    gone: list[WorkloadRow] = []
    for w in rows.values():
        records = admission_records(w, by_workload.get(w.id, ()), catalog)
        queue += records.queue
        running += records.running
        if records.gone:
            gone.append(w)
    return Snapshot(capacity, queue, running, rows, gone)


@dataclass(frozen=True, slots=True)
class Records:
    """What admission sees of one workload: its slots queued and running, or that its class is gone."""

    queue: tuple[Queued, ...] = ()
    running: tuple[Running, ...] = ()
    gone: bool = False


def admission_records(w: WorkloadRow, held: Iterable[ReplicaRow], catalog: Catalog) -> Records:
    """``w``'s records as :func:`take` makes them; ``held``: its replicas that hold capacity (take's for the
    whole fleet, ``tensora plan``'s for a workload that changed)."""
    if w.deleted_at is not None:
        return Records()
    if w.state is WorkloadState.QUEUED and w.gpu_class not in catalog:  # the operator removed it
        return Records(gone=True)
    by_slot: dict[int, list[ReplicaRow]] = {}
    for r in held:
        by_slot.setdefault(r.slot, []).append(r)
    fallback = () if w.placement == "requested" else w.fallback
    queue: list[Queued] = []
    running: list[Running] = []
    for slot in range(w.replicas if w.kind is WorkloadKind.ENDPOINT else 1):
        ref = SlotRef(w.id, slot)
        on_slot = by_slot.get(slot, [])
        primary = next((r for r in on_slot if r.role is ReplicaRole.PRIMARY and r.state is not ReplicaState.STOPPING),
                       None)
        if primary is None:
            if w.state is WorkloadState.QUEUED or slot > 0:
                since = w.queued_since if w.queued_since is not None else w.created_at
                queue.append(Queued(str(ref), w.kind, w.gpu_class, w.owner, w.region, fallback,
                                    w.fallback_after_s, since, w.model_params, w.model_bytes, w.retry_at or 0.0))
            continue
        if w.state is WorkloadState.RUNNING and primary.state is ReplicaState.RUNNING:
            moving = any(r.role is ReplicaRole.CANDIDATE for r in on_slot)
            running.append(Running(str(ref), w.kind, w.gpu_class, primary.cls, primary.node, w.owner, w.region,
                                   w.fallback, w.model_params, w.model_bytes, moving))
    return Records(tuple(queue), tuple(running))


def owner_quotas(defaults: Quotas, stored: Mapping[str, Mapping[str, Any]], held: Iterable[HeldReplica],
                 catalog: Catalog) -> OwnerQuotas:
    """Each owner's running quotas (the admins' ``stored`` overrides over the server's ``defaults``) and what
    its replicas hold now in every region, starting and stopping ones too: per replica slot, the largest of
    its replicas (a move back or a restart replaces one; while both exist, the larger counts, so no sequence
    of moves or restarts holds more than one replica's worth per slot against the quota)."""
    by_owner: dict[str, Quotas] = {}
    for owner, overrides in stored.items():
        try:  # effective(), validated: a bad row must cost its owner the override, not every owner the cycle
            by_owner[owner] = Quotas.model_validate({**defaults.model_dump(), **dict(overrides)})
        except (TypeError, ValueError) as exc:
            log.warning("owner %r: its stored quotas are not valid, the defaults apply: %s", owner, exc)
    slots: dict[tuple[str, SlotRef], tuple[float, float]] = {}
    for r in held:
        cls = catalog.get(r.cls)
        if cls is None:
            continue
        key = (r.owner, SlotRef(r.workload_id, r.slot))
        was, now = slots.get(key, (0.0, 0.0)), share(cls)
        slots[key] = (max(was[0], now[0]), max(was[1], now[1]))
    total: dict[str, tuple[float, float]] = {}
    for (owner, _), (gpus, cpu) in slots.items():
        t = total.get(owner, (0.0, 0.0))
        total[owner] = (t[0] + gpus, t[1] + cpu)
    return OwnerQuotas(defaults, by_owner, total)
