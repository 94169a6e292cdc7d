"""Repositories: the reads and writes the API and the controller make, on a Connection
inside a transaction from ``Database.write()``/``read()``. No business rules here.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import string
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, fields
from typing import Any, NamedTuple, cast

from sqlalchemy import (
    BigInteger,
    ColumnElement,
    Connection,
    Table,
    and_,
    bindparam,
    case,
    delete,
    exists,
    func,
    insert,
    literal_column,
    or_,
    select,
    union,
    update,
)
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert

from tensora.errors import Conflict, TensoraError
from tensora.placement.kinds import HOLDING, ReplicaRole, ReplicaState, WorkloadKind, WorkloadState
from tensora.store.models import (
    ApiKey,
    DashboardSession,
    Event,
    IdempotencyRecord,
    Lease,
    Node,
    Owner,
    OwnerCall,
    OwnerUid,
    Replica,
    Revision,
    StoredFile,
    TokenUsage,
    UploadReservation,
    UsageSegment,
    Workload,
)
from tensora.store.rows import (
    COALESCE_WITHIN,
    NODE_COLUMNS,
    REPLICA_COLUMNS,
    WORKLOAD_COLUMNS,
    WORKLOAD_RECORD_COLUMNS,
    EventRow,
    HeldReplica,
    NodeRow,
    ReplicaRow,
    SessionRow,
    WorkloadRecord,
    WorkloadRow,
)

W = cast(Table, Workload.__table__)
R = cast(Table, Replica.__table__)
E = cast(Table, Event.__table__)
U = cast(Table, UsageSegment.__table__)
N = cast(Table, Node.__table__)
K = cast(Table, ApiKey.__table__)
I = cast(Table, IdempotencyRecord.__table__)  # noqa: E741
L = cast(Table, Lease.__table__)
T = cast(Table, TokenUsage.__table__)
O = cast(Table, Owner.__table__)  # noqa: E741
F = cast(Table, StoredFile.__table__)
UID = cast(Table, OwnerUid.__table__)
RV = cast(Table, Revision.__table__)
S = cast(Table, DashboardSession.__table__)
UR = cast(Table, UploadReservation.__table__)
OC = cast(Table, OwnerCall.__table__)

# Hot-path statements are built once with bound parameters and executed with a dict of
# values: SQLAlchemy then reuses the compiled statement instead of coercing literals and
# computing a cache key on every call (that was most of a create's cost).
_INSERT_W, _INSERT_E, _INSERT_R, _INSERT_U, _INSERT_K, _INSERT_I = (insert(t) for t in (W, E, R, U, K, I))
_PK_I = and_(I.c.key_id == bindparam("k_key_id"), I.c.method == bindparam("k_method"),
             I.c.path == bindparam("k_path"), I.c.key == bindparam("k_key"))
_COMPLETE_I = update(I).where(_PK_I).values(state="done", status=bindparam("b_status"), body=bindparam("b_body"),
                                            expires_at=bindparam("b_expires_at"))
_GET_I = select(I).where(_PK_I)
_KEY_BY_DIGEST = select(K).where(K.c.digest == bindparam("b_digest"))
_DROP_I = delete(I).where(_PK_I)


def _pk(pk: dict[str, Any]) -> dict[str, Any]:
    return {"k_" + k: v for k, v in pk.items()}


_B62 = string.digits + string.ascii_letters
ACTIVE_REPLICA = HOLDING
"""Replica states that hold capacity: recorded ``starting`` before the driver is told (a crash between
the two is redone by the next cycle), ``running``, and ``stopping`` until the driver says it stopped."""


_B36 = string.digits + string.ascii_lowercase  # sorts the same in every collation (digits, then a-z)


class Ids:
    """Ids that sort in the order they were made, so lists and ``after=`` pages are in creation order:
    ``prefix`` + the creation millisecond (9 base-36 digits, fixed width, good to the year 5000) + ``n``
    random base-62 characters. Strictly increasing within a process (a millisecond already used, or
    a clock stepped back, is bumped past the last), ordered to the millisecond across processes. Wall
    time rather than the service clock, which tests hold still."""

    def __init__(self, now: Callable[[], float] = time.time) -> None:
        self._now, self._lock, self._last_ms = now, threading.Lock(), 0

    def new(self, prefix: str, n: int = 10) -> str:
        with self._lock:
            ms = self._last_ms = max(int(self._now() * 1000), self._last_ms + 1)
        stamp = ""
        for _ in range(9):
            ms, d = divmod(ms, 36)
            stamp = _B36[d] + stamp
        return prefix + stamp + "".join(secrets.choice(_B62) for _ in range(n))


new_id = Ids().new


# -- workloads ------------------------------------------------------------------------

def insert_workload(conn: Connection, row: dict[str, Any]) -> None:
    conn.execute(_INSERT_W, row)


def get_workload(conn: Connection, workload_id: str, owner: str | None = None,
                 include_deleted: bool = False) -> WorkloadRecord | None:
    """The workload, or None if absent, deleted, or (with ``owner``) someone else's."""
    q = _GET_W[(include_deleted, owner is not None)]
    row = conn.execute(q, {"b_id": workload_id, "b_owner": owner}).first()
    return WorkloadRecord.of(row) if row else None


