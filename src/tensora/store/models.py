"""The tables. Alembic migrations (``migrations/versions``) create them; a test checks that
the migrations and these models agree.

Times are float seconds since the epoch (UTC), the same as ``Clock.now()``; JSON columns
hold lists and dicts as given. No table holds a price: Tensora accounts, it does not bill.
"""

from __future__ import annotations

from typing import Any, ClassVar

from sqlalchemy import JSON, BigInteger, Boolean, Float, ForeignKey, Index, Integer, String, Text
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column


class Base(DeclarativeBase):
    type_annotation_map: ClassVar[dict[Any, Any]] = {dict[str, Any]: JSON, list[str]: JSON, list[Any]: JSON}


class Workload(Base):
    """A notebook, VM or endpoint. ``gpu_class`` is what was asked for (= ``requested_class``)."""

    __tablename__ = "workloads"

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    owner: Mapped[str] = mapped_column(String(128), index=True)
    kind: Mapped[str] = mapped_column(String(16))
    name: Mapped[str] = mapped_column(String(63))
    region: Mapped[str] = mapped_column(String(63))
    gpu_class: Mapped[str] = mapped_column(String(63))
    requested_class: Mapped[str] = mapped_column(String(63))
    placed_class: Mapped[str | None] = mapped_column(String(63), nullable=True)
    fallback: Mapped[list[str]] = mapped_column()
    fallback_after_s: Mapped[float] = mapped_column(Float)
    placement: Mapped[str] = mapped_column(String(16), default="policy")  # "requested": no fallback this time
    state: Mapped[str] = mapped_column(String(16))
    reason: Mapped[str] = mapped_column(Text, default="")
    fallback_eligible_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    restart_available: Mapped[bool] = mapped_column(Boolean, default=False)
    restart_reason: Mapped[str] = mapped_column(Text, default="")
    replicas: Mapped[int] = mapped_column(Integer, default=1)
    model: Mapped[str | None] = mapped_column(Text, nullable=True)
    model_params: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    model_bytes: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    spec: Mapped[dict[str, Any]] = mapped_column()
    created_at: Mapped[float] = mapped_column(Float)
    updated_at: Mapped[float] = mapped_column(Float)
    queued_since: Mapped[float | None] = mapped_column(Float, nullable=True)
    deleted_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    released_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    """When the driver gave back a deleted workload's storage (a notebook's home dir)."""
    failures: Mapped[int] = mapped_column(Integer, default=0)
    """Its replicas' failures in a row (the crash-loop back-off, ``control.backoff``); 0 once one ran long enough."""
    last_failure: Mapped[str] = mapped_column(Text, default="")
    retry_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    """Admission leaves the workload's empty slots alone until then (its back-off); null: at once."""

    rev: Mapped[int] = mapped_column(BigInteger, server_default="0")
    """The change that last touched what admission reads of it (stamped by a trigger: migration 0010)."""

    __table_args__ = (Index("ix_workloads_region_state", "region", "state"),
                      Index("ix_workloads_region_rev", "region", "rev"))


class Replica(Base):
    """One running instance of a workload. ``role``: ``primary`` serves; ``candidate`` is a move
    back being started; ``draining`` is the replica a move replaces, being stopped."""

    __tablename__ = "replicas"

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    workload_id: Mapped[str] = mapped_column(ForeignKey("workloads.id"), index=True)
    slot: Mapped[int] = mapped_column(Integer)
    cls: Mapped[str] = mapped_column(String(63))
    node: Mapped[str] = mapped_column(String(253))
    region: Mapped[str] = mapped_column(String(63))
    state: Mapped[str] = mapped_column(String(16))
    role: Mapped[str] = mapped_column(String(16))
    url: Mapped[str | None] = mapped_column(Text, nullable=True)
    detail: Mapped[str] = mapped_column(Text, default="")
    created_at: Mapped[float] = mapped_column(Float)
    updated_at: Mapped[float] = mapped_column(Float)
    served_model: Mapped[str | None] = mapped_column(Text, nullable=True)
    """The model name the replica's server answers to (``/model`` in a sandbox), which the gateway sends
    upstream; None: the workload's ``model``."""

    rev: Mapped[int] = mapped_column(BigInteger, server_default="0")
    """The change that last touched what admission reads of it (stamped by a trigger)."""

    __table_args__ = (Index("ix_replicas_region_state", "region", "state"),
                      Index("ix_replicas_region_rev", "region", "rev"), Index("ix_replicas_rev", "rev"))


