"""``tensora up`` as a newcomer meets it, real processes on free ports with a temp data dir: the banner
(the node it offers on a 2-core, 24 GiB machine, the dashboard, the gateway), a clean start without
warnings, one ``up`` per data dir and port, a port held by another program, a crashed ``up`` that
blocks nothing, Ctrl-C saying what keeps running, and the gateway's warning about its control API."""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tensora.config.settings import ServeSettings
from tensora.serve import build, ensure_admin_key
from tests.support.services import free_port, sweep
from tests.support.up import SMALL_MACHINE, START_DEADLINE_S, Up, launch_up, running_up, up_env

pytestmark = pytest.mark.slow
NODE_LINE = ("this machine as node box: 2 cores offered as 8 vCPU (overcommit 4x: replicas share the cores; "
             "CPU classes up to 2 vCPU), 22Gi, no GPUs; each owner may run 4 vCPU at once (the admin owner: the "
             "whole node)")


def _second(tmp_path: Path, data: Path, port: int, gateway_port: int,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tensora.cli", "up", "--data-dir", str(data), "--port", str(port),
                           "--gateway-port", str(gateway_port), "--config", str(tmp_path / "up.yaml")],
                          capture_output=True, text=True, timeout=60, env=up_env(env), stdin=subprocess.DEVNULL)


def _port_block(taken: set[int]) -> int:
    """An API port P such that P, P + 1 (its gateway) and each one's metrics (+ 10) and sandbox (+ 20) ports are
    free now and none in ``taken``; those are added to it."""
    rng = random.Random()
    for _ in range(200):
        base = rng.randrange(20000, 60000)
        block = {base + d for d in (0, 1, 10, 11, 20, 21)}
        if block & taken:
            continue
        with contextlib.ExitStack() as held:
            try:
                for p in block:
                    s = held.enter_context(socket.socket())
                    s.bind(("127.0.0.1", p))
            except OSError:
                continue
        taken |= block
        return base
    raise AssertionError("no free block of ports")


def _refused(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(2)
        return s.connect_ex(("127.0.0.1", port)) != 0


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and p.suffix not in (".db-wal", ".db-shm")}


# -- the banner, a clean start, one tensora up at a time -----------------------------------------------

def test_the_banner_names_node_dashboard_and_gateway_and_a_clean_start_warns_of_nothing(tmp_path: Path) -> None:
    with running_up(tmp_path) as up:
        lines = up.stdout().splitlines()
        assert f"tensora control API on http://127.0.0.1:{up.port}  (docs: /docs)" in lines
        assert f"dashboard on http://127.0.0.1:{up.port}/  (sign in with an API key)" in lines
        assert NODE_LINE in lines
        # which runtimes are installed, and that an endpoint needing one installs it (tensora up's default)
        assert any(line.startswith("runtimes installed: ") and line.endswith(
            "; the first endpoint that needs one installs it") for line in lines), lines
        assert f"OpenAI-compatible gateway on http://127.0.0.1:{up.gateway_port}/v1  (the same keys)" in lines
        # where the metrics are, and they answer there (Prometheus' text format)
        assert f"metrics on http://127.0.0.1:{up.metrics_port}/metrics" in lines
        assert f"gateway metrics on http://127.0.0.1:{up.gateway_metrics_port}/metrics" in lines
        for port, family in ((up.metrics_port, "tensora_controller_leader"),
                             (up.gateway_metrics_port, "tensora_gateway_breakers")):
            assert family in httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
        page = httpx.get(f"http://127.0.0.1:{up.port}/", follow_redirects=True, timeout=10)
        assert page.status_code == 200 and "key" in page.text.lower()  # the dashboard, asking to sign in
        # the gateway polled its routes while the API beside it was still starting: no warning for that
        assert "unreachable" not in up.output() and "WARNING" not in up.output(), up.output()
        # the API's catalog agrees with the controller: CPU classes above the 2 shared cores never fit
        catalog = httpx.get(f"{up.api}/v1/catalog", headers={"Authorization": f"Bearer {up.key()}"},
                            timeout=10).json()
        total = {c["name"]: c["capacity"]["local"]["total"] for c in catalog["data"] if c["kind"] == "cpu"}
        assert total == {"cpu-1c-4g": 5, "cpu-2c-8g": 2, "cpu-4c-16g": 0, "cpu-8c-32g": 0, "cpu-16c-64g": 0,
                         "cpu-32c-128g": 0}
        # the running quotas are the node's (half of it), not the fixed 32 vCPU and 2 GPUs: one owner cannot
        # hold the machine; the HTTP workers answer with them too. The machine's operator (owner admin) may
        # run the whole node, as its own quotas say.
        def running(owner: str) -> tuple[float, int]:
            got = httpx.get(f"{up.api}/v1/owners/{owner}", headers={"Authorization": f"Bearer {up.key()}"},
                            timeout=10).json()
            return got["quotas"]["running_cpu"], got["quotas"]["running_gpus"]

        assert (running("alice"), running("admin")) == ((4, 2), (8, 2))  # GPUs: none to bound
        assert up.interrupt() == 0, up.output()
    assert up.stdout().splitlines()[-1] == "stopped the API and gateway; no workloads are running"
    assert "Traceback" not in up.output()


