"""When the SDK retries, and how long it waits: pure decisions, plus one budget per client.

The policy (ADR-0010 part C): retry on connection errors, timeouts, 408, 429 and 5xx, and on a
409 only when the server marks it retryable (an Idempotency-Key still in flight carries
``x-should-retry: true``). ``x-should-retry: true|false`` decides before anything else. Waits
are exponential backoff with full jitter, ``uniform(0, min(cap, base * 2**n))`` for the n-th
retry, unless the server names the wait: ``retry-after-ms``, then ``Retry-After`` (seconds or an
HTTP date). A server wait above ``max_retry_after_s`` (120 s) is not retried at all: the
caller hears the error at once rather than hanging for minutes.

POSTs are safe to retry because each logical POST carries one Idempotency-Key on every attempt.

Written here rather than with tenacity or httpx's transport retries: neither honours
``retry-after-ms``/``x-should-retry`` nor shares a retry budget between calls, and the
decision stays a pure function that the tests drive with a fake clock and a seeded RNG.
"""

from __future__ import annotations

import datetime as dt
import email.utils
import random
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

RETRY_STATUSES = frozenset({408, 429})


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """``max_retries`` retries after the first attempt; waits capped at ``cap_s``."""

    max_retries: int = 2
    base_s: float = 0.5
    cap_s: float = 8.0
    max_retry_after_s: float = 120.0

    def __post_init__(self) -> None:
        if self.max_retries < 0 or self.base_s < 0 or self.cap_s < 0 or self.max_retry_after_s < 0:
            raise ValueError("retry settings must not be negative")

    def backoff(self, n: int, rng: random.Random) -> float:
        """Full jitter for the n-th retry (0-based)."""
        return rng.uniform(0, min(self.cap_s, self.base_s * 2 ** min(n, 62)))


@dataclass(frozen=True, slots=True)
class Retry:
    delay_s: float
    why: str


@dataclass(frozen=True, slots=True)
class Stop:
    why: str


def retryable(status: int | None, headers: Mapping[str, str]) -> bool:
    """Whether an answer (``status`` None: no answer at all) is worth another attempt."""
    flag = headers.get("x-should-retry", "").lower()
    if flag in ("true", "false"):
        return flag == "true"
    if status is None:
        return True
    return status in RETRY_STATUSES or status >= 500


def server_wait(headers: Mapping[str, str], now: float) -> float | None:
    """Seconds the server asked to wait: ``retry-after-ms``, then ``Retry-After``; None if neither parses."""
    ms = headers.get("retry-after-ms")
    if ms is not None:
        try:
            value = float(ms)
            if value >= 0 and value == value and value != float("inf"):
                return value / 1000
        except ValueError:
            pass
    ra = headers.get("retry-after")
    if ra is None:
        return None
    ra = ra.strip()
    try:
        seconds = float(ra)
        return seconds if 0 <= seconds < float("inf") else None
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(ra)
    except (TypeError, ValueError, IndexError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=dt.UTC)
    return max(0.0, when.timestamp() - now)


def decide(policy: RetryPolicy, retries_done: int, status: int | None, headers: Mapping[str, str], now: float,
           rng: random.Random) -> Retry | Stop:
    """After a failed attempt: retry after a wait, or stop and raise. (The budget is asked after this.)"""
    if not retryable(status, headers):
        return Stop("not retryable")
    if retries_done >= policy.max_retries:
        return Stop(f"gave up after {retries_done} retries")
    wait = server_wait(headers, now)
    if wait is not None:
        if wait > policy.max_retry_after_s:
            return Stop(f"the server asks to wait {wait:.0f}s, more than {policy.max_retry_after_s:g}s")
        return Retry(wait, "the server's Retry-After")
    return Retry(policy.backoff(retries_done, rng), "backoff with full jitter")


class RetryBudget:
    """A token bucket shared by all the calls of one client, so an outage is not met with a storm.

    It holds up to ``capacity`` tokens and starts full. Each retry spends one (no token: no
    retry, the error is raised at once); each success puts back ``refund``; and it refills by
    ``per_s`` tokens a second. First attempts never wait for it.
    """

    def __init__(self, capacity: float = 10.0, refund: float = 0.1, per_s: float = 0.1,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if capacity < 0 or refund < 0 or per_s < 0:
            raise ValueError("budget settings must not be negative")
        self.capacity, self.refund, self.per_s, self._clock = capacity, refund, per_s, clock
        self._tokens = capacity
        self._at = clock()
        self._lock = threading.Lock()

    def _fill(self) -> None:
        now = self._clock()
        self._tokens = min(self.capacity, self._tokens + (now - self._at) * self.per_s)
        self._at = now

    @property
    def tokens(self) -> float:
        with self._lock:
            self._fill()
            return self._tokens

    def spend(self) -> bool:
        """Take a token for a retry; False when there is none."""
        with self._lock:
            self._fill()
            if self._tokens < 1:
                return False
            self._tokens -= 1
            return True

    def success(self) -> None:
        with self._lock:
            self._fill()
            self._tokens = min(self.capacity, self._tokens + self.refund)
