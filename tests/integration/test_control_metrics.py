"""The control API's and the controller's metrics: ADR-0010's story (a fallback placement after its
timer, then a move back once the requested GPU frees) run by the controller's own loop on a fake clock, and API
requests with an Idempotency-Key replayed; then scrapes of ``/metrics`` over HTTP on its own listener, parsed with
prometheus-client's parser: the counters moved by exactly what the story did (the counters are per process, so
the test compares before and after)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tensora.api.metrics import REGISTRY
from tensora.clock import FakeClock
from tensora.config.catalog import default_catalog
from tensora.control import workloads
from tensora.control.controller import Controller
from tensora.control.metrics import ControllerCollector
from tensora.control.spec import parse_spec
from tensora.drivers.simulated import SimulatedDriver
from tensora.store import workloads as workloads_repo
from tensora.store.db import Database
from tensora.store.rows import WorkloadRecord
from tensora.telemetry.scrape import Listener
from tests.support.services import free_port, serving
from tests.support.stack import T0, Stack, fleet, stack

pytestmark = pytest.mark.timeout(120)

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(port: int) -> Samples:
    r = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5)
    assert r.status_code == 200
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(r.text) for s in f.samples}


def value(found: Samples, name: str, **labels: str) -> float:
    return found.get((name, tuple(sorted(labels.items()))), 0.0)


def until(what: Callable[[], bool], s: Stack, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while not what():
        assert time.monotonic() < deadline, "the controller did not get there"
        s.controller.wake()
        time.sleep(0.02)


def submit(s: Stack, owner: str, **body: Any) -> str:
    db = s.services.db
    with db.write() as conn:
        checked = workloads.validate(parse_spec(body), s.services.catalog, owner, None)
        return workloads.create(conn, checked, s.clock.now()).id


def get(s: Stack, wid: str) -> WorkloadRecord:
    with s.services.db.read() as conn:
        w = workloads_repo.get_workload(conn, wid)
        assert w is not None
        return w


def test_fallback_and_move_back_then_scrape(db_url: str, tmp_path: Path) -> None:
    s = stack(db_url, tmp_path)
    listener = Listener("127.0.0.1:0", REGISTRY, ControllerCollector(s.controller.metrics))
    assert listener.start()
    s.controller.start()
    try:
        before = scrape(listener.port)
        holder = submit(s, "carol", kind="notebook", name="holds-l40s", gpu_class="l40s-48gb")
        submit(s, "dave", kind="notebook", name="holds-a100", gpu_class="a100-80gb")
        until(lambda: get(s, holder).state == "running", s)
        ep = submit(s, "alice", kind="endpoint", name="chat", gpu_class="l40s-48gb", fallback=["a100-80gb", "cpu"],
                    fallback_after="10m", model_params="7B")
        until(lambda: get(s, ep).reason.startswith("waiting for l40s-48gb"), s)
        waiting = scrape(listener.port)
        assert value(waiting, "tensora_controller_queue_depth", region="local", **{"class": "l40s-48gb"},
                     kind="endpoint") == 1
        assert value(waiting, "tensora_controller_leader", region="local") == 1

        s.clock.advance(600)  # the fallback timer: placed on CPU
        until(lambda: get(s, ep).placed_class == "cpu-16c-64g", s)
        with s.services.db.write() as conn:  # the L40S frees: the endpoint moves back by itself
            workloads.stop(conn, get(s, holder), s.clock.now())
        until(lambda: get(s, ep).placed_class == "l40s-48gb", s)

        with serving(s.app) as live:  # the API: a key made twice with one Idempotency-Key (replayed), a 404
            h = s.headers(s.alice, **{"Idempotency-Key": "k-1"})
            first = httpx.post(f"{live.url}/v1/keys", json={"name": "laptop", "scopes": ["usage:read"]}, headers=h)
            again = httpx.post(f"{live.url}/v1/keys", json={"name": "laptop", "scopes": ["usage:read"]}, headers=h)
            assert first.status_code == again.status_code == 201 and again.headers["idempotent-replayed"] == "true"
            assert httpx.get(f"{live.url}/v1/workloads/nope", headers=s.headers(s.alice)).status_code == 404
        after = scrape(listener.port)
    finally:
        s.controller.stop()
        listener.close()
        s.services.db.dispose()

    def moved(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert moved("tensora_controller_time_to_placement_seconds_count", region="local", outcome="requested") == 2
    assert moved("tensora_controller_time_to_placement_seconds_count", region="local", outcome="fallback") == 1
    # the fallback waited its 10 minutes: its observation is in the 600 s bucket, not below
    assert moved("tensora_controller_time_to_placement_seconds_bucket", region="local", outcome="fallback",
                 le="300.0") == 0
    assert moved("tensora_controller_time_to_placement_seconds_bucket", region="local", outcome="fallback",
                 le="600.0") == 1
    assert moved("tensora_controller_fallback_placements_total", region="local", requested="l40s-48gb",
                 placed="cpu-16c-64g") == 1
    assert moved("tensora_controller_move_backs_started_total", region="local", **{"from": "cpu-16c-64g"},
                 to="l40s-48gb") == 1
    assert moved("tensora_controller_move_backs_finished_total", region="local") == 1
    assert moved("tensora_controller_cycle_duration_seconds_count", region="local", role="leader") > 0
    assert value(after, "tensora_controller_queue_depth", region="local", **{"class": "l40s-48gb"},
                 kind="endpoint") == 0
    assert moved("tensora_api_requests_total", route="/v1/keys", method="POST", status="201") == 2
    assert moved("tensora_api_requests_total", route="/v1/workloads/{workload_id}", method="GET", status="404") == 1
    assert moved("tensora_api_idempotency_total", outcome="replayed") == 1
    assert moved("tensora_api_idempotency_total", outcome="conflict") == 0
    assert moved("tensora_api_request_duration_seconds_count", route="/v1/keys", method="POST") == 2


def test_two_controllers_in_one_process_count_apart(db: Database) -> None:
    """Each controller counts into its own ``metrics`` (the server that runs it exposes those): a cycle of one is
    not the other's."""
    clock = FakeClock(T0)
    running, idle = (Controller(db, SimulatedDriver(fleet(), clock), default_catalog(), clock=clock, holder=h,
                                tick_s=0.01, min_gap_s=0.0) for h in "ab")
    assert running.metrics is not idle.metrics
    running.start()
    try:
        deadline = time.monotonic() + 20
        while running.metrics.leader.get("local") != 1:
            assert time.monotonic() < deadline, "no cycle counted"
            time.sleep(0.02)
    finally:
        running.stop()
    leader = {f.name: [s.value for s in f.samples] for f in ControllerCollector(idle.metrics).collect()}
    assert idle.metrics.leader == {} and leader["tensora_controller_leader"] == []
    assert leader["tensora_controller_cycle_duration_seconds"] == []


