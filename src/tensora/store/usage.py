"""Usage: the segments a replica held capacity (GPU time), and the gateway's token counts."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import fields
from typing import NamedTuple

from sqlalchemy import Connection, func, insert, or_, select, update

from tensora.store.rows import ReplicaRow, SegmentRow, WorkloadRow
from tensora.store.tables import T, U, Values, upsert


class TokenTotals(NamedTuple):
    """The tokens the gateways served, summed for one (owner, endpoint, product, model, served_by)."""

    owner: str
    endpoint: str
    product: str
    model: str
    served_by: str
    requests: int
    prompt_tokens: int
    completion_tokens: int


_INSERT_U = insert(U)
_SEGMENT = [U.c[f.name] for f in fields(SegmentRow)]


def open_segment(conn: Connection, replica: ReplicaRow, workload: WorkloadRow, at: float) -> None:
    conn.execute(_INSERT_U, {"workload_id": workload.id, "replica_id": replica.id, "owner": workload.owner,
                             "region": workload.region, "kind": workload.kind,
                             "placed_class": replica.cls, "started_at": at, "ended_at": None})


def close_segment(conn: Connection, replica_id: str, at: float) -> None:
    conn.execute(update(U).where(U.c.replica_id == replica_id, U.c.ended_at.is_(None)).values(ended_at=at))


def segments(conn: Connection, owner: str | None, since: float, until: float,
             region: str | None = None) -> list[SegmentRow]:
    """Segments that overlap [since, until)."""
    q = select(*_SEGMENT).where(U.c.started_at < until, or_(U.c.ended_at.is_(None), U.c.ended_at > since))
    if owner is not None:
        q = q.where(U.c.owner == owner)
    if region is not None:
        q = q.where(U.c.region == region)
    return [SegmentRow(*r) for r in conn.execute(q)]


def insert_token_usage(conn: Connection, rows: Sequence[Values]) -> int:
    """Insert the records not seen before (by id, which the gateway made); returns how many were new.
    ON CONFLICT DO NOTHING: a batch resent while its first send is still being written (the gateway timed
    out) is not an error either."""
    if not rows:
        return 0
    ids = [r["id"] for r in rows]
    seen = set(conn.execute(select(T.c.id).where(T.c.id.in_(ids))).scalars())
    new = [r for r in {r["id"]: r for r in rows}.values() if r["id"] not in seen]
    if new:
        conn.execute(upsert(conn)(T).on_conflict_do_nothing(index_elements=[T.c.id]), new)
    return len(new)


def token_usage(conn: Connection, owner: str | None, since: float, until: float | None) -> list[TokenTotals]:
    """The tokens served at or after ``since`` (and before ``until``), summed by owner, endpoint, product, model
    and what served them."""
    cols = (T.c.owner, T.c.endpoint, T.c.product, T.c.model, T.c.served_by)
    q = (select(*cols, func.count().label("requests"), func.sum(T.c.prompt_tokens).label("prompt_tokens"),
                func.sum(T.c.completion_tokens).label("completion_tokens"))
         .where(T.c.at >= since).group_by(*cols).order_by(*cols))
    if until is not None:
        q = q.where(T.c.at < until)
    if owner is not None:
        q = q.where(T.c.owner == owner)
    return [TokenTotals._make(r) for r in conn.execute(q)]
