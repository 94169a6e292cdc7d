"""Repositories: the reads and writes the API and the controller make, on a Connection
inside a transaction from ``Database.write()``/``read()``. No business rules here.
"""

from __future__ import annotations

import secrets
import string
from collections.abc import Iterable, Sequence
from typing import Any, cast

from sqlalchemy import Connection, Table, and_, case, delete, func, insert, or_, select, update

from tensora.store.models import (
    ApiKey,
    Event,
    IdempotencyRecord,
    Lease,
    Node,
    Replica,
    UsageSegment,
    Workload,
)

W = cast(Table, Workload.__table__)
R = cast(Table, Replica.__table__)
E = cast(Table, Event.__table__)
U = cast(Table, UsageSegment.__table__)
N = cast(Table, Node.__table__)
K = cast(Table, ApiKey.__table__)
I = cast(Table, IdempotencyRecord.__table__)  # noqa: E741
L = cast(Table, Lease.__table__)

_B62 = string.digits + string.ascii_letters
ACTIVE_REPLICA = ("pending", "starting", "running", "stopping")
"""Replica states that hold capacity. ``pending``: written, not yet handed to the driver."""


def new_id(prefix: str, n: int = 14) -> str:
    return prefix + "".join(secrets.choice(_B62) for _ in range(n))


# -- workloads ------------------------------------------------------------------------

def insert_workload(conn: Connection, row: dict[str, Any]) -> None:
    conn.execute(insert(W).values(**row))


def get_workload(conn: Connection, workload_id: str, owner: str | None = None,
                 include_deleted: bool = False) -> dict[str, Any] | None:
    """The workload, or None if absent, deleted, or (with ``owner``) someone else's."""
    q = select(W).where(W.c.id == workload_id)
    if not include_deleted:
        q = q.where(W.c.deleted_at.is_(None))
    if owner is not None:
        q = q.where(W.c.owner == owner)
    row = conn.execute(q).mappings().first()
    return dict(row) if row else None


def list_workloads(conn: Connection, owner: str | None, kind: str | None = None, state: str | None = None,
                   limit: int = 100, after: str | None = None) -> list[dict[str, Any]]:
    q = select(W).where(W.c.deleted_at.is_(None))
    if owner is not None:
        q = q.where(W.c.owner == owner)
    if kind:
        q = q.where(W.c.kind == kind)
    if state:
        q = q.where(W.c.state == state)
    if after:
        q = q.where(W.c.id > after)
    return [dict(r) for r in conn.execute(q.order_by(W.c.id).limit(limit)).mappings()]


def update_workload(conn: Connection, workload_id: str, values: dict[str, Any],
                    expect_state: str | Sequence[str] | None = None) -> bool:
    """Update a workload; with ``expect_state``, only if it is still in that state (True if it was)."""
    q = update(W).where(W.c.id == workload_id)
    if isinstance(expect_state, str):
        q = q.where(W.c.state == expect_state)
    elif expect_state is not None:
        q = q.where(W.c.state.in_(list(expect_state)))
    return conn.execute(q.values(**values)).rowcount == 1


def workloads_in(conn: Connection, region: str, states: Iterable[str]) -> list[dict[str, Any]]:
    q = select(W).where(W.c.region == region, W.c.state.in_(list(states)))
    return [dict(r) for r in conn.execute(q).mappings()]


def add_event(conn: Connection, workload_id: str, at: float, type_: str, reason: str,
              from_state: str | None = None, to_state: str | None = None) -> None:
    conn.execute(insert(E).values(workload_id=workload_id, at=at, type=type_, reason=reason,
                                  from_state=from_state, to_state=to_state))


def add_events(conn: Connection, rows: list[dict[str, Any]]) -> None:
    if rows:
        conn.execute(insert(E), rows)


def list_events(conn: Connection, workload_id: str, limit: int = 1000) -> list[dict[str, Any]]:
    q = select(E).where(E.c.workload_id == workload_id).order_by(E.c.id).limit(limit)
    return [dict(r) for r in conn.execute(q).mappings()]