def test_a_second_up_says_where_the_first_runs_and_exits_1_before_writing_anything(tmp_path: Path) -> None:
    with running_up(tmp_path) as first:
        before = _tree(first.data)
        # the same data dir, other ports: the data dir's lock says who holds it
        same_dir = _second(tmp_path, first.data, free_port(), free_port())
        # another data dir, the same API port: whoever listens there is a Tensora
        other = tmp_path / "other"
        same_port = _second(tmp_path, other, first.port, free_port())
        for second in (same_dir, same_port):
            assert second.returncode == 1, second
            assert second.stdout == ""  # no banner
            assert second.stderr == (f"error: Tensora is already running on 127.0.0.1:{first.port} "
                                     f"(pid {first.popen.pid})\n")
        assert not other.exists()
        assert _tree(first.data) == before
        assert json.loads((first.data / "up.pid").read_text()) == {
            "pid": first.popen.pid, "api": f"127.0.0.1:{first.port}", "gateway": f"127.0.0.1:{first.gateway_port}"}
        assert first.popen.poll() is None  # and the first runs on


# -- two on one machine: each its own metrics ---------------------------------------------------------------

def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def _operator(up: Up) -> dict[str, Any]:
    got: dict[str, Any] = httpx.get(f"{up.api}/v1/operator", headers={"Authorization": f"Bearer {up.key()}"},
                                    timeout=10).json()
    return got


def test_two_ups_on_other_ports_and_data_dirs_each_serve_and_read_their_own_metrics(tmp_path: Path) -> None:
    taken: set[int] = set()
    first_port, second_port = _port_block(taken), _port_block(taken)
    first = launch_up(tmp_path, tmp_path / "first", first_port, first_port + 1, derived_metrics=True)
    try:
        first.wait_ready()
        second = launch_up(tmp_path, tmp_path / "second", second_port, second_port + 1, derived_metrics=True)
        try:
            second.wait_ready()
            for up in (first, second):  # beside its own ports: API + 10, gateway + 10
                lines = up.stdout().splitlines()
                assert f"metrics on http://127.0.0.1:{up.port + 10}/metrics" in lines, up.output()
                assert f"gateway metrics on http://127.0.0.1:{up.gateway_port + 10}/metrics" in lines, up.output()
                for port, family in ((up.port + 10, "tensora_controller_leader"),
                                     (up.gateway_port + 10, "tensora_gateway_breakers")):
                    assert family in httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
                assert "metrics not served" not in up.output() and "WARNING" not in up.output(), up.output()
            ops = _operator(second)
            assert ops["control"] is True and ops["gateway"] is True, ops
            # the first one gone, the second's operator page still reads a gateway: its own, not the first's
            assert first.interrupt() == 0, first.output()
            assert _refused(first.gateway_port + 10) and _refused(first.port + 10)
            ops = _operator(second)
            assert ops["control"] is True and ops["gateway"] is True, ops
        finally:
            second.kill()
    finally:
        first.kill()


