"""Time as an argument: pure code takes ``now`` (seconds since the epoch, UTC);
loops take a :class:`Clock`; tests use :class:`FakeClock` and never sleep.

At the top of the package: the controller, the API, the sandboxes and the simulated driver share it."""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    """Where loops read the time from."""

    def now(self) -> float:
        """Seconds since the epoch (UTC)."""
        ...


class SystemClock:
    """The wall clock."""

    def now(self) -> float:
        return time.time()


class FakeClock:
    """A clock that moves only when told to."""

    def __init__(self, start: float = 0.0) -> None:
        self._now = start

    def now(self) -> float:
        return self._now

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError("a clock does not go backwards")
        self._now += seconds

    def set(self, now: float) -> None:
        self._now = now
