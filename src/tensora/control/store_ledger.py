"""The ledger of the controller: the store, on the cycle's Connection (see ``control.ledger``)."""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy import Connection

from tensora.control.ledger import Values
from tensora.placement.kinds import WorkloadState
from tensora.store import events as events_repo
from tensora.store import usage as usage_repo
from tensora.store import workloads as workloads_repo
from tensora.store.ids import new_id
from tensora.store.rows import EventRow, ReplicaRow, WorkloadRow


class StoreLedger:
    """The store, on the cycle's Connection (in its fenced write transaction)."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn

    def new_replica_id(self) -> str:
        return new_id("rp_")

    def update_workload(self, workload_id: str, values: Values, expect_state: WorkloadState | None = None,
                        live_only: bool = False) -> bool:
        return workloads_repo.update_workload(self.conn, workload_id, dict(values), expect_state=expect_state,
                                    live_only=live_only)

    def update_replica(self, replica_id: str, values: Values) -> None:
        workloads_repo.update_replica(self.conn, replica_id, dict(values))

    def insert_replica(self, r: ReplicaRow, w: WorkloadRow, now: float) -> None:
        workloads_repo.insert_replica(self.conn, r)
        usage_repo.open_segment(self.conn, r, w, now)

    def close_segment(self, replica_id: str, now: float) -> None:
        usage_repo.close_segment(self.conn, replica_id, now)

    def add_event(self, e: EventRow, coalesce: bool = False) -> None:
        if not (coalesce and events_repo.repeat_event(self.conn, e)):
            events_repo.add_event(self.conn, e.workload_id, e.at, e.type, e.reason, e.from_state, e.to_state)

    def add_events(self, events: Sequence[EventRow]) -> None:
        events_repo.add_events(self.conn, events)

    def set_wait_reasons(self, waits: Sequence[tuple[str, str, float | None]]) -> None:
        workloads_repo.set_wait_reasons(self.conn, waits)
