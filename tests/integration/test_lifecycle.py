"""A replica's lifecycle on a fake clock, against the real store (SQLite and PostgreSQL): the crash-loop
back-off and its reset, a healthy replica serving on while another backs off, failures retrying cannot fix
failing the workload once, and a crash loop's events bounded."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from tensora.clock import SystemClock
from tensora.control import workloads
from tensora.control.controller import Controller
from tensora.control.spec import parse_spec
from tensora.drivers.base import ReplicaSpec
from tensora.drivers.local import Isolation, LocalDriver
from tensora.drivers.runners import REPLICA_ENV
from tensora.drivers.simulated import SimulatedDriver
from tensora.models import runtimes
from tensora.placement.capacity import Node
from tensora.placement.catalog import Catalog
from tensora.placement.kinds import ReplicaState, WorkloadKind
from tensora.store import events as events_repo
from tensora.store import workloads as workloads_repo
from tensora.store.db import Database
from tensora.store.tables import U
from tests.support.api import Api, created, iso, own_model, settle
from tests.support.api import api as api  # the fixture, imported under its name
from tests.support.clock import FakeClock
from tests.support.controller import CATALOG, events, get, make, replicas, submit, view
from tests.support.stack import GI, T0, fleet

__all__ = ["api"]  # the fixture: a server over the store (the store itself: tests/conftest.py's db)


def crash(c: Controller, driver: SimulatedDriver, wid: str, why: str = "exit code 1", slot: int = 0) -> None:
    """The slot's replica runs, then fails; the next cycle records it."""
    c.run_once()
    rid = next(r.id for r in replicas(c.db, wid) if r.slot == slot and r.role == "primary")
    driver.fail(rid, why)
    c.run_once()


def backoff_of(db: Database, wid: str) -> tuple[int, float | None]:
    w = get(db, wid)
    return w.failures, None if w.retry_at is None else w.retry_at - T0


def test_backoff_doubles_to_five_minutes_skips_admission_and_resets_after_ten_minutes(db: Database) -> None:
    clock = FakeClock(T0)
    c, driver = make(db, clock)
    ep = submit(db, clock, kind="endpoint", name="ep", gpu_class="cpu-2c-8g", model_params="1B")
    c.run_once()
    waits = []
    for n in range(1, 9):
        crash(c, driver, ep, f"exit code {n}")
        failures, retry = backoff_of(db, ep)
        assert failures == n and retry is not None
        waits.append(retry - (clock.now() - T0))
        w = get(db, ep)
        assert w.state == "queued" and not replicas(db, ep)
        assert w.reason.startswith(f"failed {n} time{'s' if n > 1 else ''}: exit code {n}; next try at ")
        # admission leaves it alone until the next try, with the capacity free
        clock.advance(waits[-1] - 1)
        report = c.run_once()
        assert get(db, ep).state == "queued" and not replicas(db, ep)
        assert report.backing_off == 1  # the crash loop the metrics show
        clock.advance(1)
        report = c.run_once()
        assert get(db, ep).state == "starting" and report.backing_off == 0
    assert waits == [10, 20, 40, 80, 160, 300, 300, 300]
    crash_loop = [x for x in view(db, ep)["conditions"] if x["type"] == "crash_loop"]
    assert crash_loop == [{"type": "crash_loop", "reason": "back_off", "count": 8,
                           "message": crash_loop[0]["message"]}]
    assert crash_loop[0]["message"].startswith("failed 8 times: exit code 8; next try at ")
    # running 10 min (a cycle every tick) ends the crash loop: the next failure waits 10 s again
    c.run_once()
    assert get(db, ep).state == "running"
    clock.advance(599)
    c.run_once()
    assert backoff_of(db, ep)[0] == 8
    clock.advance(1)
    c.run_once()
    assert backoff_of(db, ep) == (0, None)
    assert not [x for x in view(db, ep)["conditions"] if x["type"] == "crash_loop"]
    crash(c, driver, ep)
    assert backoff_of(db, ep)[0] == 1 and get(db, ep).retry_at == clock.now() + 10