_W_RECORD = [W.c[k] for k in WORKLOAD_RECORD_COLUMNS]


def _get_w(include_deleted: bool, by_owner: bool) -> Any:
    q = select(*_W_RECORD).where(W.c.id == bindparam("b_id"))
    if not include_deleted:
        q = q.where(W.c.deleted_at.is_(None))
    if by_owner:
        q = q.where(W.c.owner == bindparam("b_owner"))
    return q


_GET_W = {(d, o): _get_w(d, o) for d in (False, True) for o in (False, True)}


def list_workloads(conn: Connection, owner: str | None, kind: str | None = None, state: str | None = None,
                   limit: int = 100, after: str | None = None) -> list[WorkloadRecord]:
    q = select(*_W_RECORD).where(W.c.deleted_at.is_(None))
    if owner is not None:
        q = q.where(W.c.owner == owner)
    if kind:
        q = q.where(W.c.kind == kind)
    if state:
        q = q.where(W.c.state == state)
    if after:
        q = q.where(W.c.id > after)
    return [WorkloadRecord.of(r) for r in conn.execute(q.order_by(W.c.id).limit(limit))]


def update_workload(conn: Connection, workload_id: str, values: dict[str, Any],
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


_W_ROW = [W.c[k] for k in WORKLOAD_COLUMNS]  # no name, model or spec: a cycle reads many and needs none


def workloads_in(conn: Connection, region: str, states: Iterable[WorkloadState]) -> list[WorkloadRow]:
    """The region's workloads in ``states``, as a cycle reads them (no ``spec``)."""
    q = select(*_W_ROW).where(W.c.region == region, W.c.state.in_(list(states)))
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
    q = select(*_W_ROW).where(or_(W.c.id.in_(bindparam("ids", expanding=True)),
                                  and_(W.c.region == region, W.c.state.in_(bindparam("states", expanding=True)))))
    return [WorkloadRow.of(r) for r in conn.execute(q, {"ids": list(ids), "states": list(states)})]


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
    for part in _chunks(ids):
        conn.execute(delete(E).where(E.c.workload_id.in_(part)))
        conn.execute(delete(R).where(R.c.workload_id.in_(part)))
        conn.execute(delete(W).where(W.c.id.in_(part)))
    return len(ids)


def list_events(conn: Connection, workload_id: str, limit: int = 1000) -> list[EventRow]:
    q = select(E).where(E.c.workload_id == workload_id).order_by(E.c.id).limit(limit)
    return [EventRow.of(r) for r in conn.execute(q).mappings()]


# -- replicas -------------------------------------------------------------------------

def insert_replica(conn: Connection, row: ReplicaRow) -> None:
    conn.execute(_INSERT_R, row._asdict())


def replicas_of(conn: Connection, workload_ids: Sequence[str], active_only: bool = True) -> list[ReplicaRow]:
    q = _REPLICAS_OF_ACTIVE if active_only else _REPLICAS_OF
    return [ReplicaRow.of(r) for part in _chunks(workload_ids) for r in conn.execute(q, {"ids": part})]


_R_ROW = [R.c[k] for k in REPLICA_COLUMNS]
_REPLICAS_OF = (select(*_R_ROW).where(R.c.workload_id.in_(bindparam("ids", expanding=True)))
                .order_by(R.c.created_at, R.c.id))
_REPLICAS_OF_ACTIVE = _REPLICAS_OF.where(R.c.state.in_(ACTIVE_REPLICA))


_ACTIVE_IN = select(*_R_ROW).where(R.c.region == bindparam("b_region"), R.c.state.in_(ACTIVE_REPLICA))


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


def update_replica(conn: Connection, replica_id: str, values: dict[str, Any],
                   expect_state: Sequence[str] | None = None) -> bool:
    q = update(R).where(R.c.id == replica_id)
    if expect_state is not None:
        q = q.where(R.c.state.in_(list(expect_state)))
    return conn.execute(q.values(**values)).rowcount == 1


# -- usage ----------------------------------------------------------------------------

def open_segment(conn: Connection, replica: ReplicaRow, workload: WorkloadRow, at: float) -> None:
    conn.execute(_INSERT_U, {"workload_id": workload.id, "replica_id": replica.id, "owner": workload.owner,
                             "region": workload.region, "kind": workload.kind,
                             "placed_class": replica.cls, "started_at": at, "ended_at": None})


def close_segment(conn: Connection, replica_id: str, at: float) -> None:
    conn.execute(update(U).where(U.c.replica_id == replica_id, U.c.ended_at.is_(None)).values(ended_at=at))


def segments(conn: Connection, owner: str | None, since: float, until: float,
             region: str | None = None) -> list[dict[str, Any]]:
    """Segments that overlap [since, until)."""
    q = select(U).where(U.c.started_at < until, or_(U.c.ended_at.is_(None), U.c.ended_at > since))
    if owner is not None:
        q = q.where(U.c.owner == owner)
    if region is not None:
        q = q.where(U.c.region == region)
    return [dict(r) for r in conn.execute(q).mappings()]


# -- nodes ----------------------------------------------------------------------------

def nodes_in(conn: Connection, region: str | None = None) -> list[NodeRow]:
    q = select(*(N.c[k] for k in NODE_COLUMNS))
    if region is not None:
        q = q.where(N.c.region == region)
    return [NodeRow(**r) for r in conn.execute(q.order_by(N.c.name)).mappings()]


def replace_nodes(conn: Connection, region: str, rows: Sequence[NodeRow]) -> None:
    conn.execute(delete(N).where(N.c.region == region))
    if rows:
        conn.execute(insert(N), [asdict(r) for r in rows])


# -- api keys -------------------------------------------------------------------------

def insert_key(conn: Connection, row: dict[str, Any]) -> None:
    conn.execute(_INSERT_K, row)


def key_by_digest(conn: Connection, digest: str) -> dict[str, Any] | None:
    row = conn.execute(_KEY_BY_DIGEST, {"b_digest": digest}).mappings().first()
    return dict(row) if row else None


def list_keys(conn: Connection, owner: str | None) -> list[dict[str, Any]]:
    q = select(K).where(K.c.revoked_at.is_(None))
    if owner is not None:
        q = q.where(K.c.owner == owner)
    return [dict(r) for r in conn.execute(q.order_by(K.c.created_at, K.c.id)).mappings()]


def revoke_key(conn: Connection, key_id: str, owner: str | None, at: float) -> bool:
    q = update(K).where(K.c.id == key_id, K.c.revoked_at.is_(None))
    if owner is not None:
        q = q.where(K.c.owner == owner)
    return conn.execute(q.values(revoked_at=at)).rowcount == 1


def count_admin_keys(conn: Connection) -> int:
    rows = conn.execute(select(K.c.scopes).where(K.c.revoked_at.is_(None))).scalars()
    return sum(1 for scopes in rows if "admin" in scopes)


# -- dashboard sessions --------------------------------------------------------------

_S_COLUMNS = [S.c[f.name] for f in fields(SessionRow)]
_LIVE_SESSION = (select(*_S_COLUMNS, K.c.scopes).join(K, K.c.id == S.c.key_id)
                 .where(S.c.id == bindparam("b_id"), S.c.revoked_at.is_(None), K.c.revoked_at.is_(None)))


def insert_session(conn: Connection, row: SessionRow) -> None:
    conn.execute(insert(S), asdict(row))


def live_session(conn: Connection, digest: str) -> tuple[SessionRow, tuple[str, ...]] | None:
    """The session with this digest and its key's scopes, unless it or its key is revoked (the caller
    checks its lifetime and idle timeout: ``SessionRow.live``)."""
    found = conn.execute(_LIVE_SESSION, {"b_id": digest}).first()
    if found is None:
        return None
    *columns, scopes = found
    return SessionRow(*columns), tuple(scopes)


def touch_session(conn: Connection, digest: str, at: float) -> None:
    conn.execute(update(S).where(S.c.id == digest, S.c.revoked_at.is_(None)).values(last_seen_at=at))


def revoke_session(conn: Connection, digest: str, at: float) -> bool:
    q = update(S).where(S.c.id == digest, S.c.revoked_at.is_(None)).values(revoked_at=at)
    return conn.execute(q).rowcount == 1


def revoke_sessions_of_key(conn: Connection, key_id: str, at: float) -> int:
    q = update(S).where(S.c.key_id == key_id, S.c.revoked_at.is_(None)).values(revoked_at=at)
    return conn.execute(q).rowcount


def prune_sessions(conn: Connection, now: float) -> int:
    """Forget the sessions past their lifetime (signed out or not): they can never be used again."""
    return conn.execute(delete(S).where(S.c.expires_at <= now)).rowcount


# -- owners ---------------------------------------------------------------------------

_O_ROW = [c for c in O.c if c.name != "rev"]  # the change stamp is the controller's, not an owner's field


def get_owner(conn: Connection, owner: str) -> dict[str, Any] | None:
    row = conn.execute(select(*_O_ROW).where(O.c.owner == owner)).mappings().first()
    return dict(row) if row else None


def trusted_owners(conn: Connection) -> set[str]:
    """The owners an admin marked trusted; everyone else is untrusted."""
    return set(conn.execute(select(O.c.owner).where(O.c.trusted.is_(True))).scalars())


def owner_quotas(conn: Connection) -> dict[str, dict[str, Any]]:
    """Every owner's quota overrides an admin set (partial dicts, ``tensora.quotas.effective``), in one read."""
    q = select(O.c.owner, O.c.quotas).where(O.c.quotas.is_not(None))
    return {owner: quotas for owner, quotas in conn.execute(q) if quotas}


_HELD = (select(W.c.owner, R.c.workload_id, R.c.slot, R.c.cls).join(W, W.c.id == R.c.workload_id)
         .where(R.c.state.in_(ACTIVE_REPLICA)))


def held_replicas(conn: Connection, owners: Iterable[str] | None = None) -> list[HeldReplica]:
    """Every replica that holds capacity, in every region, with its workload's owner (running quotas);
    with ``owners``, only theirs."""
    if owners is None:
        return [HeldReplica._make(r) for r in conn.execute(_HELD)]
    q = _HELD.where(W.c.owner.in_(bindparam("owners", expanding=True)))
    return [HeldReplica._make(r) for part in _chunks(owners) for r in conn.execute(q, {"owners": part})]


def workload_specs(conn: Connection, ids: Iterable[str]) -> dict[str, dict[str, Any]]:
    """The ``spec`` of each workload in ``ids``: read only for those being started, never for a whole queue."""
    q = select(W.c.id, W.c.spec).where(W.c.id.in_(bindparam("ids", expanding=True)))
    return {wid: spec or {} for wid, spec in conn.execute(q, {"ids": list(ids)})}


def list_owners(conn: Connection) -> list[dict[str, Any]]:
    """The owners the operator has said something of, by name."""
    return [dict(r) for r in conn.execute(select(*_O_ROW).order_by(O.c.owner)).mappings()]


def set_owner(conn: Connection, owner: str, trusted: bool, at: float) -> dict[str, Any]:
    """One upsert (INSERT ... ON CONFLICT (owner) DO UPDATE, which SQLite and PostgreSQL both have),
    so two first sets of a new owner at once both succeed and the later one's flag stays."""
    values = {"owner": owner, "trusted": trusted, "updated_at": at}
    upsert = pg_insert if conn.dialect.name == "postgresql" else sqlite_insert
    conn.execute(upsert(O).values(values)
                 .on_conflict_do_update(index_elements=[O.c.owner], set_={"trusted": trusted, "updated_at": at}))
    return values


def owner_for_update(conn: Connection, owner: str, at: float) -> dict[str, Any]:
    """The owner's row, made if missing (untrusted, no overrides) and locked until the transaction ends
    (PostgreSQL: FOR UPDATE; SQLite's write transactions take turns already), so that two PUTs of
    different fields at once both land: each reads the other's result, never a stale copy."""
    upsert = pg_insert if conn.dialect.name == "postgresql" else sqlite_insert
    conn.execute(upsert(O).values(owner=owner, trusted=False, updated_at=at).on_conflict_do_nothing())
    return dict(conn.execute(select(*_O_ROW).where(O.c.owner == owner).with_for_update()).mappings().one())


def write_owner(conn: Connection, owner: str, values: dict[str, Any]) -> None:
    conn.execute(update(O).where(O.c.owner == owner).values(**values))


def lock_owner_quota(conn: Connection, owner: str) -> None:
    """Until the transaction ends, this owner's creates of keys and workloads wait for this one, so that
    the count against a quota and the insert it allows are one step (two creates at once cannot both take
    the last slot). PostgreSQL: a transaction-scoped advisory lock; SQLite: its writes already take turns."""
    if conn.dialect.name == "postgresql":
        key = int.from_bytes(hashlib.sha256(b"tensora-quota:" + owner.encode()).digest()[:8], "big", signed=True)
        conn.execute(select(func.pg_advisory_xact_lock(key)))


_COUNT_KEYS = select(func.count()).select_from(K).where(K.c.owner == bindparam("b_owner"), K.c.revoked_at.is_(None))
_COUNT_W = select(func.count()).select_from(W).where(W.c.owner == bindparam("b_owner"), W.c.deleted_at.is_(None))


def count_keys(conn: Connection, owner: str) -> int:
    """The owner's live (not revoked) keys."""
    return int(conn.execute(_COUNT_KEYS, {"b_owner": owner}).scalar_one())


def count_workloads(conn: Connection, owner: str) -> int:
    """The owner's workloads not deleted, in any state."""
    return int(conn.execute(_COUNT_W, {"b_owner": owner}).scalar_one())


def holdings(conn: Connection, owners: Sequence[str]) -> dict[str, dict[str, int]]:
    """Per owner: live keys, workloads not deleted, bytes of files (three grouped counts for any number)."""
    out = {o: {"keys": 0, "workloads": 0, "storage_bytes": 0} for o in owners}
    if not owners:
        return out
    names = list(owners)
    for what, q in (
            ("keys", select(K.c.owner, func.count()).where(K.c.owner.in_(names), K.c.revoked_at.is_(None))
             .group_by(K.c.owner)),
            ("workloads", select(W.c.owner, func.count()).where(W.c.owner.in_(names), W.c.deleted_at.is_(None))
             .group_by(W.c.owner)),
            ("storage_bytes", select(F.c.owner, func.sum(F.c.size)).where(F.c.owner.in_(names)).group_by(F.c.owner))):
        for owner, n in conn.execute(q):
            out[owner][what] = int(n or 0)
    return out


# -- gateway: routes and token usage ------------------------------------------------

def gateway_keys(conn: Connection) -> list[dict[str, Any]]:
    """The keys a gateway checks locally (digests only), so it authenticates without the store."""
    q = select(K.c.id, K.c.digest, K.c.owner, K.c.scopes, K.c.rpm, K.c.tpm).where(K.c.revoked_at.is_(None))
    return [dict(r) for r in conn.execute(q.order_by(K.c.id)).mappings()]


_SERVING = (W.c.kind == WorkloadKind.ENDPOINT, W.c.deleted_at.is_(None),
            W.c.state.in_((WorkloadState.STARTING, WorkloadState.RUNNING)))
_ROUTABLE = (R.c.workload_id == W.c.id, R.c.state == ReplicaState.RUNNING, R.c.role == ReplicaRole.PRIMARY,
             R.c.url.is_not(None))


def route_marker(conn: Connection, region: str) -> tuple[Any, ...]:
    """What the gateway's route document is made of, read cheaply: equal markers, equal documents. Never a
    timestamp (two writes in one clock tick, or a write that sets none, would hide): the region's serving
    endpoints with their routable replicas (ids and the few columns the document shows: an endpoint's other
    columns never change while it serves), the keys as counts that every insert or revocation moves (and
    the newest id and the limits' sums, should keys one day be deleted or edited), and the owners' limit
    overrides. No spec, no key digest, no hashing."""
    eps = tuple(map(tuple, conn.execute(_MARKER_EPS, {"b_region": region})))
    return eps, tuple(conn.execute(_MARKER_KEYS).one()), tuple(map(tuple, conn.execute(_MARKER_OWNERS)))


_MARKER_EPS = (select(W.c.id, R.c.id, R.c.url, R.c.cls, R.c.served_model, R.c.slot)
               .select_from(W.outerjoin(R, and_(*_ROUTABLE))).where(W.c.region == bindparam("b_region"), *_SERVING)
               .order_by(W.c.id, R.c.id))
_MARKER_KEYS = select(func.count(), func.count(K.c.revoked_at), func.max(K.c.id), func.sum(K.c.rpm),
                      func.sum(K.c.tpm))
_MARKER_OWNERS = select(O.c.owner, O.c.limits).where(O.c.limits.is_not(None)).order_by(O.c.owner)


def owner_limits(conn: Connection) -> dict[str, dict[str, Any]]:
    """Owners' overrides of the default gateway limits (only owners an admin gave some)."""
    q = select(O.c.owner, O.c.limits).where(O.c.limits.is_not(None))
    return {o: lim for o, lim in conn.execute(q) if lim}


def serving_endpoints(conn: Connection, region: str) -> list[WorkloadRecord]:
    q = select(*_W_RECORD).where(W.c.region == region, *_SERVING).order_by(W.c.id)
    return [WorkloadRecord.of(r) for r in conn.execute(q)]


def insert_token_usage(conn: Connection, rows: list[dict[str, Any]]) -> int:
    """Insert the records not seen before (by id, which the gateway made); returns how many were new.
    ON CONFLICT DO NOTHING: a batch resent while its first send is still being written (the gateway timed
    out) is not an error either."""
    if not rows:
        return 0
    ids = [r["id"] for r in rows]
    seen = set(conn.execute(select(T.c.id).where(T.c.id.in_(ids))).scalars())
    new = [r for r in {r["id"]: r for r in rows}.values() if r["id"] not in seen]
    if new:
        upsert = pg_insert if conn.dialect.name == "postgresql" else sqlite_insert
        conn.execute(upsert(T).on_conflict_do_nothing(index_elements=[T.c.id]), new)
    return len(new)


def token_usage(conn: Connection, owner: str | None, since: float, until: float | None) -> list[dict[str, Any]]:
    cols = (T.c.owner, T.c.endpoint, T.c.product, T.c.model, T.c.served_by)
    q = (select(*cols, func.count().label("requests"), func.sum(T.c.prompt_tokens).label("prompt_tokens"),
                func.sum(T.c.completion_tokens).label("completion_tokens"))
         .where(T.c.at >= since).group_by(*cols).order_by(*cols))
    if until is not None:
        q = q.where(T.c.at < until)
    if owner is not None:
        q = q.where(T.c.owner == owner)
    return [dict(r) for r in conn.execute(q).mappings()]


# -- idempotency ----------------------------------------------------------------------

def claim_idempotency(conn: Connection, row: dict[str, Any]) -> None:
    """Atomic insert of an in-flight claim; raises Conflict (from translate) if the key exists."""
    conn.execute(_INSERT_I, row)


def take_over_expired(conn: Connection, pk: dict[str, Any], row: dict[str, Any], now: float) -> bool:
    """Claim a key whose record has expired (a crashed request, or a response older than 24 h)."""
    q = update(I).where(*(I.c[k] == v for k, v in pk.items()), I.c.expires_at <= now)
    return conn.execute(q.values(**row)).rowcount == 1


def get_idempotency(conn: Connection, pk: dict[str, Any]) -> dict[str, Any] | None:
    row = conn.execute(_GET_I, _pk(pk)).mappings().first()
    return dict(row) if row else None


def complete_idempotency(conn: Connection, pk: dict[str, Any], status: int, body: str, expires_at: float) -> None:
    conn.execute(_COMPLETE_I, {**_pk(pk), "b_status": status, "b_body": body, "b_expires_at": expires_at})


def drop_idempotency(conn: Connection, pk: dict[str, Any]) -> None:
    conn.execute(_DROP_I, _pk(pk))


def expire_idempotency(conn: Connection, now: float) -> int:
    return int(conn.execute(delete(I).where(I.c.expires_at <= now)).rowcount)


# -- owners' recent calls (their per-minute rates) ---------------------------------------

def take_call(conn: Connection, owner: str, action: str, now: float, limit: int, window_s: float) -> float | None:
    """Record one ``action`` call of ``owner`` at ``now`` if it made fewer than ``limit`` in the ``window_s``
    before; None when recorded, else the seconds until its oldest call leaves the window (nothing recorded).
    Under the owner's lock (PostgreSQL; SQLite's writes take turns), so calls at once from several API
    processes cannot all take the last one. Prunes the owner's calls of ``action`` that left the window."""
    if conn.dialect.name == "postgresql":
        key = int.from_bytes(hashlib.sha256(b"tensora-rate:" + owner.encode()).digest()[:8], "big", signed=True)
        conn.execute(select(func.pg_advisory_xact_lock(key)))
    since = now - window_s
    mine = and_(OC.c.owner == owner, OC.c.action == action)
    conn.execute(delete(OC).where(mine, OC.c.at <= since))
    count, oldest = conn.execute(select(func.count(), func.min(OC.c.at)).where(mine, OC.c.at > since)).one()
    if int(count) >= limit:
        return max(0.0, float(oldest) - since)
    conn.execute(insert(OC).values(owner=owner, action=action, at=now))
    return None


def prune_calls(conn: Connection, before: float) -> int:
    """Forget every owner's calls at or before ``before`` (those of owners who stopped calling)."""
    return int(conn.execute(delete(OC).where(OC.c.at <= before)).rowcount)


# -- leases ---------------------------------------------------------------------------

def acquire_lease(conn: Connection, name: str, holder: str, now: float, ttl_s: float) -> bool:
    """Take or renew ``name`` for ``holder`` if free, expired, or already held by it.

    One conditional UPDATE, then an INSERT for a lease never taken; the unique name
    decides a race for the INSERT. Works the same on SQLite and PostgreSQL.
    """
    q = (update(L).where(L.c.name == name, or_(L.c.holder == holder, L.c.expires_at <= now))
         .values(holder=holder, expires_at=now + ttl_s,
                 acquired_at=func.coalesce(_keep_acquired(holder), now)))
    if conn.execute(q).rowcount == 1:
        return True
    exists = conn.execute(select(L.c.name).where(L.c.name == name)).first()
    if exists:
        return False
    conn.execute(insert(L).values(name=name, holder=holder, expires_at=now + ttl_s, acquired_at=now))
    return True


def _keep_acquired(holder: str) -> Any:
    return case((L.c.holder == holder, L.c.acquired_at), else_=None)


def lease_holder(conn: Connection, name: str, now: float) -> str | None:
    row = conn.execute(select(L.c.holder).where(and_(L.c.name == name, L.c.expires_at > now))).first()
    return row[0] if row else None


def release_lease(conn: Connection, name: str, holder: str) -> None:
    conn.execute(delete(L).where(L.c.name == name, L.c.holder == holder))


# -- owner storage --------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class FileRow:
    owner: str
    path: str
    size: int
    sha256: str
    created_at: float


def _file(row: Any) -> FileRow:
    return FileRow(row.owner, row.path, int(row.size), row.sha256, row.created_at)


def lock_owner_files(conn: Connection, owner: str) -> None:
    """Until the transaction ends, this owner's file writes wait for this one: the quota check and
    the write it allows are then one step. PostgreSQL: a transaction-scoped advisory lock on a key
    derived from the owner; SQLite: nothing to do, its write transactions already take turns."""
    if conn.dialect.name == "postgresql":
        key = int.from_bytes(hashlib.sha256(b"tensora-files:" + owner.encode()).digest()[:8], "big", signed=True)
        conn.execute(select(func.pg_advisory_xact_lock(key)))


def storage_used(conn: Connection, owner: str) -> int:
    return int(conn.execute(select(func.coalesce(func.sum(F.c.size), 0)).where(F.c.owner == owner)).scalar_one())


def get_file(conn: Connection, owner: str, path: str) -> FileRow | None:
    row = conn.execute(select(F).where(F.c.owner == owner, F.c.path == path)).first()
    return _file(row) if row else None


def _under(directory: str) -> ColumnElement[bool]:
    """Paths under ``directory/``, compared exactly: not ``LIKE``, which SQLite matches case-insensitively
    (``OK/%`` found ``ok/x``), nor a range, which a PostgreSQL collation may order otherwise."""
    head = directory + "/"
    return func.substr(F.c.path, 1, len(head)) == head


def list_files(conn: Connection, owner: str, prefix: str | None = None) -> list[FileRow]:
    """The owner's files by path; with ``prefix``, the file named so and those under ``prefix/``."""
    q = select(F).where(F.c.owner == owner)
    if prefix is not None:
        q = q.where(or_(F.c.path == prefix, _under(prefix)))
    return sorted((_file(r) for r in conn.execute(q)), key=lambda f: f.path)


def blocking_file(conn: Connection, owner: str, path: str, parents: Sequence[str]) -> str | None:
    """What keeps a file from being written at ``path``: a file at one of its ``parents`` (``tiny`` for
    ``tiny/config.json``), or files under ``path/`` (it is a directory). None when nothing does."""
    under = _under(path)
    where = or_(F.c.path.in_(list(parents)), under) if parents else under
    return conn.execute(select(F.c.path).where(F.c.owner == owner, where).limit(1)).scalar()


def put_file(conn: Connection, row: FileRow) -> bool:
    """Insert or replace the owner's file at ``row.path``; True if it replaced one."""
    replaced = conn.execute(update(F).where(F.c.owner == row.owner, F.c.path == row.path)
                            .values(size=row.size, sha256=row.sha256, created_at=row.created_at)).rowcount == 1
    if not replaced:
        conn.execute(insert(F).values(owner=row.owner, path=row.path, size=row.size, sha256=row.sha256,
                                      created_at=row.created_at))
    return replaced


def reserved(conn: Connection, owner: str, now: float, *, besides: str | None = None) -> int:
    """Bytes the owner's uploads in flight hold (reservations not yet expired), but for ``besides``'s."""
    q = select(func.coalesce(func.sum(UR.c.size), 0)).where(UR.c.owner == owner, UR.c.expires_at > now)
    if besides is not None:
        q = q.where(UR.c.id != besides)
    return int(conn.execute(q).scalar_one())


def reserve(conn: Connection, upload_id: str, owner: str, size: int, now: float, ttl_s: float) -> None:
    """Hold ``size`` bytes of the owner's quota for upload ``upload_id`` until ``now + ttl_s`` (set, or
    changed). The caller checked the room under ``lock_owner_files``; the owner's expired reservations (a
    crashed worker's) are deleted on the way."""
    conn.execute(delete(UR).where(UR.c.owner == owner, UR.c.expires_at <= now))
    expires_at = now + ttl_s
    if conn.execute(update(UR).where(UR.c.id == upload_id)
                    .values(size=size, expires_at=expires_at)).rowcount == 0:
        conn.execute(insert(UR).values(id=upload_id, owner=owner, size=size, expires_at=expires_at))


def unreserve(conn: Connection, upload_id: str) -> None:
    conn.execute(delete(UR).where(UR.c.id == upload_id))


def delete_files(conn: Connection, owner: str, paths: Sequence[str]) -> None:
    if paths:
        conn.execute(delete(F).where(F.c.owner == owner, F.c.path.in_(list(paths))))


# -- sandbox uids ---------------------------------------------------------------------

UID_FIRST, UID_LAST = 100_000, 165_535
"""The default range of sandbox uids (a block above the usual 65536 host ids)."""


class UidsExhausted(TensoraError):
    """Every uid of the configured range is held by an owner."""


def owner_uid(conn: Connection, owner: str, now: float, *, first: int = UID_FIRST, last: int = UID_LAST,
              avoid: Iterable[int] = ()) -> int:
    """The owner's sandbox uid (its gid is the same number), allocated on first call in a write
    transaction and recorded; the same owner always gets the same one.

    Never 0, never this process's uid or gid, nor any in ``avoid``. Allocation is the next free
    number above the highest taken in ``first..last``, inserted with ON CONFLICT DO NOTHING (SQLite
    and PostgreSQL both have it) and read back: a concurrent first call for the same owner waits
    on the other's row and reads its uid; one for another owner that took the same number sends
    this one round again to the next. UidsExhausted when the range is full.
    """
    held = _UID_OF.where(UID.c.owner == owner)
    got = conn.execute(held).scalar()
    if got is not None:
        return int(got)
    if not 1 <= first <= last:
        raise ValueError(f"the sandbox uid range {first}..{last} must be within 1.. and not empty")
    never = {0, os.getuid(), os.getgid(), *avoid}
    upsert = pg_insert if conn.dialect.name == "postgresql" else sqlite_insert
    for _ in range(100):
        top = conn.execute(select(func.max(UID.c.uid)).where(UID.c.uid.between(first, last))).scalar()
        uid = first if top is None else int(top) + 1
        while uid in never:
            uid += 1
        if uid > last:
            count = conn.execute(select(func.count()).select_from(UID).where(UID.c.uid.between(first, last)))
            raise UidsExhausted(f"no free sandbox uid for owner {owner!r}: {count.scalar_one()} owners hold the "
                                f"range {first}..{last}; widen it (setting sandbox_uids)")
        conn.execute(upsert(UID).values(owner=owner, uid=uid, created_at=now).on_conflict_do_nothing())
        got = conn.execute(held).scalar()
        if got is not None:
            return int(got)
    raise Conflict(f"could not allocate a sandbox uid for owner {owner!r}: too many owners at once; retry")


_UID_OF = select(UID.c.uid)


# -- changes (migration 0010) ---------------------------------------------------------

CHUNK = 10_000
"""Ids bound in one statement at most (SQLite allows 32766 variables)."""


def _chunks(items: Iterable[str]) -> Iterator[list[str]]:
    items = list(items)
    for i in range(0, len(items), CHUNK):
        yield items[i:i + CHUNK]


class Moved(NamedTuple):
    """What changed since a watermark, as one read answers it."""

    mark: int
    """The watermark now: every change with a lower ``rev`` was visible when it was read."""
    rows: bool
    """A workload or replica of the region changed, or a replica of any region (an owner's quota use)."""
    quotas: bool
    """An owner's quota overrides changed."""


def _mark(conn: Connection) -> Any:
    """The watermark as a column: PostgreSQL, the reader's snapshot's xmin (rows carry transaction ids);
    SQLite, the counter's next value (migration 0010's docstring says why each is sound)."""
    if conn.dialect.name == "postgresql":
        return literal_column("pg_snapshot_xmin(pg_current_snapshot())::text::bigint", BigInteger)
    return select(RV.c.rev + 1).where(RV.c.id == 1).scalar_subquery()


def watermark(conn: Connection) -> int:
    """The watermark now (read it before the rows it covers, in the same transaction)."""
    return int(conn.execute(select(_mark(conn))).scalar_one())


def moved(conn: Connection, region: str, since: int) -> Moved:
    """The watermark now and what changed at or after ``since`` (an earlier watermark), in one statement
    that reads an index entry per table: what a cycle with nothing new costs."""
    rows = or_(exists().where(W.c.region == region, W.c.rev >= since), exists().where(R.c.rev >= since))
    q = select(_mark(conn), rows, exists().where(O.c.rev >= since))
    mark, changed, quotas = conn.execute(q).one()
    return Moved(int(mark), bool(changed), bool(quotas))


def changed_workloads(conn: Connection, region: str, since: int) -> set[str]:
    """The region's workloads changed at or after ``since``, or whose replicas did."""
    q = union(select(W.c.id).where(W.c.region == region, W.c.rev >= since),
              select(R.c.workload_id).where(R.c.region == region, R.c.rev >= since))
    return set(conn.execute(q).scalars())


def owners_of_changed_replicas(conn: Connection, since: int) -> set[str]:
    """The owners of replicas changed at or after ``since``, in every region (their quota use changed)."""
    q = select(W.c.owner).distinct().join(R, R.c.workload_id == W.c.id).where(R.c.rev >= since)
    return set(conn.execute(q).scalars())


_W_BY_ID = select(*_W_ROW).where(W.c.id.in_(bindparam("ids", expanding=True)))


def workloads_by_id(conn: Connection, ids: Iterable[str]) -> list[WorkloadRow]:
    """The workloads named (deleted ones too), as a cycle reads them."""
    return [WorkloadRow.of(r) for part in _chunks(ids) for r in conn.execute(_W_BY_ID, {"ids": part})]
