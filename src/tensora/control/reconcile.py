"""Reconcile: what the driver observes against what the store recorded.

Records replica transitions (ready, failed, stopped by itself), finishes a move back whose
candidate is ready (it becomes the primary, the old one drains), stops what should stop and
re-starts what a crash left recorded but never handed to the driver. Writes go through a
``Ledger``; the driver calls it asks for (``start``, ``stop``) are made after the transaction.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from tensora.control import backoff
from tensora.control.events import (
    AllStopped,
    BackingOff,
    Drained,
    Happened,
    Moved,
    MoveFailed,
    Ready,
    ReplicaFailed,
    Then,
    Where,
    event_type,
    render,
)
from tensora.control.ledger import Ledger, transition
from tensora.drivers.base import ReplicaStatus
from tensora.placement.kinds import HOLDING, ReplicaRole, ReplicaState, WorkloadKind, WorkloadState
from tensora.store.rows import EventRow, ReplicaRow, WorkloadRow

DRAIN_S = 5.0
"""Seconds a replica replaced by a move back keeps serving the requests in flight before it is stopped
(it is out of the gateway's routes at once): longer than a typical completion, short enough that the
capacity it holds is back within a few ticks."""

_GONE = (ReplicaState.STOPPED, ReplicaState.FAILED)
_WANTS_STOP = (WorkloadState.STOPPING, WorkloadState.STOPPED, WorkloadState.FAILED)


@dataclass
class Reconciled:
    transitions: int = 0
    busy: int = 0
    """Replicas starting, stopping or draining: the loop looks again soon, not a tick later."""
    start: list[tuple[WorkloadRow, ReplicaRow]] = field(default_factory=list)
    """Recorded but unknown to the driver (a crash between the record and the call): start them."""
    stop: list[str] = field(default_factory=list)
    drains_end: list[float] = field(default_factory=list)
    """When replicas draining now are due to stop (``tensora plan`` revisits those moments)."""
    failures: list[tuple[WorkloadKind, ReplicaRole]] = field(default_factory=list)
    """Replicas that failed this step (the controller's metrics count them)."""
    moved_back: int = 0
    """Moves back finished this step."""


def reconcile(ledger: Ledger, workloads: Iterable[WorkloadRow], replicas: Sequence[ReplicaRow],
              observed: Mapping[str, ReplicaStatus], now: float, drain_s: float = DRAIN_S) -> Reconciled:
    """``replicas``: those that hold capacity; ``workloads``: theirs, and those asked to stop."""
    return _Reconcile(ledger, workloads, replicas, now, drain_s).run(observed)


class _Reconcile:
    def __init__(self, ledger: Ledger, workloads: Iterable[WorkloadRow], replicas: Sequence[ReplicaRow],
                 now: float, drain_s: float) -> None:
        self.ledger, self.now, self.drain_s = ledger, now, drain_s
        self.w = {w.id: w for w in workloads}  # as changed by this step's transitions
        self.r = {r.id: r for r in replicas}  # with the states this step recorded
        self.of: dict[str, list[str]] = {}
        for r in replicas:
            self.of.setdefault(r.workload_id, []).append(r.id)
        self.out = Reconciled()

    def run(self, observed: Mapping[str, ReplicaStatus]) -> Reconciled:
        out = self.out
        for rid in list(self.r):
            w = self.w.get(self.r[rid].workload_id)
            if w is None:
                continue
            out.transitions += self.replica(w, self.r[rid], observed.get(rid))
            r = self.r[rid]
            out.busy += r.state in (ReplicaState.STARTING, ReplicaState.STOPPING) or r.role is ReplicaRole.DRAINING
        # workloads asked to stop whose replicas are all gone
        for w in list(self.w.values()):
            if w.state is WorkloadState.STOPPING and not any(r.state in HOLDING for r in self.siblings(w.id)):
                self.transition(w, WorkloadState.STOPPED, AllStopped())
                out.transitions += 1
        return out

    def siblings(self, workload_id: str) -> list[ReplicaRow]:
        return [self.r[i] for i in self.of.get(workload_id, ())]

    def replica(self, w: WorkloadRow, r: ReplicaRow, seen: ReplicaStatus | None) -> int:
        now, out = self.now, self.out
        if r.state is ReplicaState.STOPPING or w.state in _WANTS_STOP or w.deleted_at is not None:
            if seen is None or seen.state in _GONE:
                self.done(r, ReplicaState.STOPPED, seen.detail if seen else "")
                return 0
            if r.state is not ReplicaState.STOPPING:
                self.ledger.update_replica(r.id, {"state": ReplicaState.STOPPING, "updated_at": now})
            out.stop.append(r.id)
            return 0
        if r.role is ReplicaRole.DRAINING:  # replaced by a move back: out of the routes; stop it once drained
            if seen is not None and seen.state in _GONE:
                self.done(r, ReplicaState.STOPPED, seen.detail)
            elif now >= r.updated_at + self.drain_s:
                self.ledger.update_replica(r.id, {"state": ReplicaState.STOPPING, "updated_at": now})
                self.event(w, Drained(Where(r.cls, r.node)))
                out.stop.append(r.id)
            else:
                out.drains_end.append(r.updated_at + self.drain_s)
            return 0
        if seen is None:  # recorded but never handed to the driver (or the driver forgot it): start it
            out.start.append((w, r))
            return 0
        if seen.state is ReplicaState.STARTING and r.state is ReplicaState.STARTING and r.detail != seen.waiting:
            # the step it waits on (its runtime's install), kept on the replica: its workload shows it while it
            # starts (``workloads.shown_reason``), and it ends with the step, never covering the placement's reason
            self.ledger.update_replica(r.id, {"detail": seen.waiting})
            r = self.r[r.id] = r._replace(detail=seen.waiting)
        if seen.state is ReplicaState.FAILED:
            return self.failed(w, r, seen.detail or "replica failed", seen.permanent)
        if seen.state is ReplicaState.STOPPED:
            return self.failed(w, r, "stopped by itself")
        if seen.state is ReplicaState.RUNNING and r.state is ReplicaState.STARTING:
            self.ledger.update_replica(r.id, {"state": ReplicaState.RUNNING, "url": seen.url, "detail": "",
                                              "served_model": seen.served_model, "updated_at": now})
            r = self.r[r.id] = r._replace(state=ReplicaState.RUNNING, detail="")
            if r.role is ReplicaRole.CANDIDATE:
                return self.finish_move(w, r)
            if w.state is WorkloadState.STARTING:
                self.transition(w, WorkloadState.RUNNING, Ready(Where(r.cls, r.node)))
                return 1
        elif (seen.state is ReplicaState.RUNNING and w.failures and r.role is ReplicaRole.PRIMARY
              and backoff.healed(w.retry_at, r.created_at, r.updated_at, now)):
            # a replica placed after the last failure ran long enough: the crash loop is over
            values: dict[str, object] = {"failures": 0, "last_failure": "", "retry_at": None}
            if w.state is WorkloadState.RUNNING and w.retry_at is not None and w.reason == render(
                    BackingOff(w.failures, w.last_failure, w.retry_at)):
                # the back-off's sentence ends with it; a reason written since (a placement again) stays
                values["reason"] = render(Ready(Where(r.cls, r.node)))
            self.ledger.update_workload(w.id, values)
            self.w[w.id] = w._replace(**values)  # type: ignore[arg-type]  # WorkloadRow's columns
        return 0

    def done(self, r: ReplicaRow, state: ReplicaState, detail: str) -> None:
        self.ledger.update_replica(r.id, {"state": state, "updated_at": self.now, "detail": detail})
        self.ledger.close_segment(r.id, self.now)
        self.r[r.id] = r._replace(state=state)

    def failed(self, w: WorkloadRow, r: ReplicaRow, why: str, permanent: bool = False) -> int:
        """A notebook's or VM's replica, or one retrying cannot fix (``permanent``), fails the workload;
        an endpoint's is placed again after its back-off (``control.backoff``)."""
        self.done(r, ReplicaState.FAILED, why)
        self.out.failures.append((w.kind, r.role))
        at = Where(r.cls, r.node)
        if r.role is ReplicaRole.CANDIDATE:
            self.event(w, MoveFailed(r.cls, why, w.placed_class))
            return 0
        if w.kind is not WorkloadKind.ENDPOINT or permanent:
            self.transition(w, WorkloadState.FAILED, ReplicaFailed(at, why, Then.FAIL))
            return 1
        count = w.failures + 1
        retry_at = backoff.next_try(count, self.now)
        values = {"failures": count, "last_failure": why, "retry_at": retry_at,
                  "reason": render(BackingOff(count, why, retry_at))}
        if any(s.id != r.id and s.role is ReplicaRole.PRIMARY and s.state in (ReplicaState.STARTING,
                                                                              ReplicaState.RUNNING)
               for s in self.siblings(w.id)):  # another replica serves on; this slot waits out the back-off
            self.ledger.update_workload(w.id, values)
            self.w[w.id] = w = w._replace(**values)  # type: ignore[arg-type]  # WorkloadRow's columns
            self.event(w, ReplicaFailed(at, why, Then.REPLACE))
            return 0
        self.transition(w, WorkloadState.QUEUED, ReplicaFailed(at, why, Then.REQUEUE),
                        {"queued_since": self.now, "placed_class": None, **values})
        return 1

    def finish_move(self, w: WorkloadRow, r: ReplicaRow) -> int:
        """The preferred replica is ready: it becomes the primary, traffic shifts, the old one drains."""
        now = self.now
        old = [s for s in self.siblings(w.id) if s.slot == r.slot and s.role is ReplicaRole.PRIMARY and s.id != r.id]
        self.ledger.update_replica(r.id, {"role": ReplicaRole.PRIMARY, "updated_at": now})
        for s in old:  # routes stop naming it now; it stops once in-flight requests had drain_s to finish
            self.ledger.update_replica(s.id, {"role": ReplicaRole.DRAINING, "updated_at": now})
        moved = Moved(Where(r.cls, r.node), tuple(s.cls for s in old), self.drain_s)
        placed = r.cls if r.slot == 0 else w.placed_class
        self.ledger.update_workload(w.id, {"placed_class": placed, "reason": render(moved), "updated_at": now})
        self.event(w, moved)
        self.out.moved_back += 1
        return 1

    def transition(self, w: WorkloadRow, to: WorkloadState, happened: Happened,
                   extra: Mapping[str, object] | None = None) -> None:
        after = transition(self.ledger, w, w.state, to, render(happened), self.now, extra)
        if after is not None:
            self.w[w.id] = after

    def event(self, w: WorkloadRow, happened: Happened) -> None:
        """Recorded; one repeating a crash loop's (the workload has failed before) is counted, not added."""
        self.ledger.add_event(EventRow(w.id, self.now, event_type(happened), render(happened)),
                              coalesce=w.failures > 0)