def test_backoff_survives_a_controller_restart(db: Database) -> None:
    clock = FakeClock(T0)
    c, driver = make(db, clock)
    ep = submit(db, clock, kind="endpoint", name="ep", gpu_class="cpu-2c-8g", model_params="1B")
    c.run_once()
    crash(c, driver, ep)
    crash_at = clock.now()
    clock.advance(10)
    c.run_once()
    crash(c, driver, ep)
    assert get(db, ep).retry_at == clock.now() + 20
    c.stop()
    successor, _ = make(db, clock, driver=driver, holder="b")  # the store holds the count and the next try
    clock.advance(19)
    successor.run_once()
    assert get(db, ep).state == "queued"
    clock.advance(1)
    successor.run_once()
    assert get(db, ep).state == "starting" and crash_at < clock.now()


def test_an_owners_restart_ends_the_back_off(db: Database) -> None:
    clock = FakeClock(T0)
    c, driver = make(db, clock)
    ep = submit(db, clock, kind="endpoint", name="ep", gpu_class="cpu-2c-8g", model_params="1B")
    c.run_once()
    crash(c, driver, ep)
    assert backoff_of(db, ep) == (1, 10)
    with db.write() as conn:
        workloads.restart(conn, get(db, ep), clock.now(), "policy")
    assert backoff_of(db, ep) == (0, None)
    c.run_once()
    assert get(db, ep).state == "starting"  # at once: the owner asked


def test_a_crash_loop_that_heals_gives_back_the_placements_reason(db: Database) -> None:
    clock = FakeClock(T0)
    c, driver = make(db, clock)
    holds = submit(db, clock, owner="carol", kind="notebook", name="holds", gpu_class="l40s-48gb")
    ep = submit(db, clock, kind="endpoint", name="ep", gpu_class="l40s-48gb", fallback=["cpu"], fallback_after=0,
                model_params="1B")
    c.run_once()
    assert get(db, holds).placed_class == "l40s-48gb"
    assert get(db, ep).reason == "placed on cpu-16c-64g: l40s-48gb unavailable (fallback after 0s)"
    crash(c, driver, ep, "CUDA error")
    assert get(db, ep).reason == "failed 1 time: CUDA error; next try at 08:00:10"
    clock.advance(10)
    c.run_once()
    c.run_once()
    again = "placed on cpu-16c-64g: l40s-48gb unavailable for 10s"
    assert (get(db, ep).state, get(db, ep).reason) == ("running", again)
    clock.advance(600)  # ran long enough: the loop is over, and the reason stays the placement's
    c.run_once()
    assert backoff_of(db, ep) == (0, None)
    assert get(db, ep).reason == again


def test_a_healthy_endpoint_replica_serves_on_while_a_new_one_backs_off(db: Database) -> None:
    clock = FakeClock(T0)
    c, driver = make(db, clock)
    ep = submit(db, clock, kind="endpoint", name="ep", gpu_class="cpu-2c-8g", model_params="1B", replicas=2)
    c.run_once()
    c.run_once()
    first = next(r for r in replicas(db, ep) if r.slot == 0)
    assert get(db, ep).state == "running" and len(replicas(db, ep)) == 2
    for n, wait in enumerate([10, 20, 40], start=1):
        crash(c, driver, ep, "CUDA error", slot=1)
        w = get(db, ep)
        assert w.state == "running" and w.failures == n and w.retry_at == clock.now() + wait
        assert w.reason.startswith(f"failed {n} time")
        assert [r.id for r in replicas(db, ep)] == [first.id]  # slot 1 waits; slot 0 serves on
        assert [(x["type"], x["count"]) for x in view(db, ep)["conditions"]] == [("crash_loop", n)]
        clock.advance(wait - 1)
        c.run_once()
        assert [r.id for r in replicas(db, ep)] == [first.id]
        clock.advance(1)
        c.run_once()
        assert {r.slot for r in replicas(db, ep)} == {0, 1}
    # slot 0 ran all along: its 10 min do not end slot 1's loop; the replacement's own 10 min do
    c.run_once()
    clock.advance(600)
    c.run_once()
    assert backoff_of(db, ep) == (0, None)
    assert get(db, ep).reason.startswith("running on cpu-2c-8g")
    assert first.id in {r.id for r in replicas(db, ep)}


