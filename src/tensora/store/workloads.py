"""Workloads and their replicas: the rows the API writes and a region's controller reads each cycle."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

from sqlalchemy import Connection, and_, bindparam, delete, func, insert, or_, select, update

from tensora.placement.kinds import WorkloadState
from tensora.store.rows import HeldReplica, ReplicaRow, Spec, WorkloadRecord, WorkloadRow
from tensora.store.tables import ACTIVE_REPLICA, R_ROW, W_RECORD, W_ROW, E, R, Values, W, chunks, lock_owner

_INSERT_W = insert(W)
_INSERT_R = insert(R)


def insert_workload(conn: Connection, row: Values) -> None:
    conn.execute(_INSERT_W, row)


def get_workload(conn: Connection, workload_id: str, owner: str | None = None,
                 include_deleted: bool = False) -> WorkloadRecord | None:
    """The workload, or None if absent, deleted, or (with ``owner``) someone else's."""
    q = _GET_W[(include_deleted, owner is not None)]
    row = conn.execute(q, {"b_id": workload_id, "b_owner": owner}).first()
    return WorkloadRecord.of(row) if row else None




def _get_w(include_deleted: bool, by_owner: bool) -> Any:
    q = select(*W_RECORD).where(W.c.id == bindparam("b_id"))
    if not include_deleted:
        q = q.where(W.c.deleted_at.is_(None))
    if by_owner:
        q = q.where(W.c.owner == bindparam("b_owner"))
    return q


_GET_W = {(d, o): _get_w(d, o) for d in (False, True) for o in (False, True)}


def list_workloads(conn: Connection, owner: str | None, kind: str | None = None, state: str | None = None,
                   limit: int = 100, after: str | None = None) -> list[WorkloadRecord]:
    q = select(*W_RECORD).where(W.c.deleted_at.is_(None))
    if owner is not None:
        q = q.where(W.c.owner == owner)
    if kind:
        q = q.where(W.c.kind == kind)
    if state:
        q = q.where(W.c.state == state)
    if after:
        q = q.where(W.c.id > after)
    return [WorkloadRecord.of(r) for r in conn.execute(q.order_by(W.c.id).limit(limit))]


def update_workload(conn: Connection, workload_id: str, values: Values,
                    expect_state: str | Sequence[str] | None = None, live_only: bool = False) -> bool:
    """Update a workload; with ``expect_state``, only if it is still in that state (True if it was);
    with ``live_only``, only if it is not deleted."""
    q = update(W).where(W.c.id == workload_id)
    if live_only:
        q = q.where(W.c.deleted_at.is_(None))
    if isinstance(expect_state, str):
        q = q.where(W.c.state == expect_state)
    elif expect_state is not None:
        q = q.where(W.c.state.in_(list(expect_state)))
    return conn.execute(q.values(**values)).rowcount == 1




def workloads_in(conn: Connection, region: str, states: Iterable[WorkloadState]) -> list[WorkloadRow]:
    """The region's workloads in ``states``, as a cycle reads them (no ``spec``)."""
    q = select(*W_ROW).where(W.c.region == region, W.c.state.in_(list(states)))
    return [WorkloadRow.of(r) for r in conn.execute(q)]


_SET_WAIT = (update(W).where(W.c.id == bindparam("b_id"), W.c.state == WorkloadState.QUEUED)
             .values(reason=bindparam("b_reason"), fallback_eligible_at=bindparam("b_at")))


def set_wait_reasons(conn: Connection, rows: Sequence[tuple[str, str, float | None]]) -> None:
    """The admission reason of queued workloads, ``(id, reason, fallback_eligible_at)`` each (one statement
    for all; ones no longer queued are left)."""
    if rows:
        conn.execute(_SET_WAIT, [{"b_id": wid, "b_reason": reason, "b_at": at} for wid, reason, at in rows])


