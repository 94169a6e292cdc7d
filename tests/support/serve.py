"""``tensora serve`` as a child process, as users run it: the entry point's command line, a child with its output
in files, and ``served``, a ready server that is stopped on the way out."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.services import free_port

START_DEADLINE_S = 30.0
EXIT_DEADLINE_S = 20.0
FAST = {"TENSORA_TICK_S": "0.1", "TENSORA_START_DELAY_S": "0.2"}  # a quick controller and simulated fleet


def command() -> list[str]:
    """The ``tensora`` command: the installed script, or the CLI's module where none is installed."""
    script = shutil.which("tensora")
    if script:
        return [script]
    return [sys.executable, "-c", "import sys; from tensora.cli import main; sys.argv[0] = 'tensora'; main()"]


@dataclass
class Proc:
    """One ``tensora serve`` child, its output in files (a pipe could fill up and stall it)."""

    popen: subprocess.Popen[bytes]
    url: str
    port: int
    out: Path
    err: Path

    def output(self) -> str:
        return self.out.read_text(errors="replace") + self.err.read_text(errors="replace")

    def exit_code(self) -> int:
        """For a start that should fail: its exit code (killed, and the test fails, if it does not exit)."""
        try:
            return self.popen.wait(timeout=START_DEADLINE_S)
        finally:
            if self.popen.poll() is None:
                self.popen.kill()
                self.popen.wait(timeout=10)

    def terminate(self) -> int:
        """SIGTERM to this child only; its exit code, waited for within EXIT_DEADLINE_S."""
        if self.popen.poll() is None:
            os.kill(self.popen.pid, signal.SIGTERM)
        return self.popen.wait(timeout=EXIT_DEADLINE_S)


def serve_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This process's environment less its TENSORA_* settings, with a quick controller (FAST) and ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TENSORA_")}
    env.update(FAST)
    env.update(extra or {})
    return env


def launch_serve(tmp_path: Path, args: list[str], env: dict[str, str] | None = None, port: int | None = None,
                 tag: str = "serve") -> Proc:
    """``tensora serve ARGS`` started (not waited for), its output in ``tmp_path``."""
    n = len(list(tmp_path.glob(f"{tag}-*.out")))
    out, err = tmp_path / f"{tag}-{n}.out", tmp_path / f"{tag}-{n}.err"
    with out.open("wb") as o, err.open("wb") as e:
        popen = subprocess.Popen([*command(), "serve", *args], stdout=o, stderr=e, stdin=subprocess.DEVNULL,
                                 env=serve_env(env), cwd=tmp_path)
    port = port if port is not None else 0
    return Proc(popen, f"http://127.0.0.1:{port}", port, out, err)


def wait_ready(proc: Proc) -> dict[str, Any]:
    """Until the child's /readyz answers 200 (its body); the test fails if it exits or is not ready in time."""
    deadline = time.monotonic() + START_DEADLINE_S
    while True:
        if proc.popen.poll() is not None:
            pytest.fail(f"tensora serve exited with {proc.popen.returncode}:\n{proc.output()}")
        with contextlib.suppress(httpx.TransportError):
            r = httpx.get(f"{proc.url}/readyz", timeout=2)
            if r.status_code == 200:
                body: dict[str, Any] = r.json()
                return body
        if time.monotonic() > deadline:
            pytest.fail(f"tensora serve not ready within {START_DEADLINE_S}s:\n{proc.output()}")
        time.sleep(0.1)


@contextlib.contextmanager
def served(tmp_path: Path, data_dir: Path, *extra: str, env: dict[str, str] | None = None) -> Iterator[Proc]:
    """``tensora serve --data-dir DATA --port FREE EXTRA...``, ready; SIGTERMed (or killed) on the way out."""
    port = free_port()
    proc = launch_serve(tmp_path, ["--data-dir", str(data_dir), "--port", str(port), *extra], env=env, port=port)
    try:
        wait_ready(proc)
        yield proc
    finally:
        if proc.popen.poll() is None:
            try:
                proc.terminate()
            except subprocess.TimeoutExpired:
                proc.popen.kill()
                proc.popen.wait(timeout=10)


@contextlib.contextmanager
def served_with_an_owner(tmp: Path, env: dict[str, str]) -> Iterator[tuple[str, str, str]]:
    """``served`` with ``env``, and a key of owner alice: its URL, the admin's key and alice's."""
    from tensora.sdk import Client

    with served(tmp, tmp / "data", env=env) as proc:
        admin = (tmp / "data" / "admin-key").read_text().strip()
        with Client(admin, proc.url) as sdk:
            alice = sdk.create_key("alice", owner="alice").key
        assert alice
        yield proc.url, admin, alice
