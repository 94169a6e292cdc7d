"""A workload's events: what happened to it, identical ones in a row counted rather than repeated."""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy import Connection, delete, insert, select, update

from tensora.store.rows import COALESCE_WITHIN, EventRow
from tensora.store.tables import E, W

_INSERT_E = insert(E)


def add_event(conn: Connection, workload_id: str, at: float, type_: str, reason: str,
              from_state: str | None = None, to_state: str | None = None) -> None:
    conn.execute(_INSERT_E, {"workload_id": workload_id, "at": at, "type": type_, "reason": reason,
                             "from_state": from_state, "to_state": to_state})


def add_events(conn: Connection, rows: Sequence[EventRow]) -> None:
    if rows:
        conn.execute(insert(E), [{"workload_id": e.workload_id, "at": e.at, "type": e.type, "reason": e.reason,
                                  "from_state": e.from_state, "to_state": e.to_state} for e in rows])


def repeat_event(conn: Connection, e: EventRow) -> bool:
    """Count ``e`` again on an identical event among its workload's recent ones; False if there is none."""
    q = (select(E.c.id, E.c.type, E.c.reason, E.c.from_state, E.c.to_state).where(E.c.workload_id == e.workload_id)
         .order_by(E.c.id.desc()).limit(COALESCE_WITHIN))
    for i, type_, reason, from_state, to_state in conn.execute(q):
        if (type_, reason, from_state, to_state) == (e.type, e.reason, e.from_state, e.to_state):
            conn.execute(update(E).where(E.c.id == i).values(count=E.c.count + 1, last_at=e.at))
            return True
    return False


def prune_events(conn: Connection, deleted_before: float) -> int:
    """Delete the events of workloads deleted at or before ``deleted_before`` (the retention): the number deleted."""
    gone = select(W.c.id).where(W.c.deleted_at.is_not(None), W.c.deleted_at <= deleted_before)
    return conn.execute(delete(E).where(E.c.workload_id.in_(gone))).rowcount or 0


def list_events(conn: Connection, workload_id: str, limit: int = 1000) -> list[EventRow]:
    q = select(E).where(E.c.workload_id == workload_id).order_by(E.c.id).limit(limit)
    return [EventRow.of(r) for r in conn.execute(q).mappings()]
