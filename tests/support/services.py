"""Real services for tests and benchmarks: a throwaway PostgreSQL cluster, and a live
control API server (uvicorn in a thread, on a free loopback port).

PostgreSQL comes from Debian's package (the test command installs it when missing). As
root, ``initdb`` and ``pg_ctl`` run as the ``postgres`` user. Set ``TENSORA_TEST_PG_URL``
to use an existing server instead.
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _pg_bin(name: str) -> str:
    found = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"))
    if found:
        return found[-1]
    path = shutil.which(name)
    if path:
        return path
    raise RuntimeError(f"PostgreSQL's {name} not found: install Debian's postgresql (./scripts/test does)")


class PgCluster:
    """A PostgreSQL server in a temp dir, on loopback, trust auth, fsync off (tests only)."""

    def __init__(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="tensora-pg-"))
        self.port = free_port()
        self.admin_url = f"postgresql://postgres@127.0.0.1:{self.port}/postgres"
        self._as_postgres = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
        self._n = 0

    def _run(self, *cmd: str) -> None:
        subprocess.run([*self._as_postgres, *cmd], check=True, capture_output=True, timeout=60)

    def start(self) -> PgCluster:
        (self.dir / "sock").mkdir()
        if self._as_postgres:
            shutil.chown(self.dir, "postgres", "postgres")
            shutil.chown(self.dir / "sock", "postgres", "postgres")
        data = str(self.dir / "data")
        self._run(_pg_bin("initdb"), "-D", data, "-U", "postgres", "--auth=trust", "-E", "UTF8",
                  "--locale=C.UTF-8", "--no-sync")
        self.pg_start()
        return self

    def pg_start(self) -> None:
        self._run(_pg_bin("pg_ctl"), "-D", str(self.dir / "data"), "-l", str(self.dir / "server.log"), "-w",
                  "-t", "30", "-o", f"-c listen_addresses=127.0.0.1 -p {self.port} -k {self.dir / 'sock'} "
                  "-c fsync=off -c synchronous_commit=off -c full_page_writes=off -c max_connections=300", "start")

    def pg_stop(self) -> None:
        self._run(_pg_bin("pg_ctl"), "-D", str(self.dir / "data"), "-m", "fast", "-w", "stop")

    def new_database(self) -> str:
        """A fresh, empty database; its SQLAlchemy-ready URL."""
        self._n += 1
        name = f"t{os.getpid()}_{self._n}"
        with psycopg.connect(self.admin_url, autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        return f"postgresql://postgres@127.0.0.1:{self.port}/{name}"

    def stop(self) -> None:
        with contextlib.suppress(Exception):
            self.pg_stop()
        shutil.rmtree(self.dir, ignore_errors=True)


class ExternalPg(PgCluster):
    """An existing server named by TENSORA_TEST_PG_URL (a superuser URL)."""

    def __init__(self, url: str) -> None:
        self.admin_url = url
        self._n = 0
        self.port = int(url.rsplit(":", 1)[1].split("/")[0])
        self.dir = Path(tempfile.mkdtemp(prefix="tensora-pg-ext-"))

    def start(self) -> PgCluster:
        return self

    def new_database(self) -> str:
        self._n += 1
        name = f"t{os.getpid()}_{int(time.time())}_{self._n}"
        with psycopg.connect(self.admin_url, autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        return self.admin_url.rsplit("/", 1)[0] + "/" + name

    def stop(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


def pg_cluster() -> PgCluster:
    url = os.environ.get("TENSORA_TEST_PG_URL")
    return (ExternalPg(url) if url else PgCluster()).start()


class LiveServer:
    """The control API app served by uvicorn in a thread on 127.0.0.1:<free port>."""

    def __init__(self, app: Any) -> None:
        import uvicorn

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="error", access_log=False,
                                lifespan="on", timeout_graceful_shutdown=5)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> LiveServer:
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the test server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=15)


@contextlib.contextmanager
def serving(app: Any) -> Iterator[LiveServer]:
    with LiveServer(app) as live:
        yield live


def redis_process(port: int) -> subprocess.Popen[bytes]:
    """Debian's redis-server on loopback ``port``, nothing saved, answering PING when this returns."""
    exe = shutil.which("redis-server")
    if exe is None:
        raise RuntimeError("redis-server not found: install Debian's redis-server (./scripts/test does)")
    proc = subprocess.Popen([exe, "--bind", "127.0.0.1", "--port", str(port), "--save", "", "--appendonly", "no"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 10
    while True:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1) as s:
            s.sendall(b"PING\r\n")
            if s.recv(16).startswith(b"+PONG"):
                return proc
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError("redis-server did not start")
        time.sleep(0.03)


@contextlib.contextmanager
def redis_server() -> Iterator[str]:
    """A throwaway Redis (Debian's redis-server) on a free loopback port, nothing saved; yields its URL."""
    port = free_port()
    proc = redis_process(port)
    try:
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.terminate()
        proc.wait(10)


def sweep(data: Path) -> None:
    """Delete every sandbox of a data dir (processes, network, cgroups), whatever a test left running:
    replicas outlive `tensora up` by design, and a killed pid alone leaves its sandbox's pasta and state."""
    from tensora.sandbox.runc import Runc

    runner = Runc(data / "sandboxes" / "runc", data / "sandboxes" / "bundles")
    if runner.root.exists():
        for sandbox_id in runner.list():
            runner.delete(sandbox_id)
    unmount_under(data)  # notebooks' homes: file systems of their own, loop-mounted


def unmount_under(root: Path) -> None:
    """Unmount (lazily) every mount below ``root``, deepest first; their loop devices go with them."""
    prefix = str(root.resolve()) + "/"
    with open("/proc/self/mounts") as f:
        points = [line.split()[1].encode().decode("unicode_escape") for line in f]
    for point in sorted((p for p in points if p.startswith(prefix)), key=len, reverse=True):
        subprocess.run(["umount", "-l", point], capture_output=True, check=False)


def stop(proc: subprocess.Popen[Any]) -> int:
    """SIGTERM ``proc`` and wait for it (30 s), then SIGKILL; its exit code."""
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()
