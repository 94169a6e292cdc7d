"""Admission kept across cycles: ``step(state, events, now) -> (state, decisions)``.

:func:`tensora.placement.admission.decide` starts from nothing every cycle: it sorts the whole queue and
re-decides it against a copy of the whole fleet, even when nothing changed. The state here keeps what
decide would rebuild (the queue, the running records, their replicas, the free capacity, each owner's
quota use and turn) and is told what changed as events, so a cycle costs what changed:

* **Capacity by deltas**: a replica placed or ended, a node added, removed or cordoned changes the figures
  of one node and its region's totals (:meth:`Capacity.change` and friends), exactly as a rebuild would
  count them; the first-fit cursors and the heaps that find where a queue head holds are kept too, moved
  back only where capacity grew.
* **Lists in priority order** (kube-scheduler's queues, with their queueing hints as the anchor): per
  region, the requesters of each class, and the listers of each fallback entry whose timer ran out.
  A region with nothing new is not looked at: a cycle with no event reads one heap top.
* **Decide the heads, prove the rest stands**: a region that changed runs ``decide``'s own passes
  (:func:`tensora.placement.admission.run_cycle`) over the workloads that must be decided (new, timer due, their
  owner's quota or use changed), the head of each list (of a list whose class had no room when the cycle began,
  or was held from fallbacks, no lister, and the first requester only where it may hold a node: it starves, or
  another requester of its class is decided), and the movers one of whose preferred classes has room; the others
  are told to it as counts (each class's requesters waiting for room, which hold it from fallbacks). An endpoint
  whose model is over the CPU limit is no lister of the word ``cpu`` (that word never places it). Then checks
  show that every workload left out keeps its decision (:mod:`tensora.placement.cycle_proof`: a decided
  requester found its class full, so every later one does too, capacity only shrinking within a cycle; a
  decided lister found its fallback class full, or it has no room left; no class changed from held to not held;
  no owner with a quota placed with a workload left out), or the heads are doubled (or the workloads added)
  and the cycle is tried again from a checkpoint of the capacity. So one freed GPU in a region
  of 100,000 waiting decides a few dozen workloads, not the region.
* **The same decisions**: the decisions made are ``decide``'s, and so is every wait that stands
  (``decisions()``): tests/unit/test_admission_step.py checks, on random histories, that the state's
  decisions equal ``decide`` run from scratch on the same world, cycle by cycle, with heads of one too
  (where nearly every cycle needs the checks). Every rule keeps its properties (anti-starvation holds,
  fallback order, move-back after primary requesters, RestartAvailable, quotas). A wait's figures (free GPUs
  or vCPUs of a class it found full, requesters waiting for a class held from it, its owner's quota use)
  are those at the end of the cycle in ``decide`` too, so a wait that stands is recounted when read.

Decisions are assumed as they are made (kube-scheduler's *assume*): a ``Place`` moves its workload
to the running records with its replica; a ``Promote`` marks the endpoint ``moving`` with its new
replica. The caller reports what happens next as events (a replica that ends, a move finished as
``Started``, a placement that failed as ``Stopped`` then ``Submitted``). ``step`` mutates and returns
``state`` (it is pure otherwise: no I/O, no clock); use the state it returns, not the one passed in.
"""

from __future__ import annotations

import bisect
from collections import Counter
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import replace

from tensora.placement.admission import Decision, Ledger, collector_paused, run_cycle
from tensora.placement.admission_events import (
    Event,
    NodeAdded,
    NodeRemoved,
    OwnerHeld,
    QuotaChanged,
    ReplicaEnded,
    ReplicaPlaced,
    Started,
    Stopped,
    Submitted,
    running_from,
)
from tensora.placement.attempts import preferred_over
from tensora.placement.capacity import Placed
from tensora.placement.cycle_proof import CycleProof
from tensora.placement.decisions import Place, Promote, Queued, RestartAvailable, Running
from tensora.placement.kept_records import KeptRecords, Key
from tensora.placement.owner_quotas import OwnerQuotas, share
from tensora.placement.priority_lists import Prio
from tensora.placement.recount import Recount

