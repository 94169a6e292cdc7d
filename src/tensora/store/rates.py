"""Owners' recent calls, counted for their per-minute rates."""

from __future__ import annotations

from sqlalchemy import Connection, and_, delete, func, insert, select

from tensora.store.tables import OC, lock_owner


def take_call(conn: Connection, owner: str, action: str, now: float, limit: int, window_s: float) -> float | None:
    """Record one ``action`` call of ``owner`` at ``now`` if it made fewer than ``limit`` in the ``window_s``
    before; None when recorded, else the seconds until its oldest call leaves the window (nothing recorded).
    Under the owner's lock (PostgreSQL; SQLite's writes take turns), so calls at once from several API
    processes cannot all take the last one. Prunes the owner's calls of ``action`` that left the window."""
    lock_owner(conn, b"tensora-rate:", owner)
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
