"""What the gateway's route document is read from: the serving endpoints and a cheap marker of them."""

from __future__ import annotations

from typing import Any

from sqlalchemy import Connection, and_, bindparam, func, select

from tensora.placement.kinds import ReplicaRole, ReplicaState, WorkloadKind, WorkloadState
from tensora.store.rows import WorkloadRecord
from tensora.store.tables import W_RECORD, K, O, R, W

_SERVING = (W.c.kind == WorkloadKind.ENDPOINT, W.c.deleted_at.is_(None),
            W.c.state.in_((WorkloadState.STARTING, WorkloadState.RUNNING)))


_ROUTABLE = (R.c.workload_id == W.c.id, R.c.state == ReplicaState.RUNNING, R.c.role == ReplicaRole.PRIMARY,
             R.c.url.is_not(None))


def route_marker(conn: Connection, region: str) -> tuple[Any, ...]:
    """What the gateway's route document is made of, read cheaply: equal markers, equal documents. Never a
    timestamp (two writes in one clock tick, or a write that sets none, would hide): the region's serving
    endpoints with their routable replicas (ids and the few columns the document shows: an endpoint's other
    columns never change while it serves), the keys as counts that every insert or revocation moves (and
    the newest id and the limits' sums, should keys one day be deleted or edited), and the owners' limit
    overrides. No spec, no key digest, no hashing."""
    eps = tuple(map(tuple, conn.execute(_MARKER_EPS, {"b_region": region})))
    return eps, tuple(conn.execute(_MARKER_KEYS).one()), tuple(map(tuple, conn.execute(_MARKER_OWNERS)))


_MARKER_EPS = (select(W.c.id, R.c.id, R.c.url, R.c.cls, R.c.served_model, R.c.slot)
               .select_from(W.outerjoin(R, and_(*_ROUTABLE))).where(W.c.region == bindparam("b_region"), *_SERVING)
               .order_by(W.c.id, R.c.id))


_MARKER_KEYS = select(func.count(), func.count(K.c.revoked_at), func.max(K.c.id), func.sum(K.c.rpm),
                      func.sum(K.c.tpm))


_MARKER_OWNERS = select(O.c.owner, O.c.limits).where(O.c.limits.is_not(None)).order_by(O.c.owner)


def serving_endpoints(conn: Connection, region: str) -> list[WorkloadRecord]:
    q = select(*W_RECORD).where(W.c.region == region, *_SERVING).order_by(W.c.id)
    return [WorkloadRecord.of(r) for r in conn.execute(q)]