class Event(Base):
    """One state transition (or notable step) of a workload, with the reason admission rendered."""

    __tablename__ = "events"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    workload_id: Mapped[str] = mapped_column(ForeignKey("workloads.id"), index=True)
    at: Mapped[float] = mapped_column(Float)
    type: Mapped[str] = mapped_column(String(32))
    from_state: Mapped[str | None] = mapped_column(String(16), nullable=True)
    to_state: Mapped[str | None] = mapped_column(String(16), nullable=True)
    reason: Mapped[str] = mapped_column(Text)
    count: Mapped[int] = mapped_column(Integer, default=1)
    """How many times it happened in a row, identically (``store.events.repeat_event`` coalesces repeats)."""
    last_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    """When it last happened (null: once, at ``at``)."""


class UsageSegment(Base):
    """Time a replica held ``placed_class``: open while ``ended_at`` is null. A move splits it."""

    __tablename__ = "usage_segments"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    workload_id: Mapped[str] = mapped_column(String(32), index=True)
    """No foreign key: usage outlives its workload's row, which housekeeping purges after the retention."""
    replica_id: Mapped[str] = mapped_column(String(32), unique=True)
    owner: Mapped[str] = mapped_column(String(128), index=True)
    region: Mapped[str] = mapped_column(String(63))
    kind: Mapped[str] = mapped_column(String(16))
    placed_class: Mapped[str] = mapped_column(String(63))
    started_at: Mapped[float] = mapped_column(Float)
    ended_at: Mapped[float | None] = mapped_column(Float, nullable=True)


class Node(Base):
    """A node as the region's controller last observed it (the API computes capacity from these)."""

    __tablename__ = "nodes"

    name: Mapped[str] = mapped_column(String(253), primary_key=True)
    region: Mapped[str] = mapped_column(String(63), index=True)
    cpu: Mapped[float] = mapped_column(Float)
    memory: Mapped[int] = mapped_column(BigInteger)
    gpus: Mapped[dict[str, Any]] = mapped_column()
    labels: Mapped[dict[str, Any]] = mapped_column()
    schedulable: Mapped[bool] = mapped_column(Boolean)
    updated_at: Mapped[float] = mapped_column(Float)


class ApiKey(Base):
    """An API key: only its SHA-256 is kept; the secret is shown once, at creation."""

    __tablename__ = "api_keys"

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    digest: Mapped[str] = mapped_column(String(64), unique=True)
    hint: Mapped[str] = mapped_column(String(16))
    owner: Mapped[str] = mapped_column(String(128), index=True)
    name: Mapped[str] = mapped_column(String(128))
    scopes: Mapped[list[str]] = mapped_column()
    created_at: Mapped[float] = mapped_column(Float)
    revoked_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    rpm: Mapped[int | None] = mapped_column(Integer, nullable=True)  # requests per minute at the gateway
    tpm: Mapped[int | None] = mapped_column(Integer, nullable=True)  # tokens per minute at the gateway


class DashboardSession(Base):
    """A signed-in dashboard browser: only the SHA-256 of its random session id is kept (the browser holds
    the id; never the API key it signed in with). It acts as ``key_id`` until ``expires_at`` (the absolute
    lifetime), while pages come within the idle timeout of ``last_seen_at``, and until ``revoked_at`` (sign
    out) or its key's own revocation."""

    __tablename__ = "dashboard_sessions"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)  # SHA-256 hex of the session id
    key_id: Mapped[str] = mapped_column(ForeignKey("api_keys.id"), index=True)
    owner: Mapped[str] = mapped_column(String(128))
    created_at: Mapped[float] = mapped_column(Float)
    expires_at: Mapped[float] = mapped_column(Float, index=True)
    last_seen_at: Mapped[float] = mapped_column(Float)
    revoked_at: Mapped[float | None] = mapped_column(Float, nullable=True)


class TokenUsage(Base):
    """One inference request as the gateway metered it. ``id`` is made by the gateway (random, never
    the client's): a batch sent twice (the gateway retries after an outage) is counted once."""

    __tablename__ = "token_usage"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    at: Mapped[float] = mapped_column(Float, index=True)
    owner: Mapped[str] = mapped_column(String(128), index=True)
    key_id: Mapped[str] = mapped_column(String(32))
    endpoint: Mapped[str] = mapped_column(String(63))  # the name the request asked for
    endpoint_id: Mapped[str | None] = mapped_column(String(32), nullable=True)
    product: Mapped[str] = mapped_column(String(32))  # endpoint | serverless | fallback-model | cross-region
    answered_by: Mapped[str | None] = mapped_column(String(32), nullable=True)  # the endpoint that answered
    model: Mapped[str] = mapped_column(String(128))  # the public name of the model that answered
    served_by: Mapped[str] = mapped_column(String(32))
    region: Mapped[str] = mapped_column(String(63))
    prompt_tokens: Mapped[int] = mapped_column(Integer)
    completion_tokens: Mapped[int] = mapped_column(Integer)
    status: Mapped[int] = mapped_column(Integer)
    client_request_id: Mapped[str | None] = mapped_column(String(64), nullable=True)
    """The ``X-Request-Id`` the client sent (echoed back to it): stored, never used to deduplicate."""