def test_an_endpoint_with_no_runtime_fails_once_with_the_install_hint(db: Database, tmp_path: Path) -> None:
    clock = FakeClock(T0)
    node = Node("cpu-1", "local", 8, 32 * GI)
    local = LocalDriver(tmp_path / "data", node, CATALOG, runtimes_dir=tmp_path / "no-runtimes",
                        isolation=Isolation.NONE)
    c = Controller(db, local, CATALOG, clock=clock, holder="a")
    ep = submit(db, clock, kind="endpoint", name="ep", gpu_class="cpu-2c-8g", model_params="1B")
    for _ in range(50):
        c.run_once()
        clock.advance(2)
    w = get(db, ep)
    assert w.state == "failed"
    assert "no model runtime is installed for cpu endpoints" in w.reason
    assert w.reason.endswith("tensora runtime install tensora-transformers")
    # created, then two events (placed, failed), not hundreds
    assert events(db, ep) == ["created: queued for cpu-2c-8g", "placed on cpu-2c-8g", w.reason]
    assert len(replicas(db, ep, active_only=False)) == 1


MODELS_SERVER = """
import http.server, sys
port = int(sys.argv[sys.argv.index("--port") + 1])
host = sys.argv[sys.argv.index("--host") + 1]  # the replica's own loopback address
class Models(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/v1/models" else 404)
        self.end_headers()
        self.wfile.write(b'{"data": []}')
    def log_message(self, *args):
        pass
http.server.HTTPServer((host, port), Models).serve_forever()
"""


