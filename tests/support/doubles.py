"""Test doubles of Tensora's protocols, type-checked against them: mypy covers tests/support, and each double is
assigned to its protocol below, so one that lacks a method (or has it with another signature) fails ``mypy``.
Doubles of what Tensora talks to over the network (a hung Redis) are here too, for one place to find them."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any

from tensora.clock import Clock
from tensora.drivers.base import Driver, ReplicaSpec, ReplicaStatus
from tensora.drivers.simulated import SimulatedDriver
from tensora.placement.capacity import Node
from tests.support.clock import FakeClock


class Crash(BaseException):
    """The process dies here (not an Exception: nothing in the controller catches it)."""


class CrashingDriver:
    """The simulated fleet, but the controller 'dies' on the first start() it asks for."""

    def __init__(self, inner: SimulatedDriver) -> None:
        self.inner, self.armed = inner, True

    def nodes(self) -> Sequence[Node]:
        return self.inner.nodes()

    def observe(self) -> Sequence[ReplicaStatus]:
        return self.inner.observe()

    def stop(self, replica_id: str) -> ReplicaStatus:
        return self.inner.stop(replica_id)

    def start(self, spec: ReplicaSpec) -> ReplicaStatus:
        if self.armed:
            self.armed = False
            raise Crash("killed between recording the placement and starting it")
        return self.inner.start(spec)

    def release(self, workload_id: str) -> None:  # it had none: a Driver gives back a deleted workload's storage
        self.inner.release(workload_id)

    def prune(self, ended_before: float) -> int:
        return self.inner.prune(ended_before)


class FlakyRelease(SimulatedDriver):
    """The simulated fleet, but the first release fails (the storage API was down)."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.calls: list[str] = []

    def release(self, workload_id: str) -> None:
        self.calls.append(workload_id)
        if len(self.calls) == 1:
            raise RuntimeError("the storage API is down")
        super().release(workload_id)


class Sleeps:
    """The SDK's fake sleep: records each wait; optionally moves a fake clock by it."""

    def __init__(self, clock: FakeClock | None = None) -> None:
        self.waits: list[float] = []
        self.clock = clock

    def __call__(self, seconds: float) -> None:
        self.waits.append(seconds)
        if self.clock is not None:
            self.clock.advance(seconds)

    async def async_(self, seconds: float) -> None:
        self(seconds)


class Silent:
    """A TCP server that accepts connections, reads what comes and never answers: a hung Redis."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port: int = self.sock.getsockname()[1]
        self.conns: list[socket.socket] = []
        self._received = 0
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def received(self) -> int:
        """The bytes it has read, over all its connections: whether, and when, it was asked anything."""
        with self._lock:
            return self._received

    def _accept(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                conn, _ = self.sock.accept()
                self.conns.append(conn)
                threading.Thread(target=self._drain, args=(conn,), daemon=True).start()

    def _drain(self, conn: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := conn.recv(65536):
                with self._lock:
                    self._received += len(data)

    def close(self) -> None:
        self.sock.close()
        for c in self.conns:
            c.close()


if TYPE_CHECKING:
    _driver: type[Driver] = CrashingDriver
    _flaky: type[Driver] = FlakyRelease
    _clock: Clock = FakeClock()  # a loop's clock
    _clock_callable: Callable[[], float] = FakeClock()  # the gateway's clock and wall, the walk's clock
    _sleep: Callable[[float], None] = Sleeps()  # Client(sleep=...)
    _async_sleep: Callable[[float], Awaitable[None]] = Sleeps().async_  # AsyncClient(sleep=...)