def test_serve_scrape_sums_its_workers(tmp_path: Path) -> None:
    """``tensora serve`` (HTTP in 2 worker processes, the controller in the supervisor): one scrape of its
    metrics_listen holds every worker's requests and the controller's state."""
    port, mport = free_port(), free_port()
    proc = subprocess.Popen([sys.executable, "-m", "tensora.cli", "serve", "--data-dir", str(tmp_path), "--port",
                             str(port), "--workers", "2"],
                            env={**os.environ, "TENSORA_METRICS_LISTEN": f"127.0.0.1:{mport}"},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, "tensora serve did not start"
            time.sleep(0.1)
        n = 20
        for _ in range(n):  # new connections: both workers answer some
            assert httpx.get(f"http://127.0.0.1:{port}/v1/workloads").status_code == 401
        found = scrape(mport)
        assert value(found, "tensora_api_requests_total", route="/v1/workloads", method="GET", status="401") == n
        while value(found, "tensora_controller_leader", region="local") != 1:  # its first cycle
            assert time.monotonic() < deadline + 30, "no controller cycle"
            time.sleep(0.2)
            found = scrape(mport)
        if shutil.which("promtool"):
            text = httpx.get(f"http://127.0.0.1:{mport}/metrics").text
            done = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True,
                                  check=False)
            assert done.returncode == 0, done.stdout + done.stderr
    finally:
        proc.terminate()
        out = proc.communicate(timeout=20)[0]
    assert f"metrics on http://127.0.0.1:{mport}/metrics" in out
