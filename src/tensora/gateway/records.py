"""Usage records on their way from the request path to the meter's spool (``metering.Meter``): each one made
its JSON line here and queued for the meter's next write.

Compiled with the request path: a record through the meter's own method (interpreted Python: its tests replace a
Meter's methods) would cost every request more than its JSON does.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import orjson


class Records:
    """The records not yet written, as their JSON lines. ``wake`` is called by the first record after a write (or
    after the start), so that the meter writes them soon; until the meter's next write, the records only queue."""

    def __init__(self, wake: Callable[[], None]) -> None:
        self.lines: list[bytes] = []
        self.waking = False  # ``wake`` was called and the meter has not written since
        self.wake = wake

    def add(self, rec: dict[str, Any]) -> None:
        self.lines.append(orjson.dumps(rec))
        if not self.waking:
            self.waking = True  # before the call: a write it runs at once (no loop) ends the wait
            self.wake()
