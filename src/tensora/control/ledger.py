"""Where the steps of a cycle write: the store (the controller) or memory (``tensora plan``).

Reconcile and apply record what they decide through a ``Ledger`` and never touch a database
themselves, so the capacity planner runs the controller's very steps on a simulated clock
instead of a copy of them that could drift. ``StoreLedger`` writes on a Connection inside the
cycle's fenced transaction (``control.store_ledger``: this module imports no SQLAlchemy, for ``tensora plan``);
``MemoryLedger`` keeps the rows in dicts.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol

from tensora.control.events import EventType
from tensora.placement.kinds import HOLDING, ReplicaRole, ReplicaState, WorkloadState
from tensora.store.rows import COALESCE_WITHIN, EventRow, ReplicaRow, WorkloadRow

Values = Mapping[str, object]
"""Columns to set on a row, by name (the store's update statements take them as they are)."""


class Ledger(Protocol):
    def new_replica_id(self) -> str: ...

    def update_workload(self, workload_id: str, values: Values, expect_state: WorkloadState | None = None,
                        live_only: bool = False) -> bool:
        """Set ``values``; with ``expect_state`` only if still in it, with ``live_only`` only if not deleted."""
        ...

    def update_replica(self, replica_id: str, values: Values) -> None: ...

    def insert_replica(self, r: ReplicaRow, w: WorkloadRow, now: float) -> None:
        """Record a new replica and open its usage segment."""
        ...

    def close_segment(self, replica_id: str, now: float) -> None: ...

    def add_event(self, e: EventRow, coalesce: bool = False) -> None:
        """Record ``e``; with ``coalesce``, one identical to a recent event of its workload counts that one
        again (``count``, ``last_at``) instead: a crash loop repeats the same few events."""
        ...

    def add_events(self, events: Sequence[EventRow]) -> None: ...

    def set_wait_reasons(self, waits: Sequence[tuple[str, str, float | None]]) -> None: ...


def transition(ledger: Ledger, w: WorkloadRow, from_state: WorkloadState, to_state: WorkloadState, reason: str,
               now: float, extra: Values | None = None) -> WorkloadRow | None:
    """Move ``w`` from ``from_state`` (if it is still there) and record why; the row after, or None."""
    values: dict[str, object] = {"state": to_state, "updated_at": now, **(extra or {})}
    if to_state is WorkloadState.FAILED:  # the why of a failure is what a user needs to see first
        values.setdefault("reason", reason)
    if to_state is not WorkloadState.QUEUED:
        values.setdefault("restart_available", False)
    if not ledger.update_workload(w.id, values, expect_state=from_state):
        return None
    after = w._replace(**values)  # type: ignore[arg-type]  # the keys are WorkloadRow's columns
    ledger.add_event(EventRow(w.id, now, EventType.TRANSITION, reason, from_state, to_state),
                     coalesce=after.failures > 0)
    return after


def new_replica(ledger: Ledger, w: WorkloadRow, slot: int, cls: str, node: str, role: ReplicaRole,
                now: float) -> ReplicaRow:
    """A replica recorded ``starting``: the driver is told once the transaction commits."""
    r = ReplicaRow(ledger.new_replica_id(), w.id, slot, cls, node, w.region, ReplicaState.STARTING, role, now, now)
    ledger.insert_replica(r, w, now)
    return r


_WORKLOAD_FIELDS = frozenset(WorkloadRow._fields)
_REPLICA_FIELDS = frozenset(ReplicaRow._fields)


@dataclass
class MemoryLedger:
    """Rows in dicts, for ``tensora plan`` and tests: the same conditions as the store's statements."""

    workloads: dict[str, WorkloadRow] = field(default_factory=dict)
    replicas: dict[str, ReplicaRow] = field(default_factory=dict)
    events: list[EventRow] = field(default_factory=list)
    restart_reasons: dict[str, str] = field(default_factory=dict)
    """The one column a cycle writes that ``WorkloadRow`` does not hold."""
    _ids: Iterator[int] = field(default_factory=lambda: itertools.count(1))
    _of: dict[str, list[str]] = field(init=False, default_factory=dict)
    """Each workload's replica ids, oldest first (``tensora plan`` reads a workload's, not every one)."""
    _touched: set[str] = field(init=False, default_factory=set)

    def __post_init__(self) -> None:
        for r in self.replicas.values():
            self._of.setdefault(r.workload_id, []).append(r.id)

    def add_workload(self, w: WorkloadRow) -> None:
        """Record a new workload (what ``POST /v1/workloads`` inserts)."""
        self.workloads[w.id] = w
        self._touched.add(w.id)

    def replicas_of(self, workload_id: str) -> list[ReplicaRow]:
        """The workload's replicas, every state, oldest first."""
        return [self.replicas[i] for i in self._of.get(workload_id, ())]

    def take_touched(self) -> set[str]:
        """The workloads written since the last call (their row, or one of their replicas): what a cycle of
        ``tensora plan`` re-reads, instead of every row. A wait's reason is not counted: only people read it,
        and one freed GPU rewrites the reason of every wait of its region."""
        touched, self._touched = self._touched, set()
        return touched

    def new_replica_id(self) -> str:
        return f"rp-{next(self._ids)}"

    def update_workload(self, workload_id: str, values: Values, expect_state: WorkloadState | None = None,
                        live_only: bool = False) -> bool:
        w = self.workloads.get(workload_id)
        if w is None or (expect_state is not None and w.state is not expect_state) or (
                live_only and w.deleted_at is not None):
            return False
        if "restart_reason" in values:
            self.restart_reasons[workload_id] = str(values["restart_reason"])
        self.workloads[workload_id] = w._replace(**{k: v for k, v in values.items()  # type: ignore[arg-type]
                                                    if k in _WORKLOAD_FIELDS})
        self._touched.add(workload_id)
        return True

    def update_replica(self, replica_id: str, values: Values) -> None:
        r = self.replicas[replica_id]
        self.replicas[replica_id] = r._replace(**{k: v for k, v in values.items()  # type: ignore[arg-type]
                                                  if k in _REPLICA_FIELDS})
        self._touched.add(r.workload_id)

    def insert_replica(self, r: ReplicaRow, w: WorkloadRow, now: float) -> None:
        self.replicas[r.id] = r
        self._of.setdefault(r.workload_id, []).append(r.id)
        self._touched.add(r.workload_id)

    def close_segment(self, replica_id: str, now: float) -> None:
        pass  # the plan accounts no usage

    def add_event(self, e: EventRow, coalesce: bool = False) -> None:
        if coalesce:
            recent = [i for i, x in enumerate(self.events) if x.workload_id == e.workload_id][-COALESCE_WITHIN:]
            for i in reversed(recent):
                x = self.events[i]
                if (x.type, x.reason, x.from_state, x.to_state) == (e.type, e.reason, e.from_state, e.to_state):
                    self.events[i] = replace(x, count=x.count + 1, last_at=e.at)
                    return
        self.events.append(e)

    def add_events(self, events: Sequence[EventRow]) -> None:
        self.events.extend(events)

    def set_wait_reasons(self, waits: Sequence[tuple[str, str, float | None]]) -> None:
        for wid, reason, at in waits:
            w = self.workloads.get(wid)
            if w is not None and w.state is WorkloadState.QUEUED:
                self.workloads[wid] = w._replace(reason=reason, fallback_eligible_at=at)

    def active(self) -> list[ReplicaRow]:
        """The replicas that hold capacity (the store's ``active_replicas``)."""
        return [r for r in self.replicas.values() if r.state in HOLDING]
