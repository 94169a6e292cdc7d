"""The waits and restart offers that stand between cycles, per region, and what they count: the waits for room
for each class asked, and each fallback class that waits found full, held or on no node. The checks of a cycle
(:mod:`tensora.placement.cycle_proof`) read those counts to show that a workload left out keeps its decision."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator, Sequence

from tensora.placement.decisions import WAITED_FOR_ROOM, Decision, Outcome, RestartAvailable, Wait
from tensora.placement.kinds import WorkloadKind
from tensora.placement.recount import Recount

BLOCKED = (Outcome.NO_CAPACITY, Outcome.NO_NODE, Outcome.NONE_IN_REGION, Outcome.HELD_FOR_REQUESTERS)
"""What a fallback attempt on a class found that every later one finds too, this cycle."""


class StandingDecisions:
    """The waits and offers that stand, by region and id, with their counts."""

    def __init__(self) -> None:
        self.by_region: dict[str, dict[str, Decision]] = {}  # by region, by id: the waits and offers that stand
        self.offered: dict[str, set[str]] = {}  # by region: the ids of the restart offers that stand
        self.n_waiting = 0  # the waits that stand, every region
        self.waited: Counter[tuple[str, str]] = Counter()  # standing waits for room, by (region, class asked)
        self.blocked: Counter[tuple[str, str, str]] = Counter()  # standing waits' (region, entry, class) blocked
        self.queued: Counter[tuple[str, str, WorkloadKind]] = Counter()  # standing waits by (region, class asked, kind)

    def recounted(self, recount: Recount) -> Iterator[Decision]:
        """Every one that stands, region by region, a wait with ``recount``'s figures."""
        for region in sorted(self.by_region):
            for d in self.by_region[region].values():
                yield recount.wait(d) if type(d) is Wait else d

    def queue_depth(self, region: str) -> dict[tuple[str, str], int]:
        """The waits that stand in ``region``, by (class asked, kind): every one, however few a cycle decided
        again (the controller's queue depth)."""
        return {(cls, str(kind)): n for (r, cls, kind), n in self.queued.items() if r == region and n > 0}

    def offers(self) -> list[RestartAvailable]:
        """The restart offers that stand now, every region."""
        out = []
        for region, ids in sorted(self.offered.items()):
            standing = self.by_region.get(region, {})
            out += [d for id in sorted(ids) if type(d := standing.get(id)) is RestartAvailable]
        return out

    def withdraw(self, region: str, id: str) -> None:
        """``id``'s wait or offer no longer stands (it is decided again, placed, or gone)."""
        standing = self.by_region.get(region)
        d = standing.pop(id, None) if standing is not None else None
        if type(d) is Wait:
            self.count(region, d, -1)
            self.n_waiting -= 1

    def count(self, region: str, d: Wait, sign: int) -> None:
        """Count a wait in (1) or out (-1): waiting for room for its class (``waited``), and each fallback
        class it found full, held or on no node (``blocked``)."""
        attempts = d.attempts
        self.queued[(region, d.workload.gpu_class, d.workload.kind)] += sign
        if attempts[0].outcome in WAITED_FOR_ROOM:
            self.waited[(region, d.workload.gpu_class)] += sign
        for a in attempts[1:]:
            if a.outcome in BLOCKED and a.entry is not None:
                self.blocked[(region, a.entry, a.cls)] += sign

    def keep_all(self, ds: Sequence[Decision]) -> None:
        """Each of ``ds`` (waits and restart offers) stands, in place of what stood for its workload, in one pass
        (a first cycle keeps nearly every queued workload's wait)."""
        standing: dict[str, Decision] = {}
        region = None
        waited, blocked, queued = self.waited, self.blocked, self.queued
        n = 0
        for d in ds:
            w = d.workload
            if w.region != region:
                region = w.region
                standing = self.by_region.setdefault(region, {})
            id = w.id
            was = standing.pop(id, None)
            if type(was) is Wait:
                self.count(region, was, -1)
                n -= 1
            standing[id] = d
            if type(d) is Wait:
                n += 1
                queued[(region, w.gpu_class, w.kind)] += 1
                attempts = d.attempts
                if attempts[0].outcome in WAITED_FOR_ROOM:
                    waited[(region, w.gpu_class)] += 1
                for a in attempts[1:]:
                    if a.outcome in BLOCKED and a.entry is not None:
                        blocked[(region, a.entry, a.cls)] += 1
            else:
                self.offered.setdefault(region, set()).add(id)
        self.n_waiting += n


def waited_for_room(d: Decision | None) -> bool:
    """A requester whose class had no room for it (placed on a fallback after, or not)."""
    return d is not None and d.attempts[0].outcome in WAITED_FOR_ROOM


def blocked_on(d: Decision | None, cls: str, entry: str) -> bool:
    """A lister that found ``cls`` (from ``entry``) full, held or on no node."""
    return d is not None and any(a.cls == cls and a.entry == entry and a.outcome in BLOCKED for a in d.attempts)