class IdempotencyRecord(Base):
    """One POST's claim on an Idempotency-Key, then its response for replay.

    Keyed by the calling API key's id (never its owner: another key of the owner must not replay it).
    Claimed by an atomic insert; ``expires_at`` is short while in flight (a crash must not lock the
    key) and 24 h once the response is stored. No body holds a secret.
    """

    __tablename__ = "idempotency_records"

    key_id: Mapped[str] = mapped_column(String(32), primary_key=True)
    method: Mapped[str] = mapped_column(String(8), primary_key=True)
    path: Mapped[str] = mapped_column(String(512), primary_key=True)
    key: Mapped[str] = mapped_column(String(255), primary_key=True)
    fingerprint: Mapped[str] = mapped_column(String(64))
    state: Mapped[str] = mapped_column(String(16))
    status: Mapped[int | None] = mapped_column(Integer, nullable=True)
    body: Mapped[str | None] = mapped_column(Text, nullable=True)
    created_at: Mapped[float] = mapped_column(Float)
    expires_at: Mapped[float] = mapped_column(Float, index=True)


class Owner(Base):
    """What the operator says of an owner. Every owner is untrusted (on Kubernetes its notebook and
    endpoint pods run under Kata) unless an admin set ``trusted``; an owner with no row is untrusted."""

    __tablename__ = "owners"

    owner: Mapped[str] = mapped_column(String(128), primary_key=True)
    trusted: Mapped[bool] = mapped_column(Boolean, default=False)
    updated_at: Mapped[float] = mapped_column(Float)
    quotas: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    """An admin's overrides of the default quotas (``tensora.quotas``), a partial dict; None: the defaults."""
    limits: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    """An admin's overrides of the default gateway limits, a partial dict; None: the defaults."""
    rev: Mapped[int] = mapped_column(BigInteger, server_default="0", index=True)
    """The change that last touched ``quotas`` (stamped by a trigger)."""


class Revision(Base):
    """SQLite's change counter (one row, ``id`` 1), which the triggers of migration 0010 advance and stamp
    rows with. PostgreSQL stamps transaction ids instead and leaves this row alone."""

    __tablename__ = "revisions"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    rev: Mapped[int] = mapped_column(BigInteger)


class Lease(Base):
    """Leadership: one holder per name (``controller/<region>``) until ``expires_at``."""

    __tablename__ = "leases"

    name: Mapped[str] = mapped_column(String(128), primary_key=True)
    holder: Mapped[str] = mapped_column(String(128))
    expires_at: Mapped[float] = mapped_column(Float)
    acquired_at: Mapped[float] = mapped_column(Float)


class StoredFile(Base):
    """One file of an owner's storage (``storage.py``): the bytes are on disk under the owner's
    directory at ``path``; this row is the truth for listings and the quota."""

    __tablename__ = "files"

    owner: Mapped[str] = mapped_column(String(128), primary_key=True)
    path: Mapped[str] = mapped_column(String(512), primary_key=True)
    size: Mapped[int] = mapped_column(BigInteger)
    sha256: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[float] = mapped_column(Float)


class UploadReservation(Base):
    """The bytes an upload in flight holds of its owner's storage quota (``api/files.py``): its declared
    length, or what it received so far. Counted with the owner's files by every API worker; removed when the
    upload ends, and void past ``expires_at`` (a worker that crashed mid-upload leaves one behind)."""

    __tablename__ = "upload_reservations"

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    owner: Mapped[str] = mapped_column(String(128), index=True)
    size: Mapped[int] = mapped_column(BigInteger)
    expires_at: Mapped[float] = mapped_column(Float)


class OwnerUid(Base):
    """The unprivileged uid (and gid, the same number) an owner's sandboxes run as: allocated once,
    never reused for another owner."""

    __tablename__ = "owner_uids"

    owner: Mapped[str] = mapped_column(String(128), primary_key=True)
    uid: Mapped[int] = mapped_column(Integer, unique=True)
    created_at: Mapped[float] = mapped_column(Float)


class OwnerCall(Base):
    """One costly control-API call an owner made (a workload create or restart, a delete, a file upload): the
    per-owner rates (``tensora.api.rates``) count these over the last minute. Each call prunes its owner's rows
    of that action older than the window, and housekeeping everyone's, so the table holds about one window."""

    __tablename__ = "owner_calls"
    __table_args__ = (Index("ix_owner_calls_owner_action_at", "owner", "action", "at"),)

    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True,
                                    autoincrement=True)
    owner: Mapped[str] = mapped_column(String(128))
    action: Mapped[str] = mapped_column(String(16))
    at: Mapped[float] = mapped_column(Float, index=True)
