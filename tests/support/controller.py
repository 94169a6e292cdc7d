"""The controller against the real store, driven by hand on a fake clock: one made on the simulated fleet, a
workload submitted as the API would, and what the store then says of it (the record, its events and replicas, the
API's view, the usage segments)."""

from __future__ import annotations

from typing import Any

from tensora.config.catalog import default_catalog
from tensora.control import workloads
from tensora.control.controller import Controller
from tensora.control.spec import parse_spec
from tensora.control.workloads import WorkloadView
from tensora.drivers.simulated import SimulatedDriver
from tensora.store import events as events_repo
from tensora.store import usage as usage_repo
from tensora.store import workloads as workloads_repo
from tensora.store.db import Database
from tensora.store.rows import ReplicaRow, SegmentRow, WorkloadRecord
from tests.support.clock import FakeClock
from tests.support.doubles import CrashingDriver
from tests.support.stack import fleet

CATALOG = default_catalog()


def make(db: Database, clock: FakeClock, driver: Any = None, holder: str = "a", start_delay_s: float = 0.0,
         ) -> tuple[Controller, SimulatedDriver]:
    sim = driver or SimulatedDriver(fleet(), clock, start_delay_s=start_delay_s)
    inner = sim.inner if isinstance(sim, CrashingDriver) else sim
    return Controller(db, sim, CATALOG, clock=clock, holder=holder, lease_ttl_s=15), inner


def submit(db: Database, clock: FakeClock, owner: str = "alice", **body: Any) -> str:
    with db.write() as conn:
        checked = workloads.validate(parse_spec(body), CATALOG, owner, None)  # sized by model_params: no storage
        return str(workloads.create(conn, checked, clock.now()).id)


def get(db: Database, wid: str) -> WorkloadRecord:
    with db.read() as conn:
        w = workloads_repo.get_workload(conn, wid, include_deleted=True)
        assert w is not None
        return w


def events(db: Database, wid: str) -> list[str]:
    with db.read() as conn:
        return [e.reason for e in events_repo.list_events(conn, wid)]


def replicas(db: Database, wid: str, active_only: bool = True) -> list[ReplicaRow]:
    with db.read() as conn:
        return workloads_repo.replicas_of(conn, [wid], active_only=active_only)


def view(db: Database, wid: str) -> WorkloadView:
    return workloads.view(get(db, wid), replicas(db, wid), CATALOG)


def segments(db: Database) -> list[SegmentRow]:
    with db.read() as conn:
        return sorted(usage_repo.segments(conn, None, 0, 1e12), key=lambda s: (s.started_at, s.id))
