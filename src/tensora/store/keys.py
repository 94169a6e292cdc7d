"""API keys: stored as digests, revoked rather than deleted."""

from __future__ import annotations

from typing import Any

from sqlalchemy import Connection, bindparam, func, insert, select, update

from tensora.store.tables import K

_KEY_BY_DIGEST = select(K).where(K.c.digest == bindparam("b_digest"))

_INSERT_K = insert(K)


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


_COUNT_KEYS = select(func.count()).select_from(K).where(K.c.owner == bindparam("b_owner"), K.c.revoked_at.is_(None))


def count_keys(conn: Connection, owner: str) -> int:
    """The owner's live (not revoked) keys."""
    return int(conn.execute(_COUNT_KEYS, {"b_owner": owner}).scalar_one())


def gateway_keys(conn: Connection) -> list[dict[str, Any]]:
    """The keys a gateway checks locally (digests only), so it authenticates without the store."""
    q = select(K.c.id, K.c.digest, K.c.owner, K.c.scopes, K.c.rpm, K.c.tpm).where(K.c.revoked_at.is_(None))
    return [dict(r) for r in conn.execute(q.order_by(K.c.id)).mappings()]
