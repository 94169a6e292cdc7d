"""What every repository module of the store shares: the tables, the column lists the typed rows are read
from, and the few helpers that differ between SQLite and PostgreSQL.

The store's reads and writes are one module per aggregate (``workloads`` with their replicas, ``events``,
``usage``, ``nodes``, ``keys``, ``sessions``, ``owners``, ``uids``, ``idempotency``, ``rates``, ``leases``,
``files``, ``changes``, ``routes``): plain functions on a ``Connection`` inside a transaction from
``Database.write()``/``read()``, no business rules, typed rows out (``rows`` holds those a pure step of the
controller reads; the others are defined beside their queries). A new aggregate is a new module of that shape.

Statements run often are built once, with bound parameters, so that SQLAlchemy reuses their compiled form.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, cast

from sqlalchemy import Connection, Table, func, select
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert

from tensora.placement.kinds import HOLDING
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
from tensora.store.rows import REPLICA_COLUMNS, WORKLOAD_COLUMNS, WORKLOAD_RECORD_COLUMNS

Values = Mapping[str, object]
"""Column values by column name: a row to insert, or the columns an update sets."""

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

W_ROW = [W.c[k] for k in WORKLOAD_COLUMNS]
"""A workload as a cycle reads it (``WorkloadRow``): no name, model or spec, which a cycle reads many of and needs
none of."""
W_RECORD = [W.c[k] for k in WORKLOAD_RECORD_COLUMNS]
"""A whole workload (``WorkloadRecord``), as the API shows one."""
R_ROW = [R.c[k] for k in REPLICA_COLUMNS]
"""A replica (``ReplicaRow``)."""

ACTIVE_REPLICA = HOLDING
"""Replica states that hold capacity: recorded ``starting`` before the driver is told (a crash between
the two is redone by the next cycle), ``running``, and ``stopping`` until the driver says it stopped."""

CHUNK = 10_000
"""Ids bound in one statement at most (SQLite allows 32766 variables)."""


def chunks(items: Iterable[str]) -> Iterator[list[str]]:
    """``items`` in lists of at most ``CHUNK``, one statement each."""
    items = list(items)
    for i in range(0, len(items), CHUNK):
        yield items[i:i + CHUNK]


def upsert(conn: Connection) -> Callable[..., Any]:
    """The dialect's ``insert`` with ON CONFLICT (SQLite and PostgreSQL both have it, each its own construct)."""
    return pg_insert if conn.dialect.name == "postgresql" else sqlite_insert


def lock_owner(conn: Connection, namespace: bytes, owner: str) -> None:
    """Until the transaction ends, the next caller for the same ``namespace`` and ``owner`` waits for this one.
    PostgreSQL: a transaction-scoped advisory lock on a key derived from both; SQLite: nothing to do, its write
    transactions already take turns."""
    if conn.dialect.name == "postgresql":
        key = int.from_bytes(hashlib.sha256(namespace + owner.encode()).digest()[:8], "big", signed=True)
        conn.execute(select(func.pg_advisory_xact_lock(key)))
