"""What the routes need, in one object on ``app.state``: store, catalog, clock, region, keys,
idempotency, the dashboard's sessions, and a way to wake the controller."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tensora.api.auth import KeyChecker
from tensora.api.idempotency import Idempotency
from tensora.api.sessions import Sessions
from tensora.clock import Clock
from tensora.config.quotas import OwnerSettings
from tensora.control.controller import Controller
from tensora.names import controller_lease
from tensora.placement.capacity import GpuReserve
from tensora.placement.catalog import Catalog
from tensora.storage import Storage
from tensora.store import leases as leases_repo
from tensora.store.db import Database


@dataclass
class Services:
    db: Database
    catalog: Catalog
    clock: Clock
    region: str
    keys: KeyChecker
    idempotency: Idempotency
    sessions: Sessions
    """The dashboard's signed-in browsers (``tensora.api.sessions``)."""
    controller: Controller | None = None
    reserves: dict[str, GpuReserve] | None = None
    waker: Callable[[], None] | None = None
    """Wakes a controller in another process (``serve --workers``), when there is none here."""
    extra: dict[str, Any] = field(default_factory=dict)
    storage: Storage | None = None
    """Owners' files (``/v1/files``) and the shared models; None: this server keeps none (503)."""
    isolation: str | None = None
    """The local driver's isolation: ``sandbox``, ``none`` (the operator's choice) or ``admin-only`` (this host
    cannot sandbox: only the admin owner may create workloads); None for other drivers."""
    isolation_reason: str | None = None
    """Why this host cannot sandbox (``admin-only``)."""
    replica_secret: bytes | None = None
    """The local driver's replica key secret (``tensora.keys.replicakeys``): the route table carries each replica's
    key for the gateway. None: replicas take no key (other drivers)."""
    runs_models: bool = False
    """The driver runs model servers (local, Kubernetes): an endpoint's model must be a directory they load
    (config.json, a tokenizer, the weights), checked at create. False for a simulated fleet: it needs only the
    model's size, which a lone safetensors file gives."""
    owner_defaults: OwnerSettings = field(default_factory=OwnerSettings)
    """Every owner's quotas and limits unless an admin set otherwise (``tensora.placement.quotas``)."""

    metrics_listen: dict[str, str] = field(default_factory=dict)
    """Where this server's metrics listeners are (``control``, and ``gateway`` under ``tensora up``): the
    operator page reads them (``GET /v1/operator``)."""

    def wake(self) -> None:
        if self.controller is not None:
            self.controller.wake()
        elif self.waker is not None:
            self.waker()

    controller_holder: str | None = None
    """The lease holder name of this server's controller when it runs in another process."""

    def controller_state(self) -> str:
        """leader / standby: this server's controller leads the region or waits; or none here."""
        holder = self.controller.holder if self.controller is not None else self.controller_holder
        if holder is None:
            return "not in this server"
        try:
            with self.db.read() as conn:
                current = leases_repo.lease_holder(conn, controller_lease(self.region), self.clock.now())
        except Exception:
            return "unknown"
        return "leader" if current == holder else "standby"
