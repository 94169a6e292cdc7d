"""A whole control plane for a test: store, simulated fleet on a fake clock, controller,
API app, and keys. Build it with :func:`stack`; serve it with ``services.serving``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tensora.api.app import create_app
from tensora.api.auth import create_key
from tensora.config.catalog import default_catalog
from tensora.config.settings import ServeSettings
from tensora.control.controller import Controller
from tensora.drivers.simulated import SimulatedDriver
from tensora.placement.capacity import Node
from tensora.serve import build
from tests.support.clock import FakeClock

GI = 2**30
T0 = 1_800_000_000.0  # 2027-01-15 08:00:00 UTC


def fleet() -> list[Node]:
    """The ADR's situation: one L40S (soon taken), one A100, a CPU worker."""
    return [
        Node("gpu-l40s-1", "local", 32, 256 * GI, {"L40S": 1}),
        Node("gpu-a100-1", "local", 32, 256 * GI, {"A100-80GB": 1}),
        Node("cpu-1", "local", 64, 256 * GI),
    ]


@dataclass
class Stack:
    services: Any
    controller: Controller
    driver: SimulatedDriver
    clock: FakeClock
    app: Any
    admin: str
    alice: str
    bob: str

    def headers(self, key: str, **extra: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {key}", **extra}


def stack(db_url: str, tmp_path: Any, nodes: list[Node] | None = None, start_delay_s: float = 0.0,
          tick_s: float = 0.05, **app_kw: Any) -> Stack:
    clock = FakeClock(T0)
    driver = SimulatedDriver(nodes if nodes is not None else fleet(), clock, start_delay_s=start_delay_s)
    settings = ServeSettings(data_dir=tmp_path, database_url=db_url, tick_s=tick_s)
    services = build(settings, clock=clock, driver=driver, catalog=default_catalog())
    assert services.controller is not None
    with services.db.write() as conn:
        admin, _ = create_key(conn, "admin", "admin", ["admin"], clock.now())
        alice, _ = create_key(conn, "alice", "alice", ["workloads:read", "workloads:write", "usage:read",
                                                       "keys:write"], clock.now())
        bob, _ = create_key(conn, "bob", "bob", ["workloads:read", "workloads:write", "usage:read",
                                                 "keys:write"], clock.now())
    app = create_app(services, **app_kw)
    return Stack(services, services.controller, driver, clock, app, admin, alice, bob)
