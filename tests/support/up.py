"""``tensora up`` as a child process, as users run it: ``running_up`` (a small machine declared, the metrics on
ports of their own) and ``tensora_up`` (a machine with room for sandboxed tenants, whatever it left running deleted
after), and the API clients the tests talk to it with."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tensora.sandbox import Runc, available
from tests.support.services import free_port

START_DEADLINE_S = 60.0
SMALL_MACHINE = "node: {name: box, cpu: 2, memory: 24Gi, gpus: {}}\ntick_s: 1\n"  # this machine's size, declared

WHY_NOT_SANDBOX = available()
needs_sandbox = pytest.mark.skipif(WHY_NOT_SANDBOX is not None, reason=f"no sandbox on this host: {WHY_NOT_SANDBOX}")


def up_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This process's environment less its TENSORA_* settings, with ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TENSORA_")}
    env.update(extra or {})
    return env


@dataclass
class Up:
    """One ``tensora up`` child in a session of its own (as a terminal's foreground job), output in files."""

    popen: subprocess.Popen[bytes]
    data: Path
    port: int
    gateway_port: int
    out: Path
    err: Path
    metrics_port: int = 0  # the API's and controller's /metrics
    gateway_metrics_port: int = 0

    @property
    def api(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stdout(self) -> str:
        return self.out.read_text(errors="replace")

    def output(self) -> str:
        return self.stdout() + self.err.read_text(errors="replace")

    def key(self) -> str:
        return (self.data / "admin-key").read_text().strip()

    def wait_ready(self, leader: bool = True) -> None:
        """Until the API answers, its controller leads (unless not ``leader``) and the gateway has its
        first routes from the API."""
        deadline = time.monotonic() + START_DEADLINE_S
        while True:
            assert self.popen.poll() is None, f"tensora up exited with {self.popen.returncode}:\n{self.output()}"
            with contextlib.suppress(httpx.HTTPError, ValueError):
                ready = httpx.get(f"{self.api}/readyz", timeout=2).json()
                gateway = httpx.get(f"http://127.0.0.1:{self.gateway_port}/readyz", timeout=2).json()
                if ready.get("status") == "ready" and (ready.get("controller") == "leader" or not leader) \
                        and gateway.get("routes"):
                    return
            assert time.monotonic() < deadline, f"tensora up not ready in {START_DEADLINE_S}s:\n{self.output()}"
            time.sleep(0.2)

    def interrupt(self) -> int:
        """Ctrl-C: SIGINT to its whole process group, as a terminal sends it; the exit code."""
        os.killpg(self.popen.pid, signal.SIGINT)
        return self.popen.wait(timeout=30)

    def kill(self) -> None:
        if self.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.popen.pid, signal.SIGKILL)
            self.popen.wait(timeout=10)


def launch_up(tmp_path: Path, data: Path, port: int, gateway_port: int, config: str = SMALL_MACHINE,
              derived_metrics: bool = False) -> Up:
    """``tensora up`` with ``config`` started in a session of its own (not waited for), its output in ``tmp_path``.
    ``derived_metrics``: the metrics listeners at their defaults, beside the ports (else free ports of their own:
    tests run side by side)."""
    n = len(list(tmp_path.glob("up-*.out")))
    (tmp_path / "up.yaml").write_text(config)
    out, err = tmp_path / f"up-{n}.out", tmp_path / f"up-{n}.err"
    if derived_metrics:
        metrics, gateway_metrics = port + 10, gateway_port + 10
        env = up_env()
    else:
        metrics, gateway_metrics = free_port(), free_port()
        env = up_env({"TENSORA_METRICS_LISTEN": f"127.0.0.1:{metrics}",
                      "TENSORA_GATEWAY_METRICS_LISTEN": f"127.0.0.1:{gateway_metrics}"})
    with out.open("wb") as o, err.open("wb") as e:
        popen = subprocess.Popen([sys.executable, "-m", "tensora.cli", "up", "--data-dir", str(data),
                                  "--port", str(port), "--gateway-port", str(gateway_port),
                                  "--config", str(tmp_path / "up.yaml")],
                                 stdout=o, stderr=e, stdin=subprocess.DEVNULL, env=env, cwd=tmp_path,
                                 start_new_session=True)
    return Up(popen, data, port, gateway_port, out, err, metrics, gateway_metrics)


@contextlib.contextmanager
def running_up(tmp_path: Path, data: Path | None = None, port: int | None = None,
               gateway_port: int | None = None, leader: bool = True) -> Iterator[Up]:
    """``tensora up`` on SMALL_MACHINE, ready (its controller leading unless not ``leader``); killed after."""
    up = launch_up(tmp_path, data or tmp_path / "data", port or free_port(), gateway_port or free_port())
    try:
        up.wait_ready(leader)
        yield up
    finally:
        up.kill()


TENANTS_MACHINE = "node: {cpu: 10, memory: 48Gi, reserve_cpu: 0, reserve_memory: 0}\ntick_s: 1\n"


def start_up(tmp_path: Path, port: int, gw_port: int, n: int) -> tuple[subprocess.Popen[bytes], Path]:
    """``tensora up`` on ``tmp_path``'s data dir (its ``n``th start), once its controller leads; its log."""
    (tmp_path / "up.yaml").write_text(TENANTS_MACHINE)
    log = tmp_path / f"up-{n}.log"
    with log.open("wb") as f:
        proc = subprocess.Popen([sys.executable, "-m", "tensora.cli", "up", "--data-dir", str(tmp_path / "data"),
                                 "--port", str(port), "--config", str(tmp_path / "up.yaml"),
                                 "--gateway-port", str(gw_port)],
                                stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env={k: v for k, v in os.environ.items() if k != "TENSORA_DATA_DIR"})
    deadline = time.monotonic() + 60
    while True:
        assert proc.poll() is None, log.read_text()
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=2).json().get("controller") == "leader":
                return proc, log
        assert time.monotonic() < deadline, log.read_text()
        time.sleep(0.2)


def runc_of(data: Path) -> Runc:
    """The runc that ``tensora up`` on ``data`` runs its sandboxes with."""
    return Runc(data / "sandboxes" / "runc", data / "sandboxes" / "bundles")


@contextlib.contextmanager
def tensora_up(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[bytes], Path, int, int]]:
    """``tensora up`` on a fresh data dir; whatever it left running is deleted after."""
    port, gw_port = free_port(), free_port()
    proc, log = start_up(tmp_path, port, gw_port, 0)
    box = [proc]
    try:
        yield proc, log, port, gw_port
    finally:
        for p in box:
            if p.poll() is None:
                p.send_signal(signal.SIGINT)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.wait(30)
                if p.poll() is None:
                    p.kill()
        data = tmp_path / "data"
        if (data / "sandboxes").exists():
            runner = runc_of(data)
            for sandbox_id in runner.list():
                runner.delete(sandbox_id)


def api_client(port: int, key: str) -> httpx.Client:
    """A client of the API on ``port`` sending ``key``."""
    return httpx.Client(base_url=f"http://127.0.0.1:{port}", headers={"Authorization": f"Bearer {key}"}, timeout=10)


def key_for(admin: httpx.Client, owner: str) -> str:
    """A new API key of ``owner``, made by the admin."""
    made = admin.post("/v1/keys", json={"owner": owner, "name": owner})
    assert made.status_code == 201, made.text
    return str(made.json()["key"])
