"""Waking the controller from another process: one datagram on a local unix socket.

With ``tensora serve --workers N`` (N > 1) the HTTP workers are separate processes and the
controller runs in the supervising one. A worker that created, stopped or restarted a
workload sends one empty datagram; the controller's listener wakes it. Best effort by
design: a lost datagram costs at most one tick (the controller still runs every few
seconds), and a sender never blocks or fails a request.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import socket
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path


def socket_path(data_dir: Path, region: str) -> Path:
    """A short path (unix socket paths are limited to ~100 bytes), unique per data dir and region."""
    tag = hashlib.sha256(f"{Path(data_dir).resolve()}|{region}".encode()).hexdigest()[:16]
    return Path(tempfile.gettempdir()) / f"tensora-wake-{tag}.sock"


class WakeListener:
    """Receives wake datagrams on ``path`` and calls ``on_wake`` for each, in a thread."""

    def __init__(self, path: Path, on_wake: Callable[[], None]) -> None:
        self.path = path
        self.on_wake = on_wake
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.bind(str(path))
        os.chmod(path, 0o600)
        self._sock.settimeout(0.5)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="wake-listener", daemon=True)

    def start(self) -> WakeListener:
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._sock.recv(64)
            except TimeoutError:
                continue
            except OSError:
                return
            self.on_wake()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self._sock.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)


class WakeSender:
    """Sends a wake datagram; never blocks, never raises."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.setblocking(False)

    def __call__(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.sendto(b"w", self.path)

    def close(self) -> None:
        self._sock.close()