__all__ = [  # the events a caller tells the state, named here beside it
    "AdmissionState", "Event", "NodeAdded", "NodeRemoved", "OwnerHeld", "Prio", "QuotaChanged", "ReplicaEnded",
    "ReplicaPlaced", "Started", "Stopped", "Submitted", "running_from", "step",
]

_FIRST_PREFIX = 4
"""How many of each list's head a cycle decides first; doubled for a list that needs more (a module variable: a
test decides heads of one)."""
_MAX_TRIES = 64
"""Tries of one cycle before its regions are decided whole (a bound, not a tuning)."""


class AdmissionState(KeptRecords):
    """Everything ``decide`` would rebuild each cycle, kept (:class:`~tensora.placement.kept_records.KeptRecords`),
    and the cycle over what changed; see the module docstring."""

    # -- reading ------------------------------------------------------------------------

    def decisions(self) -> Iterator[Decision]:
        """The waits and restart offers that stand now, every region, with the figures of now (what is free,
        who waits, each owner's use: :class:`tensora.placement.admission.Recount`)."""
        recount = Recount(self.cap, Ledger(self.quotas(), (), self.catalog), self.standing_decisions.waited)
        yield from self.standing_decisions.recounted(recount)

    def waiting(self) -> int:
        """How many waits stand now (every queued workload not backing off, once decided)."""
        return self.standing_decisions.n_waiting

    def queue_depth(self, region: str) -> dict[tuple[str, str], int]:
        """The waits that stand now in ``region``, by (class asked, kind)."""
        return self.standing_decisions.queue_depth(region)

    def quotas(self) -> OwnerQuotas | None:
        """The quotas as ``decide`` takes them, with each owner's use kept here as ``held`` (None: no owner has
        a quota, and none is counted)."""
        if self.default_quota is None and not self.quota_by_owner:
            return None
        return OwnerQuotas(self.default_quota, self.quota_by_owner,
                           {o: (u[0], u[1]) for o, u in self.use.items()})

    def offers(self) -> list[RestartAvailable]:
        """The restart offers that stand now, every region."""
        return self.standing_decisions.offers()

    def holds(self, ids: Iterable[str], queue: Sequence[Queued], running: Sequence[Running],
              placed: Sequence[Placed]) -> bool:
        """Whether this state holds for ``ids`` exactly these queued and running records and replicas: what
        telling them again (``Stopped`` each, then the rest) would leave, so there is nothing to tell (a
        caller that reads back what this state assumed)."""
        queued = {w.id: w for w in queue}
        runs = {r.id: r for r in running}
        for id in ids:
            if self.queue.get(id) != queued.get(id) or self.running.get(id) != runs.get(id):
                return False
            mine, theirs = self.replicas.get(id, []), [p for p in placed if p.workload == id]
            if len(mine) != len(theirs):
                return False
            if len(theirs) == 1 and mine[0] != theirs[0]:  # most hold one: no Counter to make
                return False
            if len(theirs) > 1 and Counter(mine) != Counter(theirs):
                return False
        return True

    def _prio(self, w: Queued) -> Prio:
        """``w``'s place in the priority order now (:meth:`PriorityLists.prio_of`)."""
        return self.lists.prio_of(w)

    def _ordered(self, ws: Collection[Queued]) -> list[Queued]:
        """``ws`` in the priority order (:meth:`PriorityLists.ordered`)."""
        return self.lists.ordered(ws)

    # -- a cycle ----------------------------------------------------------------------------

    def cycle(self, now: float) -> list[Decision]:
        """Re-decide what could have changed; assume its placements; see :func:`step`."""
        # 1. timers come due: a fallback list may be tried, a queue head starts holding a node, a back-off ends
        for id in self.timer_queue.due(now):
            w = self.queue.get(id)
            if w is not None:
                self._mark_dirty(w.region, id)
                if id in self.backing and w.not_before <= now:
                    self.backing.discard(id)
                    self._take_turn(w)
        # 2. an owner's quota or use changed (the ledger spans regions): each of its workloads is decided
        #    again, in every region it waits or moves in
        for owner in self.touched:
            for _, id in self.owner_keys.get(owner, ()):
                self._mark_dirty(self.queue[id].region, id)
            for region in self.owner_regions.get(owner, ()):
                self.dirty.add(region)
        #    an owner's turn changed: its workloads whose turn did move in their lists (their decisions stand
        #    unless the checks of the cycle say otherwise: a new order matters only where something fits)
        moved: dict[str, list[str]] = {}
        for owner, (below, above) in self.turns.items():
            keys = self.owner_keys.get(owner, [])
            for _, id in keys[: bisect.bisect_left(keys, below)] + keys[bisect.bisect_right(keys, above):]:
                region = self.queue[id].region
                moved.setdefault(region, []).append(id)
                self.dirty.add(region)
        self.touched, self.turns = set(), {}
        if not self.dirty:
            return []
        regions, self.dirty = self.dirty, set()
        for region in regions:
            if region not in self.decided:
                self.whole.add(region)
            if region in self.whole:
                self.lists.unsorted.add(region)  # decided whole: its lists are rebuilt when next needed
            elif region in self.lists.unsorted or len(moved.get(region, ())) > len(self.by_region.get(region, ())) // 8:
                self.lists.unsorted.add(region)
                self.lists.rebuild(region, now)
            else:  # new, timer due, turn changed: in their lists again, in their place
                for id in [*self.must.get(region, ()), *moved.get(region, ())]:
                    w = self.queue.get(id)
                    if w is not None:
                        self.lists.remove(w)
                        self.lists.add(w, now)
        # 3. decide them, as decide would, over what could change
        return self._decide(regions, now)

    def _decide(self, regions: set[str], now: float) -> list[Decision]:
        """``decide``'s passes over the part of ``regions`` that could change, tried again over more until
        the checks show the rest keeps its decision (:meth:`CycleProof.widen`)."""
        proof = CycleProof(self, now, _FIRST_PREFIX)
        tries = 0
        while True:
            self.whole |= regions - self.decided
            proof.start_try(regions)
            chosen, also = proof.select()
            ordered = self.lists.ordered(chosen.values())
            if regions - self.whole or self.default_quota is not None or self.quota_by_owner:
                self.cap.checkpoint()  # (decided whole with no quota, nothing can call for another try)
            out = run_cycle(ordered, self.cap, (), now, self.policy, self.quotas(), also, proof.counted,
                            proof.room_for_fallbacks, proof.movers_to_try)
            wider = proof.widen(chosen, out)
            if wider is None:
                break
            self.cap.rollback()
            tries += 1
            if tries >= _MAX_TRIES:  # each try widens what is decided, so this is never reached; if it were,
                self.whole |= wider  # deciding the regions whole ends it (their checks are skipped)
            regions = wider
        self.cap.commit()
        self._settle(regions, out, proof.counted, proof.tried)
        return out

    def _settle(self, regions: set[str], out: Sequence[Decision], counted: Mapping[tuple[str, str], int],
                tried: set[str]) -> None:
        """Keep the cycle's waits and offers; assume its placements (what was placed is running next cycle,
        and its region and owner change)."""
        for region in regions:
            for id in self.standing_decisions.offered.pop(region, set()) & tried:  # every mover tried is decided again
                self.standing_decisions.by_region.get(region, {}).pop(id, None)
            for key in [k for k in self.held_last if k[0] == region]:
                del self.held_last[key]
            self.must.pop(region, None)
        for key, n in counted.items():
            if n > 0:
                self.held_last[key] = True
        self.decided |= regions
        self.whole -= regions
        # a workload placed on its own class was decided with what it takes: its region needs no other cycle
        # for it (its owner's turns that moved, and its quota use, are the next cycle's to look at). One placed
        # on a fallback did hold its class from others this cycle, and no longer will: the next looks again.
        dirty = set(self.dirty)  # (what assuming the decisions marks dirty is not kept)
        gone: dict[str, list[Key]] = {}  # by owner: the keys placed, out of its turns after the loop
        stand: list[Decision] = []  # after the loop too: no place or promote is of a workload they name
        shares: dict[str, tuple[float, float] | None] = {}
        for d in out:
            if type(d) is Place:  # one more running, one fewer queued before its later ones
                on_fallback = d.cls != d.workload.gpu_class  # (d.fallback, without a property's call)
                if on_fallback:
                    dirty.add(d.workload.region)
                self._assume_placed(d, on_fallback, gone, shares)
            elif type(d) is Promote:  # the same running count
                dirty.add(d.workload.region)
                self._record_running(replace(d.workload, moving=True), turns=False)
                self._book_replica(Placed(d.node, d.to_class, d.workload.id), 1)
            else:
                stand.append(d)
        for owner, keys in gone.items():
            self._untake_turns(owner, keys)
            self._move_turns(owner, below=max(keys))
        self.standing_decisions.keep_all(stand)
        self.dirty = dirty

    def _assume_placed(self, d: Place, on_fallback: bool, gone: dict[str, list[Key]],
                       shares: dict[str, tuple[float, float] | None]) -> None:
        """Assume ``d`` (``on_fallback``: ``d.fallback``): what ``_record_running(running_from(d), turns=False)``
        then ``_book_replica`` of its replica do, for a workload queued (so not running), less its regions made
        dirty (``_settle`` keeps its own) and its key taken out of its owner's turns, added to ``gone``
        (``_untake_turns`` once per owner, after). ``shares``: each class's ``share`` (None: not in the
        catalog), this settling's, as ``_count_use`` finds it (a first cycle places most of its queue)."""
        w = d.workload
        id, region, owner = w.id, w.region, w.owner
        del self.queue[id]
        del self.by_region[region][id]
        if id in self.lists.prio or id in self.lists.eligible:  # (a region decided whole lists none: a first cycle's)
            self.lists.remove(w)
        standing = self.standing_decisions.by_region.get(region)
        if standing is not None and id in standing:
            self.standing_decisions.withdraw(region, id)
        if id in self.backing:
            self.backing.discard(id)
        else:
            keys = gone.get(owner)
            if keys is None:
                keys = gone[owner] = []
            keys.append((w.queued_since, id))
        r = running_from(d)
        self.running[id] = r
        self.owner_running[owner] += 1
        if on_fallback:  # a mover now: in its region still
            self.movers.setdefault(region, {})[id] = r
            for entry in preferred_over(r):
                self.prefers.setdefault((region, entry), set()).add(id)
        else:
            self._count_in_region(owner, region, -1)
        cls = d.cls
        if cls in shares:
            got = shares[cls]
        else:
            known = self.catalog.get(cls)
            got = shares[cls] = share(known) if known is not None else None
        if got is not None:  # _count_use(r, 1)
            use = self.use.get(owner)
            if use is None:
                use = self.use[owner] = [0.0, 0.0]
            use[0] += got[0]
            use[1] += got[1]
            if (self.default_quota is not None or self.quota_by_owner) and self.quota_of(owner) is not None:
                self.touched.add(owner)
        replica = Placed(d.node, cls, id)
        replicas = self.replicas.get(id)
        if replicas is None:
            self.replicas[id] = [replica]
        else:
            replicas.append(replica)
        on_node = self.on_node.get(d.node)
        if on_node is None:
            self.on_node[d.node] = [replica]
        else:
            on_node.append(replica)

    def _untake_turns(self, owner: str, keys: list[Key]) -> None:
        """``keys`` no longer count in ``owner``'s turns (a few deleted in place, many filtered out)."""
        have = self.owner_keys[owner]
        if len(keys) < 16:
            for key in keys:
                del have[bisect.bisect_left(have, key)]
        else:
            out = {id for _, id in keys}  # by id: a string keeps its hash, a tuple does not
            have[:] = [k for k in have if k[1] not in out]


def step(state: AdmissionState, events: Sequence[Event], now: float) -> tuple[AdmissionState, list[Decision]]:
    """Take in ``events``, then decide what they (and ``now``) could change.

    The decisions are those ``decide`` makes for the workloads re-decided (every Place and Promote, and
    the waits and offers decided again); elsewhere the waits of :meth:`AdmissionState.decisions` stand, and
    equal what ``decide`` would say."""
    with collector_paused():
        state.apply_all(events, now)
        return state, state.cycle(now)
