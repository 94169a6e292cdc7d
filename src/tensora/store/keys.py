"""API keys: stored as digests, revoked rather than deleted."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, NamedTuple

from sqlalchemy import Connection, bindparam, func, insert, select, update

from tensora.store.tables import K


@dataclass(frozen=True, slots=True)
class KeyRow:
    """An API key (``api_keys``): only the SHA-256 of its secret is kept."""

    id: str
    digest: str
    hint: str
    owner: str
    name: str
    scopes: list[str]
    created_at: float
    revoked_at: float | None = None
    rpm: int | None = None
    """Requests per minute at the gateway (None: the owner's limit)."""
    tpm: int | None = None
    """Tokens per minute at the gateway (None: the owner's limit)."""

    @classmethod
    def of(cls, row: Any) -> KeyRow:
        return cls(row.id, row.digest, row.hint, row.owner, row.name, list(row.scopes), row.created_at,
                   row.revoked_at, row.rpm, row.tpm)


class GatewayKey(NamedTuple):
    """What a gateway checks of a live key, locally: never its secret, only the digest."""

    id: str
    digest: str
    owner: str
    scopes: list[str]
    rpm: int | None
    tpm: int | None


_INSERT_K = insert(K)
_KEY_BY_DIGEST = select(K).where(K.c.digest == bindparam("b_digest"))
_COUNT_KEYS = select(func.count()).select_from(K).where(K.c.owner == bindparam("b_owner"), K.c.revoked_at.is_(None))


def insert_key(conn: Connection, row: KeyRow) -> None:
    conn.execute(_INSERT_K, asdict(row))


def key_by_digest(conn: Connection, digest: str) -> KeyRow | None:
    row = conn.execute(_KEY_BY_DIGEST, {"b_digest": digest}).first()
    return KeyRow.of(row) if row else None


def list_keys(conn: Connection, owner: str | None) -> list[KeyRow]:
    q = select(K).where(K.c.revoked_at.is_(None))
    if owner is not None:
        q = q.where(K.c.owner == owner)
    return [KeyRow.of(r) for r in conn.execute(q.order_by(K.c.created_at, K.c.id))]


def revoke_key(conn: Connection, key_id: str, owner: str | None, at: float) -> bool:
    q = update(K).where(K.c.id == key_id, K.c.revoked_at.is_(None))
    if owner is not None:
        q = q.where(K.c.owner == owner)
    return conn.execute(q.values(revoked_at=at)).rowcount == 1


def count_admin_keys(conn: Connection) -> int:
    rows = conn.execute(select(K.c.scopes).where(K.c.revoked_at.is_(None))).scalars()
    return sum(1 for scopes in rows if "admin" in scopes)


def count_keys(conn: Connection, owner: str) -> int:
    """The owner's live (not revoked) keys."""
    return int(conn.execute(_COUNT_KEYS, {"b_owner": owner}).scalar_one())


def gateway_keys(conn: Connection) -> list[GatewayKey]:
    """The keys a gateway checks locally (digests only), so it authenticates without the store."""
    q = select(K.c.id, K.c.digest, K.c.owner, K.c.scopes, K.c.rpm, K.c.tpm).where(K.c.revoked_at.is_(None))
    return [GatewayKey._make(r) for r in conn.execute(q.order_by(K.c.id))]
