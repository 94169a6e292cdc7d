"""Ids of the rows the store makes: sortable by creation, unique across processes."""

from __future__ import annotations

import secrets
import string
import threading
import time
from collections.abc import Callable

_B62 = string.digits + string.ascii_letters


_B36 = string.digits + string.ascii_lowercase  # sorts the same in every collation (digits, then a-z)


class Ids:
    """Ids that sort in the order they were made, so lists and ``after=`` pages are in creation order:
    ``prefix`` + the creation millisecond (9 base-36 digits, fixed width, good to the year 5000) + ``n``
    random base-62 characters. Strictly increasing within a process (a millisecond already used, or
    a clock stepped back, is bumped past the last), ordered to the millisecond across processes. Wall
    time rather than the service clock, which tests hold still."""

    def __init__(self, now: Callable[[], float] = time.time) -> None:
        self._now, self._lock, self._last_ms = now, threading.Lock(), 0

    def new(self, prefix: str, n: int = 10) -> str:
        with self._lock:
            ms = self._last_ms = max(int(self._now() * 1000), self._last_ms + 1)
        stamp = ""
        for _ in range(9):
            ms, d = divmod(ms, 36)
            stamp = _B36[d] + stamp
        return prefix + stamp + "".join(secrets.choice(_B62) for _ in range(n))


new_id = Ids().new
