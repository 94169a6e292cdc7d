"""The priority order of a kept admission state, kept per list: in each region, the requesters of each class,
and the listers of each fallback entry whose timer ran out (kube-scheduler's queues). A cycle decides the heads
of those lists, not the whole queue."""

from __future__ import annotations

import bisect
from collections import Counter
from collections.abc import Collection
from enum import IntEnum
from operator import attrgetter

from tensora.placement.attempts import model_over_cpu_limit
from tensora.placement.catalog import CPU_WORD, Catalog
from tensora.placement.decisions import Queued
from tensora.placement.kinds import WorkloadKind
from tensora.placement.policy import Policy

Prio = tuple[int, float, str]
"""A queued workload's place in the priority order: (its owner's turn, queued_since, id)."""


class ListKind(IntEnum):
    """Which of a region's lists: the requesters of a class, or the listers of a fallback entry."""

    REQUESTERS = 0
    LISTERS = 1


class PriorityLists:
    """Each region's lists in priority order; reads its owners' turns from the state's records (the dicts and
    sets passed in, kept up to date by their owner)."""

    def __init__(self, catalog: Catalog, policy: Policy, owner_running: Counter[str],
                 owner_keys: dict[str, list[tuple[float, str]]], backing: set[str],
                 by_region: dict[str, dict[str, Queued]]) -> None:
        self.catalog, self.policy = catalog, policy
        self.owner_running, self.owner_keys = owner_running, owner_keys
        self.backing, self.by_region = backing, by_region
        self.prio: dict[str, Prio] = {}
        self.reqs: dict[str, dict[str, list[Prio]]] = {}  # region -> class asked -> its requesters
        self.listers: dict[str, dict[str, list[Prio]]] = {}  # region -> fallback entry -> eligible listers
        self.eligible: set[str] = set()  # queued ids listed as eligible for their fallback lists
        self.unsorted: set[str] = set()  # regions whose lists are rebuilt before they are used again

    def of_kind(self, kind: ListKind) -> dict[str, dict[str, list[Prio]]]:
        return self.reqs if kind is ListKind.REQUESTERS else self.listers

    def prio_of(self, w: Queued) -> Prio:
        if not self.policy.owner_fairness:
            return (0, w.queued_since, w.id)
        turn = self.owner_running.get(w.owner, 0) + bisect.bisect_left(self.owner_keys[w.owner], (w.queued_since, w.id))
        return (turn, w.queued_since, w.id)

    def ordered(self, ws: Collection[Queued]) -> list[Queued]:
        """``ws`` sorted by :meth:`prio_of`; where ``ws`` holds every one of its owners' workloads that take a turn
        (a region decided whole: a first cycle), without a bisect each: in (queued_since, id) order an owner's
        n-th is its n-th key, so its turn is its running count + n, and a stable bucketing by turn ends it."""
        fair = self.policy.owner_fairness
        if fair:
            count = Counter(w.owner for w in ws)
            if any(len(self.owner_keys.get(o, ())) != n for o, n in count.items()) \
                    or not self.backing.isdisjoint([w.id for w in ws]):
                return sorted(ws, key=self.prio_of)
        out = sorted(ws, key=attrgetter("id"))
        out.sort(key=attrgetter("queued_since"))
        if not fair:
            return out
        nth = {o: self.owner_running.get(o, 0) for o in count}
        by_turn: dict[int, list[Queued]] = {}
        for w in out:
            turn = nth[w.owner]
            nth[w.owner] = turn + 1
            same = by_turn.get(turn)
            if same is None:
                by_turn[turn] = [w]
            else:
                same.append(w)
        return [w for turn in sorted(by_turn) for w in by_turn[turn]]

    def lists_of(self, w: Queued) -> list[list[Prio]]:
        out = []
        if w.gpu_class in self.catalog:  # an unknown class waits whatever happens: in no list
            out.append(self.reqs.setdefault(w.region, {}).setdefault(w.gpu_class, []))
        if w.id in self.eligible:
            lists = self.listers.setdefault(w.region, {})
            for entry in dict.fromkeys(w.fallback):
                if entry != CPU_WORD or not self.never_on_cpu(w):
                    out.append(lists.setdefault(entry, []))
        return out

    def never_on_cpu(self, w: Queued) -> bool:
        """An endpoint whose model is over the CPU limit: the word ``cpu`` never places it, whatever is free
        (``decide`` says so before it looks at a class), so it is no lister of that word. Left at the head of
        its list, it would be decided again each cycle, as would the three after it."""
        return w.kind == WorkloadKind.ENDPOINT and model_over_cpu_limit(w.model_params, self.policy)

    def add(self, w: Queued, now: float, *, sort: bool = True) -> None:
        """Put ``w`` in its lists (in order; ``sort`` False: at the end, for a rebuild that sorts after)."""
        if w.not_before > now:
            return  # backing off: a candidate again when its timer ends
        if w.fallback and now >= w.queued_since + w.fallback_after_s:
            self.eligible.add(w.id)
        p = self.prio[w.id] = self.prio_of(w)
        for lst in self.lists_of(w):
            if sort:
                bisect.insort(lst, p)
            else:
                lst.append(p)

    def remove(self, w: Queued) -> None:
        p = self.prio.pop(w.id, None)
        if p is not None and w.region not in self.unsorted:
            for lst in self.lists_of(w):
                i = bisect.bisect_left(lst, p)
                if i < len(lst) and lst[i] == p:
                    del lst[i]
        self.eligible.discard(w.id)

    def rebuild(self, region: str, now: float) -> None:
        """Rebuild ``region``'s lists from its queue (first use, or after a cycle that changed many turns)."""
        self.reqs.pop(region, None)
        self.listers.pop(region, None)
        for w in self.by_region.get(region, {}).values():
            self.eligible.discard(w.id)
            self.add(w, now, sort=False)
        for lists in (self.reqs, self.listers):
            for lst in lists.get(region, {}).values():
                lst.sort()
        self.unsorted.discard(region)
