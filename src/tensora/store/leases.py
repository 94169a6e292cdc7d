"""Leases: which process holds a named role (a region's controller) until when."""

from __future__ import annotations

from typing import Any

from sqlalchemy import Connection, and_, case, delete, func, insert, or_, select, update

from tensora.store.tables import L


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