# -- replicas -------------------------------------------------------------------------

def insert_replica(conn: Connection, row: dict[str, Any]) -> None:
    conn.execute(insert(R).values(**row))


def replicas_of(conn: Connection, workload_ids: Sequence[str], active_only: bool = True) -> list[dict[str, Any]]:
    if not workload_ids:
        return []
    q = select(R).where(R.c.workload_id.in_(list(workload_ids)))
    if active_only:
        q = q.where(R.c.state.in_(ACTIVE_REPLICA))
    return [dict(r) for r in conn.execute(q.order_by(R.c.created_at, R.c.id)).mappings()]


def active_replicas(conn: Connection, region: str) -> list[dict[str, Any]]:
    q = select(R).where(R.c.region == region, R.c.state.in_(ACTIVE_REPLICA))
    return [dict(r) for r in conn.execute(q).mappings()]


def update_replica(conn: Connection, replica_id: str, values: dict[str, Any],
                   expect_state: Sequence[str] | None = None) -> bool:
    q = update(R).where(R.c.id == replica_id)
    if expect_state is not None:
        q = q.where(R.c.state.in_(list(expect_state)))
    return conn.execute(q.values(**values)).rowcount == 1


# -- usage ----------------------------------------------------------------------------

def open_segment(conn: Connection, replica: dict[str, Any], workload: dict[str, Any], at: float) -> None:
    conn.execute(insert(U).values(workload_id=workload["id"], replica_id=replica["id"], owner=workload["owner"],
                                  region=workload["region"], kind=workload["kind"], placed_class=replica["cls"],
                                  started_at=at, ended_at=None))


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

def nodes_in(conn: Connection, region: str | None = None) -> list[dict[str, Any]]:
    q = select(N)
    if region is not None:
        q = q.where(N.c.region == region)
    return [dict(r) for r in conn.execute(q.order_by(N.c.name)).mappings()]


def replace_nodes(conn: Connection, region: str, rows: list[dict[str, Any]]) -> None:
    conn.execute(delete(N).where(N.c.region == region))
    if rows:
        conn.execute(insert(N), rows)


# -- api keys -------------------------------------------------------------------------

def insert_key(conn: Connection, row: dict[str, Any]) -> None:
    conn.execute(insert(K).values(**row))


def key_by_digest(conn: Connection, digest: str) -> dict[str, Any] | None:
    row = conn.execute(select(K).where(K.c.digest == digest)).mappings().first()
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


# -- idempotency ----------------------------------------------------------------------

def claim_idempotency(conn: Connection, row: dict[str, Any]) -> None:
    """Atomic insert of an in-flight claim; raises Conflict (from translate) if the key exists."""
    conn.execute(insert(I).values(**row))


def take_over_expired(conn: Connection, pk: dict[str, Any], row: dict[str, Any], now: float) -> bool:
    """Claim a key whose record has expired (a crashed request, or a response older than 24 h)."""
    q = update(I).where(*(I.c[k] == v for k, v in pk.items()), I.c.expires_at <= now)
    return conn.execute(q.values(**row)).rowcount == 1


def get_idempotency(conn: Connection, pk: dict[str, Any]) -> dict[str, Any] | None:
    row = conn.execute(select(I).where(*(I.c[k] == v for k, v in pk.items()))).mappings().first()
    return dict(row) if row else None


def complete_idempotency(conn: Connection, pk: dict[str, Any], status: int, body: str, expires_at: float) -> None:
    conn.execute(update(I).where(*(I.c[k] == v for k, v in pk.items()))
                 .values(state="done", status=status, body=body, expires_at=expires_at))


def drop_idempotency(conn: Connection, pk: dict[str, Any]) -> None:
    conn.execute(delete(I).where(*(I.c[k] == v for k, v in pk.items())))


def expire_idempotency(conn: Connection, now: float) -> int:
    return int(conn.execute(delete(I).where(I.c.expires_at <= now)).rowcount)


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