@pytest.mark.parametrize("setting", ["metrics_listen", "gateway.metrics_listen"])
def test_a_second_up_whose_metrics_address_the_first_holds_stops_naming_the_setting(setting: str,
                                                                                      tmp_path: Path) -> None:
    with running_up(tmp_path) as first:
        held = first.metrics_port if setting == "metrics_listen" else first.gateway_metrics_port
        env = {"TENSORA_METRICS_LISTEN" if setting == "metrics_listen" else "TENSORA_GATEWAY_METRICS_LISTEN":
               f"127.0.0.1:{held}"}
        other = tmp_path / "other"
        result = _second(tmp_path, other, free_port(), free_port(), env)
        assert result.returncode == 1, result
        assert result.stdout == ""  # no banner: it said nothing it would not serve
        said = re.fullmatch(rf"error: cannot serve metrics on 127\.0\.0\.1:{held}: another Tensora \(pid (\d+)\) "
                            rf"listens there; set {re.escape(setting)} to a free host:port, or to null for no "
                            r"metrics\n", result.stderr)
        assert said is not None, result.stderr
        pid = int(said[1])  # the first up, or its gateway's process
        assert pid == first.popen.pid or _parent(pid) == first.popen.pid, (pid, first.popen.pid)
        assert not other.exists()
        assert first.popen.poll() is None


@pytest.mark.parametrize("held", ["--port", "--gateway-port"])
def test_a_port_held_by_another_program_is_named_with_the_flag_that_moves_it(held: str, tmp_path: Path) -> None:
    (tmp_path / "up.yaml").write_text(SMALL_MACHINE)
    with socket.socket() as other:  # listens, never answers: not Tensora
        other.bind(("127.0.0.1", 0))
        other.listen()
        taken = other.getsockname()[1]
        ports = (taken, free_port()) if held == "--port" else (free_port(), taken)
        result = _second(tmp_path, tmp_path / "data", *ports)
    assert result.returncode == 1, result
    assert result.stdout == ""
    assert result.stderr == (f"error: port {taken} is in use by another program (not Tensora): "
                             f"choose another with {held}\n")
    assert not (tmp_path / "data").exists()


@pytest.mark.parametrize("held", ["sandbox_port", "gateway.sandbox_port"])
def test_a_sandbox_port_held_by_another_program_is_named_with_the_setting_that_moves_it(held: str,
                                                                                         tmp_path: Path) -> None:
    with socket.socket() as other:  # listens, never answers: not Tensora
        other.bind(("127.0.0.1", 0))
        other.listen()
        taken = other.getsockname()[1]
        setting = f"sandbox_port: {taken}\n" if held == "sandbox_port" else f"gateway: {{sandbox_port: {taken}}}\n"
        (tmp_path / "up.yaml").write_text(SMALL_MACHINE + setting)
        result = _second(tmp_path, tmp_path / "data", free_port(), free_port())
    assert result.returncode == 1, result
    assert result.stdout == ""
    assert result.stderr == (f"error: port {taken} is in use by another program (not Tensora): "
                             f"choose another with {held}\n")
    assert not (tmp_path / "data").exists()


def test_a_crashed_up_leaves_no_server_on_its_ports_and_blocks_nothing(tmp_path: Path) -> None:
    data, port, gateway_port = tmp_path / "data", free_port(), free_port()
    with running_up(tmp_path, data, port, gateway_port) as first:
        first.popen.send_signal(signal.SIGKILL)  # the main process only: its API worker and gateway are children
        first.popen.wait(timeout=10)
        deadline = time.monotonic() + 10
        while not (_refused(port) and _refused(gateway_port)):
            assert time.monotonic() < deadline, "a server of the crashed tensora up still holds its port"
            time.sleep(0.1)
    assert (data / "up.pid").exists()  # left behind, but nobody holds its lock
    # serving at once (its controller leads once the crashed one's lease expires, lease_ttl_s)
    with running_up(tmp_path, data, port, gateway_port, leader=False) as second:
        assert NODE_LINE in second.stdout().splitlines()
        assert second.interrupt() == 0, second.output()


# -- Ctrl-C ------------------------------------------------------------------------------------------------

