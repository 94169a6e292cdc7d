"""Nodes as a region's controller last observed them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict

from sqlalchemy import Connection, delete, insert, select

from tensora.store.rows import NODE_COLUMNS, NodeRow
from tensora.store.tables import N


def nodes_in(conn: Connection, region: str | None = None) -> list[NodeRow]:
    q = select(*(N.c[k] for k in NODE_COLUMNS))
    if region is not None:
        q = q.where(N.c.region == region)
    return [NodeRow(**r) for r in conn.execute(q.order_by(N.c.name)).mappings()]


def replace_nodes(conn: Connection, region: str, rows: Sequence[NodeRow]) -> None:
    conn.execute(delete(N).where(N.c.region == region))
    if rows:
        conn.execute(insert(N), [asdict(r) for r in rows])
