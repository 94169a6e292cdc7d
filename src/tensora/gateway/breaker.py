"""A circuit breaker per backend, after Envoy's outlier detection: pure state, time as an argument.

closed --(``consecutive`` failures in a row)--> open for ``base_s * n`` (n = how many times it
has been ejected, capped at ``max_s``) --> half-open: one live request goes through as a probe -->
closed on success (the ejection count decays by one), or open again, longer, on failure.

Besides, while it is open or half-open the gateway probes the backend actively (``probed``): after
``probe_successes`` good probes in a row it closes, however long the ejection had left. A failed
active probe only resets that count: it never lengthens the ejection, so a backend that recovers is
back within a few probe intervals, not after its (growing, but capped) cooldown.

Apart from that, a backend may be rate limited (``rate_limited``: its 429 said until when): it is
skipped until then, without counting as broken.

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
    probe_successes: int = 2  # good active probes in a row that close an open breaker


@dataclass(slots=True)
class Breaker:
    policy: Policy = Policy()
    failures: int = 0
    ejections: int = 0
    open_until: float | None = None
    probing: bool = False
    probes_ok: int = 0  # good active probes in a row, while open
    busy_until: float | None = None  # rate limited by the backend itself (its 429) until then

    def state(self, now: float) -> State:
        if self.open_until is None:
            return State.CLOSED
        return State.OPEN if now < self.open_until else State.HALF_OPEN

    def allow(self, now: float) -> bool:
        """May a request go to this backend now? In half-open, only one probe at a time."""
        if self.limited_until(now) is not None:
            return False
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

    def limited_until(self, now: float) -> float | None:
        """Until when the backend asked not to be sent requests (None: it did not, or that is past)."""
        return self.busy_until if self.busy_until is not None and now < self.busy_until else None

    def skipped(self, now: float) -> bool:
        """Whether a walk passes this backend over now: open (:meth:`retry_at`) or asked not to be sent requests
        (:meth:`limited_until`). Read from the fields directly: asked of every backend on every request."""
        return (self.open_until is not None and now < self.open_until) or \
            (self.busy_until is not None and now < self.busy_until)

    def success(self, now: float) -> None:
        if self.open_until is not None:  # the probe came back well: close, and forgive one ejection
            self.ejections = max(0, self.ejections - 1)
        self.open_until, self.failures, self.probing, self.probes_ok = None, 0, False, 0

    def release(self) -> None:
        """The request came back neither well nor broken (busy: 429): a probe may go again."""
        self.probing = False

    def rate_limited(self, until: float) -> None:
        """Its 429 said: no request before ``until``. Busy, not broken: the breaker's count is untouched."""
        self.busy_until = until if self.busy_until is None else max(self.busy_until, until)
        self.probing = False

    def failure(self, now: float) -> None:
        if self.state(now) is State.HALF_OPEN or self.probing:
            self._eject(now)
            return
        self.failures += 1
        if self.failures >= self.policy.consecutive:
            self._eject(now)

    def probed(self, now: float, ok: bool) -> None:
        """An active probe's outcome. Only an open (or half-open) breaker cares."""
        if self.open_until is None:
            return
        if not ok:
            self.probes_ok = 0
            return
        self.probes_ok += 1
        if self.probes_ok >= self.policy.probe_successes:
            self.success(now)

    def _eject(self, now: float) -> None:
        self.ejections = min(self.ejections + 1, max(1, int(self.policy.max_s // self.policy.base_s) + 1))
        self.open_until = now + min(self.policy.base_s * self.ejections, self.policy.max_s)
        self.failures, self.probing, self.probes_ok = 0, False, 0
