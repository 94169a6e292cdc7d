"""Apply: record admission's decisions (the controller's, and ``tensora plan``'s on a simulated clock).

Each write is conditional on the state the snapshot saw: a workload stopped or deleted meanwhile
is left alone, and a workload moves ``queued -> starting`` only once, so none is placed twice.
The replicas recorded here are started by the driver after the transaction commits.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from tensora.control.events import EventType, FailedForGood, ReplicaPlaced, render
from tensora.control.ledger import Ledger, new_replica, transition
from tensora.placement.admission import Decision, Place, Promote, RestartAvailable, Wait
from tensora.placement.kinds import ReplicaRole, SlotRef, WorkloadState
from tensora.store.rows import EventRow, ReplicaRow, WorkloadRow


@dataclass
class Applied:
    placed: int = 0
    waiting: int = 0
    promoted: int = 0
    start: list[tuple[WorkloadRow, ReplicaRow]] = field(default_factory=list)
    """Replicas recorded ``starting``, for the driver."""
    later: list[float] = field(default_factory=list)
    """Fallback timers still to run out (moments ``tensora plan`` revisits)."""
    offers: dict[str, str] = field(default_factory=dict)
    """This cycle's restart offers (workload id -> reason). The store keeps the first offer's reason until
    it is withdrawn; ``tensora plan`` shows the current one."""


def apply(ledger: Ledger, decisions: Sequence[Decision], workloads: Mapping[str, WorkloadRow],
          now: float, gone: Sequence[WorkloadRow] = ()) -> Applied:
    """Record ``decisions`` over the snapshot's ``workloads`` (by id); fail the ``gone`` (their class left
    the catalog: waiting cannot place them)."""
    out = Applied()
    for w in gone:
        why = render(FailedForGood(f"{w.gpu_class} is no longer in the catalog"))
        transition(ledger, w, WorkloadState.QUEUED, WorkloadState.FAILED, why, now)
    rows = dict(workloads)  # as changed by this step's transitions
    restart: dict[str, RestartAvailable] = {}
    events: list[EventRow] = []
    waits: list[tuple[str, str, float | None]] = []
    for d in decisions:
        ref = SlotRef.parse(d.workload.id)
        w = rows[ref.workload_id]
        if isinstance(d, Place):
            if ref.slot == 0:
                reason = d.reason  # (rendered when read: once)
                placed = transition(ledger, w, WorkloadState.QUEUED, WorkloadState.STARTING, reason, now,
                                    {"placed_class": d.cls, "reason": reason, "fallback_eligible_at": None})
                if placed is None:
                    continue  # someone else moved it meanwhile: never place twice
                w = rows[w.id] = placed
            elif not _still(ledger, w, now):
                continue
            r = new_replica(ledger, w, ref.slot, d.cls, d.node, ReplicaRole.PRIMARY, now)
            if ref.slot > 0:
                placed_event = EventRow(w.id, now, EventType.REPLICA_PLACED, render(ReplicaPlaced(ref.slot, d.reason)))
                if w.failures:  # a slot's crash loop: the same placement again is counted, not added
                    ledger.add_event(placed_event, coalesce=True)
                else:
                    events.append(placed_event)
            out.start.append((w, r))
            out.placed += 1
        elif isinstance(d, Wait):
            out.waiting += 1
            if ref.slot == 0 and (w.reason != (reason := d.reason) or w.fallback_eligible_at != d.fallback_eligible_at):
                waits.append((w.id, reason, d.fallback_eligible_at))
            if d.fallback_eligible_at is not None and d.fallback_eligible_at > now:
                out.later.append(d.fallback_eligible_at)
        elif isinstance(d, Promote):
            if not _still(ledger, w, now):
                continue
            r = new_replica(ledger, w, ref.slot, d.to_class, d.node, ReplicaRole.CANDIDATE, now)
            events.append(EventRow(w.id, now, EventType.MOVING, d.reason))
            out.start.append((w, r))
            out.promoted += 1
        elif isinstance(d, RestartAvailable):
            restart[w.id] = d
            out.offers[w.id] = d.reason
    ledger.add_events(events)
    ledger.set_wait_reasons(waits)
    for wid, w in rows.items():
        offer = restart.get(wid)
        if offer is not None and not w.restart_available:
            if ledger.update_workload(wid, {"restart_available": True, "restart_reason": offer.reason},
                                      expect_state=w.state):
                ledger.add_event(EventRow(wid, now, EventType.RESTART_AVAILABLE, offer.reason))
        elif offer is None and w.restart_available:
            ledger.update_workload(wid, {"restart_available": False, "restart_reason": ""})
    return out


def _still(ledger: Ledger, w: WorkloadRow, now: float) -> bool:
    """The workload is still in the state the snapshot saw (and not deleted since)."""
    return ledger.update_workload(w.id, {"updated_at": now}, expect_state=w.state, live_only=True)
