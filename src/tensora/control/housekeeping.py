"""Housekeeping: what a leader does every so many cycles, in the cycle's fenced write transaction.

Forgets idempotency records past their expiry, owners' calls past the rates' window and, after the
retention, deleted workloads (their rows, their replicas' rows and their events, once their storage was
given back; their usage stays), while the driver forgets its ended replicas after the transaction. Gives
back the storage of deleted workloads whose replicas are all gone (a notebook's home outlives its replicas,
so a restart keeps its files), round-robin across owners: one owner's churn cannot delay another's. A
release is recorded once the driver did it, in the next cycle's transaction: a crash in between only gives
back again, and the driver's ``release`` is idempotent.
"""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy import Connection

from tensora.config.quotas import RATE_WINDOW_S
from tensora.store import events as events_repo
from tensora.store import idempotency as idempotency_repo
from tensora.store import rates as rates_repo
from tensora.store import workloads as workloads_repo

EXPIRE_IDEMPOTENCY_EVERY = 30
"""Cycles between sweeps of expired idempotency records: about a minute at the default tick. A claim
takes over an expired record by itself (``store.idempotency.take_over_expired``): the sweep only bounds the table."""

PRUNE_EVERY = 300
"""Cycles between prunes of what outlived its retention (about 10 min at the default tick): deleted workloads
(at most 5,000 a round: 30,000 an hour), their events, the driver's dirs of ended replicas."""

RETENTION_S = 7 * 86400.0
"""How long a deleted workload (its row, replicas and events) and the driver's record of an ended replica are
kept (``retention_s`` in the settings)."""

RELEASE_EVERY = 15
"""Cycles between looks for deleted workloads' storage to give back (a query over deleted workloads:
rare work that need not cost every cycle); each look takes at most 50, every owner's oldest first in turn."""


def due(cycle: int, every: int) -> bool:
    """Cycle 1 (the first a leader runs) and every ``every`` cycles after it."""
    return (cycle - 1) % every == 0


def housekeep(conn: Connection, cycle: int, now: float, region: str, released: Sequence[str],
              release_every: int = RELEASE_EVERY, retention_s: float = RETENTION_S,
              prune_every: int = PRUNE_EVERY) -> list[str]:
    """Sweep and record ``released`` (given back since the last cycle); the workloads to give back now."""
    if due(cycle, EXPIRE_IDEMPOTENCY_EVERY):
        idempotency_repo.expire_idempotency(conn, now)
        rates_repo.prune_calls(conn, now - RATE_WINDOW_S)
    if due(cycle, prune_every):
        events_repo.prune_events(conn, now - retention_s)  # those of workloads whose storage is not given back yet too
        workloads_repo.purge_workloads(conn, now - retention_s)
    workloads_repo.mark_released(conn, released, now)
    return workloads_repo.unreleased(conn, region) if due(cycle, release_every) else []