def workloads_by_id_or_state(conn: Connection, ids: Iterable[str], region: str,
                             states: Iterable[WorkloadState]) -> list[WorkloadRow]:
    """Workloads named in ``ids`` (deleted ones too), and the region's workloads in ``states``."""
    q = select(*W_ROW).where(or_(W.c.id.in_(bindparam("ids", expanding=True)),
                                  and_(W.c.region == region, W.c.state.in_(bindparam("states", expanding=True)))))
    return [WorkloadRow.of(r) for r in conn.execute(q, {"ids": list(ids), "states": list(states)})]


def purge_workloads(conn: Connection, deleted_before: float, limit: int = 5000) -> int:
    """Delete the workloads deleted at or before ``deleted_before`` (the retention) whose storage was given back
    and that hold no replica, with their replicas' rows and events: the number deleted. Their usage stays
    (``usage_segments`` carries the owner, kind and class itself). At most ``limit``, oldest deleted first, so
    that one housekeeping round stays short however many piled up. No change watermark needs a tombstone for
    these rows: their deletion and their replicas' ends were stamped and seen long before (the retention)."""
    busy = select(R.c.id).where(R.c.workload_id == W.c.id, R.c.state.in_(ACTIVE_REPLICA)).exists()
    ids = list(conn.execute(select(W.c.id).where(W.c.deleted_at.is_not(None), W.c.deleted_at <= deleted_before,
                                                 W.c.released_at.is_not(None), ~busy)
                                     .order_by(W.c.deleted_at).limit(limit)).scalars())
    for part in chunks(ids):
        conn.execute(delete(E).where(E.c.workload_id.in_(part)))
        conn.execute(delete(R).where(R.c.workload_id.in_(part)))
        conn.execute(delete(W).where(W.c.id.in_(part)))
    return len(ids)


def insert_replica(conn: Connection, row: ReplicaRow) -> None:
    conn.execute(_INSERT_R, row._asdict())


def replicas_of(conn: Connection, workload_ids: Sequence[str], active_only: bool = True) -> list[ReplicaRow]:
    q = _REPLICAS_OF_ACTIVE if active_only else _REPLICAS_OF
    return [ReplicaRow.of(r) for part in chunks(workload_ids) for r in conn.execute(q, {"ids": part})]




_REPLICAS_OF = (select(*R_ROW).where(R.c.workload_id.in_(bindparam("ids", expanding=True)))
                .order_by(R.c.created_at, R.c.id))


_REPLICAS_OF_ACTIVE = _REPLICAS_OF.where(R.c.state.in_(ACTIVE_REPLICA))


_ACTIVE_IN = select(*R_ROW).where(R.c.region == bindparam("b_region"), R.c.state.in_(ACTIVE_REPLICA))


def active_replicas(conn: Connection, region: str) -> list[ReplicaRow]:
    """The region's replicas that hold capacity."""
    return [ReplicaRow.of(r) for r in conn.execute(_ACTIVE_IN, {"b_region": region})]


def unreleased(conn: Connection, region: str, limit: int = 50) -> list[str]:
    """The region's deleted workloads whose storage is not given back yet and that hold no replica: at most
    ``limit``, taken round-robin across owners (each owner's oldest deleted first), so that one owner's churn
    cannot hold back another's release behind it."""
    busy = select(R.c.id).where(R.c.workload_id == W.c.id, R.c.state.in_(ACTIVE_REPLICA)).exists()
    turn = func.row_number().over(partition_by=W.c.owner, order_by=(W.c.deleted_at, W.c.id)).label("turn")
    pending = (select(W.c.id, W.c.deleted_at, turn)
               .where(W.c.region == region, W.c.deleted_at.is_not(None), W.c.released_at.is_(None), ~busy)
               .subquery())
    q = (select(pending.c.id).where(pending.c.turn <= limit)
         .order_by(pending.c.turn, pending.c.deleted_at, pending.c.id).limit(limit))
    return list(conn.execute(q).scalars())


def mark_released(conn: Connection, workload_ids: Sequence[str], at: float) -> None:
    if workload_ids:
        conn.execute(update(W).where(W.c.id.in_(list(workload_ids)), W.c.released_at.is_(None))
                     .values(released_at=at))


