"""Which workloads a kept admission state decides in a cycle, and the proof that the others keep their decision.

A cycle of :class:`~tensora.placement.admission_state.AdmissionState` runs ``decide``'s passes over part of a
region: what must be decided (new, timer due, quota use changed), the head of each list in priority order, and
the movers that could move back. The rest is told to the passes as counts (each class's requesters waiting for
room). After the passes, :meth:`CycleProof.widen` checks that every workload left out keeps its decision; where
it cannot show it, the heads are doubled (or workloads added) and the cycle is tried again from a checkpoint of
the capacity.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from tensora.placement.catalog import CPU_WORD, ComputeClass, entry_classes
from tensora.placement.decisions import WAITED_FOR_ROOM, Decision, Place, Promote, Queued, Running, Wait
from tensora.placement.priority_lists import ListKind, Prio
from tensora.placement.standing import blocked_on, waited_for_room

if TYPE_CHECKING:
    from tensora.placement.admission_state import AdmissionState

ListKey = tuple[ListKind, str, str]
"""A list: its kind, its region, its class or fallback entry."""


class CycleProof:
    """One cycle's choice of what to decide, kept across its tries: how much of each list's head is decided
    (``head``), the workloads added (``extra``), and what the capacity said when the cycle began (``closed``,
    ``no_room``: a try again starts from the same capacity). Each try's own figures (``start_try``): the regions,
    the room left for fallbacks after the first pass, the requesters counted waiting, the movers tried."""

    def __init__(self, state: AdmissionState, now: float, first_head: int) -> None:
        """``first_head``: how many of each list's head to decide first (doubled for a list that needs more)."""
        self.state, self.now, self.first_head = state, now, first_head
        self.head: dict[ListKey, int] = {}
        self.extra: dict[str, set[str]] = {}
        self.closed: dict[ListKey, bool] = {}
        self.no_room: dict[tuple[str, str], bool] = {}
        self.regions: set[str] = set()
        self.room_left: dict[tuple[str, str], bool] = {}
        self.counted: dict[tuple[str, str], int] = {}
        self.tried: set[str] = set()

    def start_try(self, regions: set[str]) -> None:
        self.regions = regions
        self.room_left = {}
        self.counted = {}
        self.tried = set()

    # -- what to decide ------------------------------------------------------------------

    def select(self) -> tuple[dict[str, Queued], Counter[tuple[str, str]]]:
        """The workloads to decide: a whole region's every one; elsewhere those that must be (new, timer due,
        quota use changed), and the head of each list (:meth:`head_length`). The counter: the others waiting for
        room, per class."""
        st, now = self.state, self.now
        chosen: dict[str, Queued] = {}
        also: Counter[tuple[str, str]] = Counter()
        for region in self.regions:
            queued = st.by_region.get(region, {})
            if region in st.whole:
                chosen.update((id, w) for id, w in queued.items() if w.not_before <= now)
                continue
            if region in st.lists.unsorted:
                st.lists.rebuild(region, now)
            picked: dict[str, Queued] = {}
            for id in st.must.get(region, set()) | self.extra.get(region, set()):
                w = queued.get(id)
                if w is not None and w.not_before <= now:
                    picked[id] = w
            unheaded: list[tuple[str, list[Prio]]] = []  # requesters' lists with no room, their first left out
            for kind in ListKind:
                for name, lst in st.lists.of_kind(kind).get(region, {}).items():
                    n = self.head_length(kind, region, name, lst)
                    if n == 0 and kind is ListKind.REQUESTERS:
                        unheaded.append((name, lst))
                    for p in lst[:n]:
                        picked[p[2]] = queued[p[2]]
            # another requester of such a class decided finds it full first, and might hold a node, where decide
            # has the first: the first is decided too
            for name, lst in unheaded:
                if lst[0][2] not in picked and any(w.gpu_class == name for w in picked.values()):
                    picked[lst[0][2]] = queued[lst[0][2]]
            standing = st.standing_decisions.by_region.get(region, {})
            for (r, cls), n in st.standing_decisions.waited.items():
                if r == region and n:
                    also[(r, cls)] += n
            for id, w in picked.items():
                d = standing.get(id)
                if type(d) is Wait and d.attempts[0].outcome in WAITED_FOR_ROOM:
                    also[(region, w.gpu_class)] -= 1
            chosen.update(picked)
        return chosen, also

    def head_length(self, kind: ListKind, region: str, name: str, lst: Sequence[Prio]) -> int:
        """How much of a list to decide: ``first_head``, or where it is closed (:meth:`list_closed`) only a
        requesters' list's first if it may hold a node (:meth:`may_hold`) and no lister (each finds its class
        full or held again)."""
        key = (kind, region, name)
        n = self.head.get(key)
        if n is None:
            if not lst or not self.list_closed(kind, region, name):
                n = self.first_head
            elif kind is ListKind.LISTERS:
                n = 0
            else:
                n = 1 if self.may_hold(self.state.queue[lst[0][2]]) else 0
            self.head[key] = n
        return n

    def list_closed(self, kind: ListKind, region: str, entry: str) -> bool:
        """Whether no workload of a list can be placed by what ``entry`` stands for this cycle, decided or not:
        every class it names had no room in ``region`` when the cycle began (room only shrinks within a
        cycle), or, for fallback listers, was held for its requesters in the region's last cycle (the checks
        see to it that it still is: a class that stops being held has its listers all decided)."""
        key = (kind, region, entry)
        found = self.closed.get(key)
        if found is None:
            st = self.state
            held = st.held_last if kind is ListKind.LISTERS else {}
            found = self.closed[key] = all(held.get((region, cls.name), False) or self.had_no_room(region, cls)
                                           for cls in entry_classes(entry, st.catalog))
        return found

    def had_no_room(self, region: str, cls: ComputeClass) -> bool:
        """Whether ``cls`` had no room in ``region`` when the cycle began (a CPU class is asked of for its
        requesters and for the word ``cpu``, a class for its requesters and its listers)."""
        key = (region, cls.name)
        found = self.no_room.get(key)
        if found is None:
            found = self.no_room[key] = self.state.cap.no_room(region, cls)
        return found

    def may_hold(self, first: Queued) -> bool:
        """Whether the first requester of a class with no room may hold a node for it: it starves (``decide``
        lets the first requester that finds its class full hold a node if it starves), or an owner's quota may
        keep it from trying, so that the next one finds the class full first. Else every requester of the
        class finds it full and none holds a node (while none of them is decided: see :meth:`select`)."""
        st = self.state
        return self.now - first.queued_since >= st.policy.starvation_after_s \
            or st.default_quota is not None or bool(st.quota_by_owner)

    # -- called by the passes ---------------------------------------------------------------

    def room_for_fallbacks(self) -> None:
        """After the first pass: which fallback classes have room left (it only shrinks from there), for the
        lists with listers left out (the checks ask only of those)."""
        st = self.state
        for region in self.regions - st.whole:
            for entry, lst in st.lists.listers.get(region, {}).items():
                if self.head.get((ListKind.LISTERS, region, entry), self.first_head) >= len(lst):
                    continue
                for cls in entry_classes(entry, st.catalog):
                    if (region, cls.name) not in self.room_left:
                        self.room_left[(region, cls.name)] = st.cap.find(region, cls) is not None

    def movers_to_try(self) -> list[Running]:
        """The movers whose move back could change: a whole region's every one; elsewhere those with an offer
        standing, and those one of whose preferred classes has room left now and is not held (room only shrinks
        from here on; the others find nothing, whatever their owner's quota)."""
        st = self.state
        out: list[Running] = []
        for region in self.regions:
            movers = st.movers.get(region, {})
            ids = set(movers) if region in st.whole else {id for id in st.standing_decisions.offered.get(region, ())
                                                            if id in movers}
            if region not in st.whole:
                for (r, entry), who in st.prefers.items():
                    if r == region and who and self.has_room(region, entry):
                        ids |= who
            self.tried |= ids
            out += [movers[id] for id in ids]
        return out

    def has_room(self, region: str, entry: str) -> bool:
        """Whether a class ``entry`` stands for has room now and is not held for its requesters."""
        st = self.state
        return any(not self.counted.get((region, cls.name), 0) and st.cap.find(region, cls) is not None
                   for cls in entry_classes(entry, st.catalog))

    # -- the proof ------------------------------------------------------------------------

    def widen(self, chosen: Mapping[str, Queued], out: Sequence[Decision]) -> set[str] | None:
        """None when every workload left out keeps its decision; else the regions to try again, with longer
        heads (``head``) or more workloads (``extra``). A workload left out keeps its decision when:

        1. a class's requesters: one decided failed for want of room (each after it fails too, since capacity
           only shrinks within a cycle, and the queue head that holds a node is among those decided);
        2. a fallback entry's listers: its class had no room left after the first pass, or is held, or one decided found
           it full (or held, or on no node), or none left out found it so before (they never try it);
        3. no class went from held from fallbacks to not held, or back, unless all its listers are decided;
        4. no owner with a quota placed or promoted here has a workload left out (its use grew), and every
           region of that owner is decided in the same cycle (its use spans them).
        """
        st, regions, counted = self.state, self.regions, self.counted
        waited, blocked = st.standing_decisions.waited, st.standing_decisions.blocked
        partial = regions - st.whole  # (a region decided whole has nothing left out: no check asks of it)
        by_id = {d.workload.id: d for d in out if type(d) is Place or type(d) is Wait} if partial else {}
        again = False
        for region in partial:
            standing = st.standing_decisions.by_region.get(region, {})
            for name, lst in st.lists.reqs.get(region, {}).items():
                key = (ListKind.REQUESTERS, region, name)
                n = self.head.get(key, self.first_head)
                if n == 0 or n >= len(lst) or not waited[(region, name)] \
                        or any(waited_for_room(by_id.get(p[2])) for p in lst[:n]):
                    continue  # (n == 0: the class had no room when the cycle began, so each waits for it)
                # none decided waited for room: fine if none left out does either (they wait on a quota)
                if waited[(region, name)] - sum(waited_for_room(standing.get(p[2])) for p in lst[:n]) > 0:
                    self.head[key], again = 2 * n, True
            for entry, lst in st.lists.listers.get(region, {}).items():
                key = (ListKind.LISTERS, region, entry)
                n = self.head.get(key, self.first_head)
                if n >= len(lst):
                    continue
                if entry == CPU_WORD:
                    classes = [c.name for c in entry_classes(entry, st.catalog) if not st.cap.unhostable(region, c)]
                else:
                    classes = [entry]
                for c in classes:
                    if not self.room_left.get((region, c), True) or counted.get((region, c), 0) > 0 \
                            or not blocked[(region, entry, c)] \
                            or any(blocked_on(by_id.get(p[2]), c, entry) for p in lst[:n]):
                        continue
                    # none decided found it full: fine if none left out did either (they never try it here)
                    if blocked[(region, entry, c)] - sum(blocked_on(standing.get(p[2]), c, entry)
                                                         for p in lst[:n]) > 0:
                        self.head[key], again = max(1, 2 * n), True
                        break
            for cls in {c for r, c in counted if r == region} | {c for r, c in st.held_last if r == region}:
                if (counted.get((region, cls), 0) > 0) == st.held_last.get((region, cls), False):
                    continue
                entries = [cls, CPU_WORD] if cls in st.catalog and st.catalog[cls].is_cpu else [cls]
                for entry in entries:
                    lst = st.lists.listers.get(region, {}).get(entry, [])
                    key = (ListKind.LISTERS, region, entry)
                    if self.head.get(key, self.first_head) < len(lst):
                        self.head[key], again = len(lst), True
        wider = set(regions)
        for d in out:
            if not (type(d) is Place or type(d) is Promote) or st.quota_of(d.workload.owner) is None:
                continue
            owner = d.workload.owner
            wider |= set(st.owner_regions.get(owner, ()))
            for _, id in st.owner_keys.get(owner, ()):
                w = st.queue[id]
                if id not in chosen and w.region in regions and w.region not in st.whole and w.not_before <= self.now:
                    self.extra.setdefault(w.region, set()).add(id)
                    again = True
        return wider if again or wider != regions else None
