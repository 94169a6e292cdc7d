"""Idempotency records: a request's claim on its key, then the response kept for its retries.

A record is named by its key (``IdempotencyKey``'s four columns, as a mapping: ``key_id``, ``method``, ``path``,
``key``)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields

from sqlalchemy import Connection, and_, bindparam, delete, insert, select, update

from tensora.store.tables import I, Values

IdempotencyKey = Mapping[str, str]
"""A record's primary key by column: ``key_id`` (the calling API key's id), ``method``, ``path``, ``key``."""


@dataclass(frozen=True, slots=True)
class IdempotencyRow:
    """One request's claim on its Idempotency-Key (``state`` in_flight), then its response (``state`` done)."""

    key_id: str
    method: str
    path: str
    key: str
    fingerprint: str
    state: str
    status: int | None
    body: str | None
    created_at: float
    expires_at: float


_PK_I = and_(I.c.key_id == bindparam("k_key_id"), I.c.method == bindparam("k_method"),
             I.c.path == bindparam("k_path"), I.c.key == bindparam("k_key"))
_INSERT_I = insert(I)
_COMPLETE_I = update(I).where(_PK_I).values(state="done", status=bindparam("b_status"), body=bindparam("b_body"),
                                            expires_at=bindparam("b_expires_at"))
_GET_I = select(*(I.c[f.name] for f in fields(IdempotencyRow))).where(_PK_I)
_DROP_I = delete(I).where(_PK_I)


def _pk(pk: IdempotencyKey) -> dict[str, str]:
    return {"k_" + k: v for k, v in pk.items()}


def claim_idempotency(conn: Connection, row: Values) -> None:
    """Atomic insert of an in-flight claim; raises Conflict (from translate) if the key exists."""
    conn.execute(_INSERT_I, row)


def take_over_expired(conn: Connection, pk: IdempotencyKey, row: Values, now: float) -> bool:
    """Claim a key whose record has expired (a crashed request, or a response older than 24 h)."""
    q = update(I).where(*(I.c[k] == v for k, v in pk.items()), I.c.expires_at <= now)
    return conn.execute(q.values(**row)).rowcount == 1


def get_idempotency(conn: Connection, pk: IdempotencyKey) -> IdempotencyRow | None:
    row = conn.execute(_GET_I, _pk(pk)).first()
    return IdempotencyRow(*row) if row else None


def complete_idempotency(conn: Connection, pk: IdempotencyKey, status: int, body: str, expires_at: float) -> None:
    conn.execute(_COMPLETE_I, {**_pk(pk), "b_status": status, "b_body": body, "b_expires_at": expires_at})


def drop_idempotency(conn: Connection, pk: IdempotencyKey) -> None:
    conn.execute(_DROP_I, _pk(pk))


def expire_idempotency(conn: Connection, now: float) -> int:
    return int(conn.execute(delete(I).where(I.c.expires_at <= now)).rowcount)
