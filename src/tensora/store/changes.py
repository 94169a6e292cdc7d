"""Changes since a watermark (migration 0010): what a cycle with nothing new reads, and no more."""

from __future__ import annotations

from typing import Any, NamedTuple

from sqlalchemy import BigInteger, Connection, exists, literal_column, or_, select, union

from tensora.store.tables import RV, O, R, W


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
