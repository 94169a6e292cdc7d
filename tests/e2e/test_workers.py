"""``tensora serve --workers N``: several HTTP worker processes, the controller in the
supervising one, woken over a unix socket. And the wake socket on its own."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from tensora.control.wake import WakeListener, WakeSender, socket_path
from tests.support.services import free_port


def test_a_datagram_wakes_the_listener(tmp_path: Path) -> None:
    woken = threading.Event()
    path = socket_path(tmp_path, "local")
    listener = WakeListener(path, woken.set).start()
    try:
        assert oct(path.stat().st_mode & 0o777) == "0o600"
        send = WakeSender(path)
        send()
        send.close()
        assert woken.wait(5)
    finally:
        listener.close()
    assert not path.exists()


def test_a_sender_without_a_listener_neither_blocks_nor_raises(tmp_path: Path) -> None:
    send = WakeSender(socket_path(tmp_path, "nowhere"))
    for _ in range(3):
        assert send() is None  # nothing listens: the datagram is dropped, the request goes on
    send.close()
    path = socket_path(tmp_path, "deaf")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as deaf:
        deaf.bind(str(path))  # bound, never read: its queue fills up
        full = WakeSender(path)
        for _ in range(10_000):  # a send that blocked on the full queue would never come back
            assert full() is None
        full.close()


def test_socket_paths_are_short_and_differ_by_data_dir_and_region(tmp_path: Path) -> None:
    deep = tmp_path / ("d" * 90) / ("e" * 90)
    paths = {socket_path(deep, "local"), socket_path(tmp_path, "local"), socket_path(tmp_path, "eu-west")}
    assert len(paths) == 3
    assert all(len(str(p)) < 100 for p in paths)


@pytest.mark.slow
def test_workers_share_the_store_and_wake_the_controller_at_once(tmp_path: Path) -> None:
    port = free_port()
    env = {**os.environ, "TENSORA_TICK_S": "60", "TENSORA_START_DELAY_S": "0"}
    log = (tmp_path / "serve.log").open("w")
    proc = subprocess.Popen([sys.executable, "-m", "tensora.cli", "serve", "--data-dir", str(tmp_path / "data"),
                             "--port", str(port), "--workers", "2"], stdout=log, stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()
            try:
                if httpx.get(url + "/readyz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "serve --workers 2 did not become ready"
            time.sleep(0.2)
        key = (tmp_path / "data" / "admin-key").read_text().strip()
        h = {"Authorization": f"Bearer {key}"}
        if Path("/proc/self/environ").exists():  # the workers' settings came as their factory's argument
            children = _children(proc.pid)
            assert children
            for pid in children:
                environ = Path(f"/proc/{pid}/environ").read_bytes()
                assert b"TENSORA_SERVE_" not in environ and str(tmp_path / "data").encode() not in environ
        # the controller's first cycle ran at start; the next tick is a minute away, so a
        # workload placed within seconds was placed because a worker woke the controller
        time.sleep(1)
        ids = []
        with httpx.Client(base_url=url, headers=h, timeout=10) as client:
            for i in range(6):  # new connections: the kernel spreads them over both workers
                r = httpx.post(url + "/v1/workloads", headers=h, timeout=10,
                               json={"kind": "notebook", "name": f"nb-{i}", "gpu_class": "cpu-2c-8g"})
                assert r.status_code == 201, r.text
                ids.append(r.json()["id"])
            deadline = time.monotonic() + 15
            states: dict[str, str] = {}
            while time.monotonic() < deadline:
                states = {w: client.get(f"/v1/workloads/{w}").json()["state"] for w in ids}
                if all(s == "running" for s in states.values()):
                    break
                time.sleep(0.2)
            assert all(s == "running" for s in states.values()), states
            listed = client.get("/v1/workloads", params={"limit": 50}).json()["data"]
            assert {w["id"] for w in listed} == set(ids)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            rc = proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = proc.wait()
        log.close()
    assert rc == 0, (tmp_path / "serve.log").read_text()


def _children(pid: int) -> list[int]:
    """Linux: the processes whose parent is ``pid``."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if ppid == pid:
            out.append(int(stat.parent.name))
    return out