def _placed(c: httpx.Client, workload_id: str) -> dict[str, Any]:
    deadline = time.monotonic() + 60
    while True:
        w: dict[str, Any] = c.get(f"/v1/workloads/{workload_id}").json()
        if w["state"] in ("running", "failed"):
            return w
        assert time.monotonic() < deadline, w
        time.sleep(0.2)


def test_ctrl_c_says_which_workloads_keep_running_and_they_do(tmp_path: Path) -> None:
    """A notebook and a VM as the quick start makes them (an L40S asked for, CPU at once) share the 2 cores,
    with room left for the quick start's endpoint; Ctrl-C stops the servers and says the two keep running."""
    pids: list[int] = []
    try:
        with running_up(tmp_path) as up:
            with httpx.Client(base_url=up.api, headers={"Authorization": f"Bearer {up.key()}"}, timeout=10) as c:
                made = [c.post("/v1/workloads", json={"kind": kind, "name": kind, "gpu_class": "l40s-48gb",
                                                      "fallback": ["cpu"], "fallback_after": 0}).json()
                        for kind in ("notebook", "vm")]
                placed = [_placed(c, w["id"]) for w in made]
                assert [(w["state"], w["placed_class"]) for w in placed] == [("running", "cpu-2c-8g")] * 2, placed
                free = {x["name"]: x["capacity"]["local"]["free"] for x in c.get("/v1/catalog").json()["data"]}
                assert free["cpu-1c-4g"] == 1  # the quick start's endpoint (a tiny model) still fits
            pids = [int(json.loads(p.read_text())["pid"]) for p in (up.data / "replicas").glob("*/replica.json")]
            assert len(pids) == 2
            assert up.interrupt() == 0, up.output()
            assert up.stdout().splitlines()[-1] == (
                "stopped the API and gateway; 2 workloads keep running (2 replicas): the next `tensora up` adopts "
                "them; to stop them, start it and run `tensora workloads stop NAME`")
            assert _refused(up.port) and _refused(up.gateway_port)
            for pid in pids:
                os.kill(pid, 0)  # still there (ProcessLookupError otherwise)
    finally:
        sweep(tmp_path / "data")  # the replicas outlive tensora up by design: delete their sandboxes


# -- the gateway and its control API ---------------------------------------------------------------------

def test_the_gateway_is_quiet_while_its_api_starts_and_warns_once_when_it_goes(tmp_path: Path) -> None:
    data, port, gateway_port = tmp_path / "data", free_port(), free_port()
    services = build(ServeSettings(data_dir=data, controller=False))  # the store and admin key, as a first start
    ensure_admin_key(services.db, data, time.time())
    services.db.dispose()
    env = up_env({"TENSORA_GATEWAY_POLL_S": "0.2", "TENSORA_GATEWAY_STARTUP_GRACE_S": "30"})
    log = tmp_path / "gateway.log"
    procs: list[subprocess.Popen[bytes]] = []
    try:
        with log.open("wb") as f:
            procs.append(subprocess.Popen([sys.executable, "-m", "tensora.cli", "gateway", "--data-dir", str(data),
                                           "--port", str(gateway_port), "--control-url", f"http://127.0.0.1:{port}"],
                                          stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env))
        time.sleep(1.5)  # polls fail: nothing listens on the API's port yet
        with (tmp_path / "serve.log").open("wb") as f:
            api = subprocess.Popen([sys.executable, "-m", "tensora.cli", "serve", "--data-dir", str(data),
                                    "--port", str(port), "--no-controller"],
                                   stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=up_env())
        procs.append(api)
        deadline = time.monotonic() + START_DEADLINE_S
        while True:  # the gateway has routes once the API answered it
            with contextlib.suppress(httpx.HTTPError, ValueError):
                if httpx.get(f"http://127.0.0.1:{gateway_port}/readyz", timeout=2).json().get("routes"):
                    break
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        assert "unreachable" not in log.read_text()
        api.terminate()  # a real outage, well within the startup grace: warned at once, and once
        api.wait(timeout=20)
        deadline = time.monotonic() + 10
        while "control API unreachable" not in log.read_text():
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        time.sleep(1.0)  # five more failed polls
        assert log.read_text().count("control API unreachable") == 1, log.read_text()
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
