"""The moments a kept admission state must look at a workload again: its fallback timer runs out, it starts
to starve (so may hold a node), its crash-loop back-off ends."""

from __future__ import annotations

import heapq
import math


class Timers:
    """A heap of (when, workload id), and the timers set since the last look, put on it in one go."""

    def __init__(self) -> None:
        self.heap: list[tuple[float, str]] = []
        self.later: list[tuple[float, str]] = []  # timers not on the heap yet

    def due(self, now: float) -> list[str]:
        """The ids whose timers came due, off the heap (split in one pass when many are: a first cycle, where
        most workloads' two or three timers are all due, each id then given once)."""
        if self.later:
            if len(self.later) > len(self.heap):
                self.heap += self.later
                heapq.heapify(self.heap)
            else:
                for t in self.later:
                    heapq.heappush(self.heap, t)
            self.later = []
        timers = self.heap
        if len(timers) > 64 and timers[len(timers) // 2][0] <= now:  # a rough sign that many are due
            due = list(dict.fromkeys([id for t, id in timers if t <= now]))
            self.heap = [x for x in timers if x[0] > now]
            heapq.heapify(self.heap)
            return due
        due = []
        while timers and timers[0][0] <= now:
            due.append(heapq.heappop(timers)[1])
        return due


def starving_from(since: float, after: float) -> float:
    """The first ``now`` with ``now - since >= after`` (decide's test, to the float)."""
    t = since + after
    while t - since < after:
        t = math.nextafter(t, math.inf)
    while (prev := math.nextafter(t, -math.inf)) - since >= after:
        t = prev
    return t
