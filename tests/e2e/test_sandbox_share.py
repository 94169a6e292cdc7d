"""A sandbox cannot take the host's clients' share of the control API's or the gateway's connections.

Every sandbox reaches Tensora's servers through pasta, whose spliced connections arrive on the host from
127.0.0.1, the address of the admin's CLI and dashboard. Here a process in a network namespace served by pasta,
made by the sandboxes' own code (``network.start``) with the forwards the local driver gives its sandboxes
(``serve.sandbox_forwards``), opens its whole per-client share of connections to a server at 127.0.0.1:<port>
inside (the URL a replica uses), holds them with heads that never end, and sees its one connection too many
refused; the admin's request from the host to the same port must still be served. ``tensora up`` runs the API
under uvicorn's supervisor and the gateway in its own process; ``tensora serve --no-controller`` runs the API in
one process. A sandbox port that cannot be bound stops the start, named by its setting.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tensora.config.settings import ServeSettings
from tensora.sandbox import network
from tensora.serve import sandbox_forwards
from tests.support.services import free_port, stop, sweep
from tests.support.up import SMALL_MACHINE, launch_up, up_env

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240),
              pytest.mark.skipif(os.geteuid() != 0 or not all(shutil.which(t) for t in ("pasta", "nsenter")),
                                 reason="needs root, pasta and nsenter (a sandbox's network)")]

SHARE = 6  # max_connections_per_client, of the API and the gateway: a few connections reach it
BOUNDS = f"max_connections_per_client: {SHARE}\nheader_timeout_s: 60\n"
CONFIG = (SMALL_MACHINE + BOUNDS
          + f"gateway: {{max_connections_per_client: {SHARE}, header_timeout_s: 60, idle_timeout_s: 60}}\n")

HOLDER = r"""
import socket, sys, time
port, n = int(sys.argv[1]), int(sys.argv[2])
held = []
for _ in range(n):  # the share, each with a head that never ends
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    s.sendall(b"GET /healthz HTTP/1.1\r\n")
    held.append(s)
for _ in range(50):  # one more, until the server has counted the others (they reach it through pasta)
    extra = socket.create_connection(("127.0.0.1", port), timeout=10)
    extra.sendall(b"GET /healthz HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
    answer = extra.recv(65536).split(b"\r\n")[0].decode()
    extra.close()
    if " 503 " in answer:
        break
    time.sleep(0.1)
print(answer, flush=True)
sys.stdin.read()  # hold the share until the host's client has asked
"""


@contextlib.contextmanager
def sandbox_network(bundle: Path, settings: ServeSettings) -> Iterator[Path]:
    """A namespace served by pasta as a sandbox's is, with the local driver's forwards; its file."""
    bundle.mkdir(mode=0o700)
    plan = network.NetworkPlan(bundle, allow_host_ports=tuple(sandbox_forwards(settings)))
    network.start(plan)
    try:
        yield plan.netns
    finally:
        network.stop(bundle)


@contextlib.contextmanager
def holding_share(netns: Path, port: int) -> Iterator[str]:
    """A process in ``netns`` holding its share of connections to 127.0.0.1:``port``; what its one more got."""
    proc = subprocess.Popen(["nsenter", f"--net={netns}", sys.executable, "-c", HOLDER, str(port), str(SHARE)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().strip()
        assert line, proc.stderr.read() if proc.stderr else ""
        yield line
    finally:
        with contextlib.suppress(BrokenPipeError):
            proc.communicate("", timeout=30)
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def host_get(port: int, key: str) -> int:
    return httpx.get(f"http://127.0.0.1:{port}/v1/workloads", headers={"Authorization": f"Bearer {key}"},
                     timeout=10).status_code


def test_a_sandbox_holding_its_share_leaves_the_admin_the_api_and_the_gateway(tmp_path: Path) -> None:
    port, gateway_port = free_port(), free_port()
    up = launch_up(tmp_path, tmp_path / "data", port, gateway_port, CONFIG)
    try:
        up.wait_ready()
        settings = ServeSettings(data_dir=up.data, driver="local", port=port, gateway_port=gateway_port,
                                 gateway={"port": gateway_port})
        with sandbox_network(tmp_path / "sandbox", settings) as netns:
            with holding_share(netns, port) as extra:
                assert extra.startswith("HTTP/1.1 503"), extra  # the sandboxes' share is full
                assert host_get(port, up.key()) == 200  # the admin's is not
            with holding_share(netns, gateway_port) as extra:
                assert extra.startswith("HTTP/1.1 503"), extra
                assert host_get(gateway_port, up.key()) != 503  # the gateway answers the admin (no route: 404)
    finally:
        up.kill()
        sweep(up.data)


def test_the_single_process_api_counts_its_sandboxes_apart(tmp_path: Path) -> None:
    port = free_port()
    data = tmp_path / "data"
    env = up_env({"TENSORA_DRIVER": "local", "TENSORA_METRICS_LISTEN": "", "TENSORA_HEADER_TIMEOUT_S": "60",
                "TENSORA_MAX_CONNECTIONS_PER_CLIENT": str(SHARE)})
    log = tmp_path / "serve.log"
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "tensora.cli", "serve", "--no-controller", "--data-dir",
                                 str(data), "--port", str(port)], stdout=out, stderr=subprocess.STDOUT, env=env,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, log.read_text()
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2).status_code == 200 \
                        and (data / "admin-key").exists():
                    break
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        key = (data / "admin-key").read_text().strip()
        settings = ServeSettings(data_dir=data, driver="local", port=port)
        with sandbox_network(tmp_path / "sandbox", settings) as netns, holding_share(netns, port) as extra:
            assert extra.startswith("HTTP/1.1 503"), extra
            assert host_get(port, key) == 200
    finally:
        stop(proc)


@pytest.mark.parametrize("mode", [["--no-controller"], []], ids=["one process", "workers beside the controller"])
def test_serve_names_a_sandbox_port_it_cannot_listen_on(mode: list[str], tmp_path: Path) -> None:
    with socket.socket() as other:  # listens, never answers
        other.bind(("127.0.0.1", 0))
        other.listen()
        taken = other.getsockname()[1]
        env = up_env({"TENSORA_DRIVER": "local", "TENSORA_METRICS_LISTEN": "", "TENSORA_SANDBOX_PORT": str(taken)})
        result = subprocess.run([sys.executable, "-m", "tensora.cli", "serve", "--data-dir", str(tmp_path / "data"),
                                 "--port", str(free_port()), *mode], capture_output=True, text=True, env=env,
                                stdin=subprocess.DEVNULL, timeout=60)
    assert result.returncode == 2, result
    assert result.stderr == (f"error: sandbox_port: cannot listen on 127.0.0.1:{taken} for sandboxes "
                             "(Address already in use): choose another port\n"), result.stderr