class FakeInstaller:
    """``runtimes.install`` without a download: tells its steps like the real one, waits until the test lets it
    go on, then makes a venv-like 'tensora-transformers' (Debian's Python, a ``transformers.cli.transformers``
    that answers ``/v1/models``); ``fail`` ends it with an error after a few lines of output."""

    def __init__(self, fail: bool = False) -> None:
        self.go, self.fail, self.calls = threading.Event(), fail, 0
        self.waiting = threading.Event()  # set once it has told its first steps and waits for ``go``

    def __call__(self, root: Path, name: str, log: Any = None, progress: Any = None) -> Path:
        self.calls += 1
        progress(f"creating the environment {runtimes.venv_dir(root, name)}")
        progress(f"installing {runtimes.TORCH} transformers[serving]>=5.20 (2 pinned packages)")
        progress(f"[1/2] {runtimes.TORCH}")
        self.waiting.set()
        assert self.go.wait(30)
        if self.fail:
            for line in ("Collecting torch==2.13.0", "ERROR: No matching distribution found for torch==2.13.0"):
                log.write(line + "\n")
            raise runtimes.RuntimeNotAvailable(f"{name}: pip install failed (exit 1)")
        progress("unpacking 2 packages into the environment")
        venv = runtimes.venv_dir(root, name)
        system = subprocess.run(["/usr/bin/python3", "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                                capture_output=True, text=True, check=True).stdout.strip()
        package = venv / "lib" / f"python{system}" / "site-packages" / "transformers"
        (package / "cli").mkdir(parents=True)
        for init in (package / "__init__.py", package / "cli" / "__init__.py"):
            init.write_text("")
        (package / "cli" / "transformers.py").write_text(MODELS_SERVER)
        (venv / "bin").mkdir()
        (venv / "bin" / "python").symlink_to("/usr/bin/python3")
        (venv / "pyvenv.cfg").write_text("home = /usr/bin\ninclude-system-site-packages = false\n")
        (root / name / "installed.json").write_text("{}")
        return root / name


def test_one_install_at_a_time(tmp_path: Path) -> None:
    installer = FakeInstaller()
    installs = runtimes.Background(tmp_path, installer)
    installs.want("tensora-transformers")
    installs.want("tensora-vllm-cpu")
    installs.want("tensora-transformers")  # already under way: not a second
    deadline = time.monotonic() + 10
    assert installer.waiting.wait(10)  # the first install is under way, held at its second step
    assert installs.state("tensora-transformers") == (
        "installing", "installing runtime tensora-transformers: torch 2.13.0 (step 2 of 3)")
    assert installs.state("tensora-vllm-cpu") == (
        "installing", "installing runtime tensora-vllm-cpu: waiting for another install")
    assert installer.calls == 1
    installer.go.set()
    while installs.state("tensora-vllm-cpu")[0] == "installing":
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert installer.calls == 2
    assert installs.state("tensora-transformers") == installs.state("tensora-vllm-cpu") == ("installed", "")


def endpoint_on_local(db: Database, clock: FakeClock, model: Path) -> str:
    """An endpoint whose model is ``model`` (a host path, as the server would have resolved it)."""
    checked = workloads.validate(parse_spec({"kind": "endpoint", "name": "ep", "gpu_class": "cpu-2c-8g",
                                             "model_params": "1B"}), CATALOG, "alice", None)
    with db.write() as conn:
        return str(workloads.create(conn, dataclasses.replace(checked, model_path=str(model)), clock.now()).id)


@pytest.mark.parametrize("fail", [False, True], ids=["installs", "install-fails"])
def test_an_endpoint_with_no_runtime_installs_it_and_waits(db: Database, tmp_path: Path, fail: bool) -> None:
    clock = FakeClock(T0)
    installer = FakeInstaller(fail)
    local = LocalDriver(tmp_path / "data", Node("cpu-1", "local", 8, 32 * GI), CATALOG,
                        runtimes_dir=tmp_path / "runtimes", isolation=Isolation.NONE, auto_install=True,
                        installer=installer)
    model = tmp_path / "model"
    model.mkdir()
    ep = endpoint_on_local(db, clock, model)
    c = Controller(db, local, CATALOG, clock=clock, holder="a")
    try:
        for _ in range(20):  # waiting on the install: not a failure, not placed again
            c.run_once()
            clock.advance(2)
        w = get(db, ep)
        assert (w.state, view(db, ep)["reason"], w.failures) == (
            "starting", "installing runtime tensora-transformers: torch 2.13.0 (step 2 of 3)", 0)
        assert len(replicas(db, ep, active_only=False)) == 1 and installer.calls == 1
        installer.go.set()
        deadline = time.monotonic() + 30
        while get(db, ep).state == "starting" and time.monotonic() < deadline:
            c.run_once()
            clock.advance(2)
            time.sleep(0.1)
        w = get(db, ep)
        if fail:  # once, with the installer's last lines
            assert w.state == "failed"
            assert w.reason.endswith("installing runtime tensora-transformers failed: tensora-transformers: pip "
                                     "install failed (exit 1); its last lines: Collecting torch==2.13.0 | ERROR: No "
                                     "matching distribution found for torch==2.13.0"), w.reason
            assert len([e for e in events(db, ep) if "failed" in e]) == 1
        else:
            assert w.state == "running", w.reason
            assert view(db, ep)["reason"] == "placed on cpu-2c-8g"  # the placement's, the install done
            assert runtimes.installed(tmp_path / "runtimes", "tensora-transformers")
        assert len(replicas(db, ep, active_only=False)) == 1 and installer.calls == 1
    finally:
        installer.go.set()
        for r in replicas(db, ep):
            local.stop(r.id)
        for _ in range(30):
            if all(s.state in ("stopped", "failed") for s in local.observe()):
                break
            time.sleep(0.2)


def test_a_crash_loop_over_30_minutes_leaves_few_events(db: Database) -> None:
    clock = FakeClock(T0)
    c, driver = make(db, clock, start_delay_s=3)
    ep = submit(db, clock, kind="endpoint", name="ep", gpu_class="cpu-2c-8g", model_params="1B")
    attempts = 0
    while clock.now() < T0 + 1800:
        c.run_once()
        for r in replicas(db, ep):
            if r.state == "running":  # it starts, serves a moment and crashes, every time
                driver.fail(r.id, "Segmentation fault")
                attempts += 1
        clock.advance(2)
    with db.read() as conn:
        rows = events_repo.list_events(conn, ep)
    assert attempts >= 8  # 10 s, 20 s ... then every 5 min
    assert len(rows) < 20, [e.reason for e in rows]
    assert sum(e.count for e in rows) > 3 * attempts - 3  # placed, running, failed: each counted, not added
    repeated = max(rows, key=lambda e: e.count)
    assert repeated.count >= attempts - 1 and repeated.last_at is not None and repeated.last_at > repeated.at


def test_a_class_gone_from_the_catalog_fails_its_queued_workload_once(db: Database) -> None:
    clock = FakeClock(T0)
    smaller = Catalog([cls for cls in CATALOG.values() if cls.name != "a100-80gb"])  # the operator removed it
    nb = submit(db, clock, kind="notebook", name="nb", gpu_class="a100-80gb")
    c = Controller(db, SimulatedDriver(fleet(), clock), smaller, clock=clock, holder="a")
    for _ in range(5):
        c.run_once()
        clock.advance(2)
    w = get(db, nb)
    assert w.state == "failed"
    assert w.reason == "failed: a100-80gb is no longer in the catalog (retrying cannot fix this)"
    assert events(db, nb) == ["created: queued for a100-80gb", w.reason]


@pytest.mark.parametrize(("kind", "cls", "extra", "permanent", "says"), [
    pytest.param(WorkloadKind.ENDPOINT, "cpu-2c-8g", {"model": "/m"}, True, "tensora runtime install",
                 id="endpoint, no runtime: for good"),
    pytest.param(WorkloadKind.VM, "cpu-2c-8g", {"image": "/etc/hostname"}, True, "not in your files",
                 id="vm, image outside the owner's files: refused for good"),
    pytest.param(WorkloadKind.NOTEBOOK, "l40s-48gb", {}, False, "1 GPU(s) needed, 0 free",
                 id="notebook, its GPU busy: may free, so retried"),
])
def test_the_local_driver_says_whether_retrying_can_fix_a_failure(
        tmp_path: Path, kind: WorkloadKind, cls: str, extra: dict[str, str], permanent: bool, says: str) -> None:
    if kind is WorkloadKind.VM and shutil.which("qemu-system-x86_64") is None:
        pytest.skip("qemu-system-x86 is not installed (./scripts/test installs it)")
    node = Node("box", "local", 32, 128 * GI, {"L40S": 1})
    local = LocalDriver(tmp_path / "data", node, CATALOG, runtimes_dir=tmp_path / "no-runtimes",
                        isolation=Isolation.NONE)
    status = local.start(ReplicaSpec("rp_1", "wl_1", kind, cls, "box", owner="alice", **extra))
    assert status.state is ReplicaState.FAILED and says in status.detail
    assert status.permanent is permanent
    assert local.observe()[0].permanent is permanent  # as the controller reads it, cycle after cycle


def test_over_http_a_crash_loop_reads_as_counted_events_and_a_crash_loop_condition(api: Api) -> None:
    alice = api.as_(api.stack.alice)
    model, _ = own_model(api, alice)
    ep = created(alice, kind="endpoint", name="crashy", gpu_class="cpu-2c-8g", model=model)
    driver, clock = api.stack.driver, api.stack.clock
    for n, wait in enumerate([10, 20, 40], start=1):
        w = settle(api, alice, ep["id"], "running")
        driver.fail(w["replicas"][0]["id"], "exit code 139")
        api.cycle()
        w = alice.get(f"/v1/workloads/{ep['id']}").json()
        assert w["state"] == "queued" and w["reason"].startswith(f"failed {n} time")
        assert [(c["type"], c["reason"], c["count"]) for c in w["conditions"]] == [("crash_loop", "back_off", n)]
        clock.advance(wait)
        api.cycle()
    events = alice.get(f"/v1/workloads/{ep['id']}/events").json()["data"]
    failed = [e for e in events if e["reason"].endswith("failed: exit code 139")]
    assert [e["count"] for e in failed] == [3] and failed[0]["last_at"] == iso(clock.now() - 40)
    assert all(e["last_at"] is None for e in events if e["count"] == 1)
    assert len(events) == 4  # created, placed, running, failed: each attempt counted on them


def test_events_of_deleted_workloads_go_after_the_retention(db: Database) -> None:
    clock = FakeClock(T0)
    sim = SimulatedDriver(fleet(), clock)
    c = Controller(db, sim, CATALOG, clock=clock, holder="a", retention_s=3600, prune_every=1)
    kept = submit(db, clock, kind="notebook", name="kept", gpu_class="cpu-2c-8g")
    gone = submit(db, clock, kind="notebook", name="gone", gpu_class="cpu-2c-8g")
    c.run_once()
    c.run_once()
    with db.write() as conn:
        workloads.delete(conn, get(db, gone), clock.now())
    c.run_once()
    c.run_once()
    assert events(db, gone)[-1] == "stopped: all replicas stopped"
    clock.advance(3599)
    c.run_once()
    assert len(events(db, gone)) == 5  # deleted an hour ago, less a second: kept
    clock.advance(1)
    c.run_once()
    assert events(db, gone) == [] and len(events(db, kept)) == 3  # a live workload's history stays


def test_deleted_workloads_and_their_replicas_go_after_the_retention_and_their_usage_stays(db: Database) -> None:
    clock = FakeClock(T0)
    sim = SimulatedDriver(fleet(), clock)
    c = Controller(db, sim, CATALOG, clock=clock, holder="a", retention_s=3600, prune_every=1, release_every=1)
    kept = submit(db, clock, kind="notebook", name="kept", gpu_class="cpu-2c-8g")
    gone = submit(db, clock, kind="endpoint", name="gone", gpu_class="cpu-2c-8g", model_params="1B", replicas=2)
    c.run_once()
    c.run_once()
    assert len(replicas(db, gone)) == 2
    with db.write() as conn:
        workloads.delete(conn, get(db, gone), clock.now())
    deleted_at = clock.now()
    for _ in range(4):
        c.run_once()
    assert get(db, gone).released_at is not None and replicas(db, gone) == []
    clock.advance(3599)
    c.run_once()
    assert len(replicas(db, gone, active_only=False)) == 2  # deleted an hour ago, less a second: kept
    clock.advance(1)
    c.run_once()
    with db.read() as conn:
        assert workloads_repo.get_workload(conn, gone, include_deleted=True) is None
        assert workloads_repo.replicas_of(conn, [gone], active_only=False) == []
        usage = conn.execute(U.select().where(U.c.workload_id == gone)).all()
    assert len(usage) == 2 and all(u.ended_at is not None and u.ended_at <= deleted_at + 60 for u in usage)
    assert get(db, kept).deleted_at is None and len(replicas(db, kept)) == 1  # a live workload stays whole
    c.run_once()  # and the controller goes on without the rows
    assert get(db, kept).state == "running"


def test_a_deleted_workload_whose_storage_is_not_given_back_is_kept(db: Database) -> None:
    clock = FakeClock(T0)
    wid = submit(db, clock, kind="notebook", name="nb", gpu_class="cpu-2c-8g")
    with db.write() as conn:
        workloads.delete(conn, get(db, wid), clock.now())
        assert workloads_repo.purge_workloads(conn, clock.now() + 3600) == 0  # its home not given back yet: kept
    assert get(db, wid).deleted_at is not None
    with db.write() as conn:
        workloads_repo.mark_released(conn, [wid], clock.now())
        assert workloads_repo.purge_workloads(conn, clock.now() - 1) == 0  # deleted after the cutoff: kept
        assert workloads_repo.purge_workloads(conn, clock.now()) == 1
        assert workloads_repo.get_workload(conn, wid, include_deleted=True) is None


def test_the_local_driver_forgets_ended_replicas_after_the_retention(db: Database, tmp_path: Path) -> None:
    node = Node("cpu-1", "local", 8, 32 * GI)
    local = LocalDriver(tmp_path / "data", node, CATALOG, runtimes_dir=tmp_path / "no-runtimes",
                        isolation=Isolation.NONE)
    failed = local.start(ReplicaSpec("rp_old", "wl_1", WorkloadKind.ENDPOINT, "cpu-2c-8g", "cpu-1", owner="alice"))
    assert failed.state is ReplicaState.FAILED and (local.root / "rp_old").is_dir()
    ended_at = json.loads((local.root / "rp_old" / "replica.json").read_text())["ended_at"]
    assert local.prune(ended_at - 0.001) == 0 and (local.root / "rp_old").is_dir()  # ended after the cutoff: kept
    assert local.prune(ended_at) == 1 and not (local.root / "rp_old").exists()
    assert local.observe() == []
    # through the controller, on its clock (the real one here): a failed try leaves no dir behind
    c = Controller(db, local, CATALOG, holder="a", retention_s=1e-6, prune_every=1)
    ep = submit(db, SystemClock(), kind="endpoint", name="ep", gpu_class="cpu-2c-8g", model_params="1B")
    c.run_once()
    c.run_once()
    c.run_once()
    assert get(db, ep).state == "failed" and len(replicas(db, ep, active_only=False)) == 1
    assert list(local.root.iterdir()) == []


STARTS_AND_HANGS = """
import sys, time
from pathlib import Path
from tensora.config.catalog import default_catalog
from tensora.drivers.base import ReplicaSpec
from tensora.drivers.local import Isolation, LocalDriver
from tensora.drivers.runners import ProcessRunner
from tensora.placement.capacity import Node
from tensora.placement.kinds import WorkloadKind

data, runtimes, model, spawned = map(Path, sys.argv[1:5])
run_process = ProcessRunner.run

def run_then_hang(self, spec, launch, devices, record):  # the process runs; its pid is not recorded yet
    run_process(self, spec, launch, devices, record)
    spawned.write_text(str(record.pid))
    time.sleep(120)

ProcessRunner.run = run_then_hang
driver = LocalDriver(data, Node("cpu-1", "local", 8, 32 << 30), default_catalog(), runtimes_dir=runtimes,
                     isolation=Isolation.NONE)
driver.start(ReplicaSpec("rp_crash", "wl_crash", WorkloadKind.ENDPOINT, "cpu-2c-8g", "cpu-1", str(model),
                         owner="alice"))
"""


def replica_processes(replica_id: str) -> list[int]:
    """This replica's processes on the machine (its id in their environment)."""
    mark = f"{REPLICA_ENV}={replica_id}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and mark in (entry / "environ").read_bytes().split(b"\0"):
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def test_a_crash_between_start_and_record_leaves_one_process_which_the_next_driver_adopts(tmp_path: Path) -> None:
    installer = FakeInstaller()
    installer.go.set()
    installer(tmp_path / "runtimes", "tensora-transformers", progress=lambda _line: None)
    model, spawned, data = tmp_path / "model", tmp_path / "spawned", tmp_path / "data"
    model.mkdir()
    child = subprocess.Popen([sys.executable, "-c", STARTS_AND_HANGS, str(data), str(tmp_path / "runtimes"),
                              str(model), str(spawned)], env=dict(os.environ))
    try:
        deadline = time.monotonic() + 30
        while not spawned.exists():
            assert child.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        child.send_signal(signal.SIGKILL)  # kill -9 between the start and the record of its pid
        child.wait()
        claim = json.loads((data / "replicas" / "rp_crash" / "replica.json").read_text())
        assert (claim["state"], claim["pid"]) == ("starting", None) and claim["port"]  # the intent, recorded
        server = int(spawned.read_text())
        assert replica_processes("rp_crash") == [server]
        again = LocalDriver(data, Node("cpu-1", "local", 8, 32 * GI), CATALOG, runtimes_dir=tmp_path / "runtimes",
                            isolation=Isolation.NONE)
        assert json.loads((data / "replicas" / "rp_crash" / "replica.json").read_text())["pid"] == server
        spec = ReplicaSpec("rp_crash", "wl_crash", WorkloadKind.ENDPOINT, "cpu-2c-8g", "cpu-1", str(model),
                           owner="alice")
        deadline = time.monotonic() + 30
        while (seen := again.start(spec)).state is not ReplicaState.RUNNING:  # adopted: started only once
            assert seen.state is ReplicaState.STARTING and time.monotonic() < deadline, seen
            again.observe()
            time.sleep(0.1)
        assert replica_processes("rp_crash") == [server]
        # it keeps the loopback address of its own that was recorded with the claim (not Tensora's 127.0.0.1)
        assert claim["address"] != "127.0.0.1" and seen.url == f"http://{claim['address']}:{claim['port']}/v1"
        again.stop("rp_crash")
        deadline = time.monotonic() + 30
        while any(s.state is not ReplicaState.STOPPED for s in again.observe()):
            assert time.monotonic() < deadline
            time.sleep(0.1)
        assert replica_processes("rp_crash") == []
    finally:
        child.kill()
        for pid in replica_processes("rp_crash"):
            os.killpg(pid, signal.SIGKILL)
