"""A circuit breaker per backend, after Envoy's outlier detection: pure state, time as an argument.

closed --(``consecutive`` failures in a row)--> open for ``base_s * n`` (n = how many times it
has been ejected, capped at ``max_s``) --> half-open: one probe goes through --> closed on
success (the ejection count decays by one), or open again, longer, on failure.

Written here rather than taken from pybreaker: pybreaker's state is driven by calls it wraps
synchronously and never trips under asyncio, and the gateway needs the state as a value (to
skip an open backend at once, and to say when to retry in Retry-After).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class State(StrEnum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


@dataclass(frozen=True, slots=True)
class Policy:
    consecutive: int = 5
    base_s: float = 30.0
    max_s: float = 300.0


@dataclass(slots=True)
class Breaker:
    policy: Policy = Policy()
    failures: int = 0
    ejections: int = 0
    open_until: float | None = None
    probing: bool = False

    def state(self, now: float) -> State:
        if self.open_until is None:
            return State.CLOSED
        return State.OPEN if now < self.open_until else State.HALF_OPEN

    def allow(self, now: float) -> bool:
        """May a request go to this backend now? In half-open, only one probe at a time."""
        state = self.state(now)
        if state is State.CLOSED:
            return True
        if state is State.OPEN or self.probing:
            return False
        self.probing = True
        return True

    def retry_at(self, now: float) -> float | None:
        """When this backend will take a request again (None: it takes them now)."""
        if self.state(now) is State.OPEN:
            return self.open_until
        return None

    def success(self, now: float) -> None:
        if self.open_until is not None:  # the probe came back well: close, and forgive one ejection
            self.ejections = max(0, self.ejections - 1)
        self.open_until, self.failures, self.probing = None, 0, False

    def release(self) -> None:
        """The request came back neither well nor broken (busy: 429): a probe may go again."""
        self.probing = False

    def failure(self, now: float) -> None:
        if self.state(now) is State.HALF_OPEN or self.probing:
            self._eject(now)
            return
        self.failures += 1
        if self.failures >= self.policy.consecutive:
            self._eject(now)

    def _eject(self, now: float) -> None:
        self.ejections += 1
        self.open_until = now + min(self.policy.base_s * self.ejections, self.policy.max_s)
        self.failures, self.probing = 0, False
