"""The crash-loop back-off (Kubernetes' CrashLoopBackOff): a workload whose replicas keep failing waits
10 s, 20 s, 40 s ... up to 5 min before admission places it again, and starts over once a replica placed
after the last failure has run for 10 min. Pure: counts and times in, times out; the store keeps the count,
the last failure and the next try (``workloads.failures``, ``last_failure``, ``retry_at``).
"""

from __future__ import annotations

FIRST_S = 10.0
"""The wait after the first failure; each failure in a row doubles it."""
MAX_S = 300.0
"""The longest wait: a broken workload is tried every 5 min, which costs a cycle and an event at most."""
RESET_AFTER_S = 600.0
"""A replica placed after the last failure that runs this long ends the crash loop (the count is reset)."""


def delay(failures: int) -> float:
    """The wait after the ``failures``-th failure in a row (``failures`` >= 1)."""
    return min(MAX_S, FIRST_S * 2.0 ** min(max(failures - 1, 0), 32))


def next_try(failures: int, now: float) -> float:
    return now + delay(failures)


def healed(retry_at: float | None, created_at: float, running_since: float, now: float) -> bool:
    """A replica created at or after the back-off's end (so after the last failure) that has run
    ``RESET_AFTER_S``: a replica that was healthy before the failures does not end another slot's loop."""
    return retry_at is not None and created_at >= retry_at and now - running_since >= RESET_AFTER_S