def update_replica(conn: Connection, replica_id: str, values: Values,
                   expect_state: Sequence[str] | None = None) -> bool:
    q = update(R).where(R.c.id == replica_id)
    if expect_state is not None:
        q = q.where(R.c.state.in_(list(expect_state)))
    return conn.execute(q.values(**values)).rowcount == 1


_HELD = (select(W.c.owner, R.c.workload_id, R.c.slot, R.c.cls).join(W, W.c.id == R.c.workload_id)
         .where(R.c.state.in_(ACTIVE_REPLICA)))


def held_replicas(conn: Connection, owners: Iterable[str] | None = None) -> list[HeldReplica]:
    """Every replica that holds capacity, in every region, with its workload's owner (running quotas);
    with ``owners``, only theirs."""
    if owners is None:
        return [HeldReplica._make(r) for r in conn.execute(_HELD)]
    q = _HELD.where(W.c.owner.in_(bindparam("owners", expanding=True)))
    return [HeldReplica._make(r) for part in chunks(owners) for r in conn.execute(q, {"owners": part})]


def workload_specs(conn: Connection, ids: Iterable[str]) -> dict[str, Spec]:
    """The ``spec`` of each workload in ``ids``: read only for those being started, never for a whole queue."""
    q = select(W.c.id, W.c.spec).where(W.c.id.in_(bindparam("ids", expanding=True)))
    return {wid: spec or {} for wid, spec in conn.execute(q, {"ids": list(ids)})}


_COUNT_W = select(func.count()).select_from(W).where(W.c.owner == bindparam("b_owner"), W.c.deleted_at.is_(None))


def count_workloads(conn: Connection, owner: str) -> int:
    """The owner's workloads not deleted, in any state."""
    return int(conn.execute(_COUNT_W, {"b_owner": owner}).scalar_one())


_W_BY_ID = select(*W_ROW).where(W.c.id.in_(bindparam("ids", expanding=True)))


def workloads_by_id(conn: Connection, ids: Iterable[str]) -> list[WorkloadRow]:
    """The workloads named (deleted ones too), as a cycle reads them."""
    return [WorkloadRow.of(r) for part in chunks(ids) for r in conn.execute(_W_BY_ID, {"ids": part})]


def lock_owner_names(conn: Connection, owner: str) -> None:
    """Until the transaction ends, this owner's other creates wait for this one, so that looking a name up
    (:func:`live_named`) and inserting the workload that takes it are one step: two creates of one name at once
    cannot both find it free. PostgreSQL: a transaction-scoped advisory lock; SQLite: its writes take turns."""
    lock_owner(conn, b"tensora-names:", owner)


_NAMED = (select(W.c.id).where(W.c.owner == bindparam("b_owner"), W.c.name == bindparam("b_name"),
                               W.c.deleted_at.is_(None)).order_by(W.c.id).limit(1))


def live_named(conn: Connection, owner: str, name: str) -> str | None:
    """The id of the owner's workload called ``name`` that is not deleted (the oldest, where a store from before
    names were unique holds several), or None."""
    found: str | None = conn.execute(_NAMED, {"b_owner": owner, "b_name": name}).scalar()
    return found


class DuplicateName(NamedTuple):
    """A name that several of one owner's workloads not deleted hold (made before names were unique)."""

    owner: str
    name: str
    ids: tuple[str, ...]  # oldest first


def duplicate_names(conn: Connection) -> list[DuplicateName]:
    """Every owner's names held by more than one of its workloads not deleted, by owner then name."""
    live = W.c.deleted_at.is_(None)
    dup = (select(W.c.owner, W.c.name).where(live).group_by(W.c.owner, W.c.name)
           .having(func.count() > 1).subquery())
    q = (select(W.c.owner, W.c.name, W.c.id).join(dup, and_(W.c.owner == dup.c.owner, W.c.name == dup.c.name))
         .where(live).order_by(W.c.owner, W.c.name, W.c.id))
    out: dict[tuple[str, str], list[str]] = {}
    for owner, name, wid in conn.execute(q):
        out.setdefault((owner, name), []).append(wid)
    return [DuplicateName(owner, name, tuple(ids)) for (owner, name), ids in out.items()]
