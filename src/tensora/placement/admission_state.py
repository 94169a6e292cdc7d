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
  show that every workload left out keeps its decision
  (``_more``: a decided requester found its class full, so every later one does too, capacity only shrinking
  within a cycle; a decided lister found its fallback class full, or it has no room left; no class changed from
  held to not held; no owner with a quota placed with a workload left out), or the heads are doubled (or the
  workloads added) and the cycle is tried again from a checkpoint of the capacity. So one freed GPU in a region
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
import heapq
import math
from collections import Counter
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from operator import attrgetter

from tensora.placement.admission import (
    Decision,
    Ledger,
    Outcome,
    OwnerQuotas,
    Place,
    Policy,
    Promote,
    Queued,
    Recount,
    RestartAvailable,
    Running,
    Wait,
    collector_paused,
    model_over_cpu_limit,
    preferred_over,
    run_cycle,
    share,
)
from tensora.placement.capacity import Capacity, GpuReserve, Node, Placed
from tensora.placement.catalog import CPU_WORD, Catalog, ComputeClass
from tensora.placement.kinds import WorkloadKind
from tensora.placement.quotas import Quotas

# -- events: what changed, as values ------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Submitted:
    """A workload queued (or queued again: it replaces a running record of the same id)."""

    workload: Queued


@dataclass(frozen=True, slots=True)
class Started:
    """A running record, new or changed (a move finished, a workload placed by someone else)."""

    workload: Running


@dataclass(frozen=True, slots=True)
class Stopped:
    """A workload stopped or deleted: its queued or running record and every replica it holds go."""

    id: str


@dataclass(frozen=True, slots=True)
class ReplicaPlaced:
    """Capacity taken on a node, outside this state's own decisions."""

    replica: Placed


@dataclass(frozen=True, slots=True)
class ReplicaEnded:
    """Capacity freed: a replica ended (the old one of a finished move, a crash)."""

    replica: Placed


@dataclass(frozen=True, slots=True)
class NodeAdded:
    """A node joined, or changed (cordoned, resized): it replaces the node of the same name."""

    node: Node


@dataclass(frozen=True, slots=True)
class NodeRemoved:
    name: str


@dataclass(frozen=True, slots=True)
class QuotaChanged:
    """An owner's running quotas (``owner`` None: the default for owners without their own)."""

    owner: str | None
    quota: Quotas | None


@dataclass(frozen=True, slots=True)
class OwnerHeld:
    """What an owner's replicas hold now in every region, as (GPUs, vCPUs of CPU classes), starting and
    stopping ones too: the store's count (``OwnerQuotas.held``), which a running record cannot see. From
    then on the owner's quota use is this figure, plus what this state's own decisions place, until the
    next ``OwnerHeld``. Send it after the other events of a step (they may change the running records)."""

    owner: str
    gpus: float
    cpu: float


Key = tuple[float, str]  # a queued workload's (queued_since, id): its place among its owner's
LOW: Key = (-math.inf, "")
HIGH: Key = (math.inf, "")

Event = (Submitted | Started | Stopped | ReplicaPlaced | ReplicaEnded | NodeAdded | NodeRemoved | QuotaChanged
         | OwnerHeld)


def running_from(p: Place) -> Running:
    """The running record a ``Place`` makes (what the controller stores for it)."""
    w = p.workload
    return Running(w.id, w.kind, w.gpu_class, p.cls, p.node, w.owner, w.region, w.fallback,
                   w.model_params, w.model_bytes)


# -- the state ------------------------------------------------------------------------------

Prio = tuple[int, float, str]
"""A queued workload's place in the priority order: (its owner's turn, queued_since, id)."""

_WAITED = (Outcome.NO_CAPACITY, Outcome.NO_NODE)
_BLOCKED = (Outcome.NO_CAPACITY, Outcome.NO_NODE, Outcome.HELD_FOR_REQUESTERS)
"""What a fallback attempt on a class found that every later one finds too, this cycle."""
_FIRST_PREFIX = 4
_MAX_TRIES = 64
"""Tries of one cycle before its regions are decided whole (a bound, not a tuning)."""
"""How many of each list's head a cycle decides first; doubled for a list that needs more."""


class AdmissionState:
    """Everything ``decide`` would rebuild each cycle, kept; see the module docstring."""

    def __init__(
        self,
        nodes: Iterable[Node],
        placed: Iterable[Placed],
        catalog: Catalog,
        policy: Policy | None = None,
        quotas: OwnerQuotas | None = None,
        reserves: Mapping[str, GpuReserve] | None = None,
    ) -> None:
        """``quotas.held`` is not read: each owner's use is kept from its running records (what ``decide``
        counts when ``held`` is None), or given by ``OwnerHeld``."""
        self.catalog = catalog
        self.policy = policy or Policy()
        self.default_quota = quotas.default if quotas else None
        self.quota_by_owner: dict[str, Quotas] = dict(quotas.by_owner) if quotas else {}
        self.replicas: dict[str, list[Placed]] = {}  # by workload id
        self.on_node: dict[str, list[Placed]] = {}  # by node name, kept while a node is away
        placed = list(placed)
        for p in placed:
            self.replicas.setdefault(p.workload, []).append(p)
            self.on_node.setdefault(p.node, []).append(p)
        self.cap = Capacity(nodes, placed, catalog, reserves)
        self.queue: dict[str, Queued] = {}
        self.by_region: dict[str, dict[str, Queued]] = {}
        self.owner_keys: dict[str, list[tuple[float, str]]] = {}  # each owner's queued, oldest first
        self.backing: set[str] = set()  # queued ids that may be backing off: in no owner's turns yet
        self.running: dict[str, Running] = {}
        self.movers: dict[str, dict[str, Running]] = {}  # by region: on a fallback class, not moving
        self.prefers: dict[tuple[str, str], set[str]] = {}  # (region, class or cpu) -> movers that prefer it
        self.owner_running: Counter[str] = Counter()
        self.owner_regions: dict[str, Counter[str]] = {}  # where an owner has queued or movers
        self.use: dict[str, list[float]] = {}  # each owner's (GPUs, vCPUs of CPU classes), from running
        self.timers: list[tuple[float, str]] = []  # (when, workload id): fallback, starvation, back-off end
        self.later: list[tuple[float, str]] = []  # timers not on the heap yet
        self.standing: dict[str, dict[str, Decision]] = {}  # by region, by id: the waits and offers that stand
        self.offered: dict[str, set[str]] = {}  # by region: the ids of the restart offers that stand
        self.n_waiting = 0  # the waits that stand, every region
        self.waited: Counter[tuple[str, str]] = Counter()  # standing waits for room, by (region, class asked)
        self.blocked: Counter[tuple[str, str, str]] = Counter()  # standing waits' (region, entry, class) blocked
        self.held_last: dict[tuple[str, str], bool] = {}  # a class held from fallbacks in its region's last cycle
        self.dirty: set[str] = self.cap.regions
        self.whole: set[str] = set(self.dirty)  # regions to re-decide whole (never decided, a node changed)
        self.must: dict[str, set[str]] = {}  # by region: ids to re-decide (new, timer due, quota use changed)
        self.touched: set[str] = set()  # owners with a quota whose quota or use changed: all their regions
        self.turns: dict[str, tuple[Key, Key]] = {}  # owner -> (below, above): queued keys whose turn changed
        # the priority order, kept per list: requesters of a class, eligible listers of a fallback entry
        self.prio: dict[str, Prio] = {}
        self.reqs: dict[str, dict[str, list[Prio]]] = {}  # region -> class asked -> its requesters
        self.listers: dict[str, dict[str, list[Prio]]] = {}  # region -> fallback entry -> eligible listers
        self.eligible: set[str] = set()  # queued ids listed as eligible for their fallback lists
        self.unsorted: set[str] = set()  # regions whose lists are rebuilt before they are used again
        self.decided: set[str] = set()  # regions decided at least once (the others are decided whole)

    # -- reading ------------------------------------------------------------------------

    def decisions(self) -> Iterator[Decision]:
        """The waits and restart offers that stand now, every region, with the figures of now (what is free,
        who waits, each owner's use: :class:`tensora.placement.admission.Recount`)."""
        recount = Recount(self.cap, Ledger(self.quotas(), (), self.catalog), self.waited)
        for region in sorted(self.standing):
            for d in self.standing[region].values():
                yield recount.wait(d) if type(d) is Wait else d

    def waiting(self) -> int:
        """How many waits stand now (every queued workload not backing off, once decided)."""
        return self.n_waiting

    def quotas(self) -> OwnerQuotas | None:
        """The quotas as ``decide`` takes them, with each owner's use kept here as ``held`` (None: no owner has
        a quota, and none is counted)."""
        if self.default_quota is None and not self.quota_by_owner:
            return None
        return OwnerQuotas(self.default_quota, self.quota_by_owner,
                           {o: (u[0], u[1]) for o, u in self.use.items()})

    def offers(self) -> list[RestartAvailable]:
        """The restart offers that stand now, every region."""
        out = []
        for region, ids in sorted(self.offered.items()):
            standing = self.standing.get(region, {})
            out += [d for id in sorted(ids) if type(d := standing.get(id)) is RestartAvailable]
        return out

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

    # -- records --------------------------------------------------------------------------

    def _regions_of(self, owner: str, region: str, n: int) -> None:
        regions = self.owner_regions.get(owner)
        if regions is None:
            regions = self.owner_regions[owner] = Counter()
        left = regions.get(region, 0) + n
        if left > 0:
            regions[region] = left
        else:
            regions.pop(region, None)

    def _enqueue(self, w: Queued) -> None:
        if w.id in self.queue or w.id in self.running:
            self._drop(w.id)
        self.queue[w.id] = w
        self.by_region.setdefault(w.region, {})[w.id] = w
        self._regions_of(w.owner, w.region, 1)
        self._dirty(w.region, w.id)
        later = self.later  # onto the heap at the next cycle, in one go (a first cycle submits the queue)
        if w.not_before > 0:  # it may be backing off: it takes its turn when its timer ends (as if absent till then)
            self.backing.add(w.id)
            later.append((w.not_before, w.id))
        else:
            self._take_turn(w)
        if w.fallback:
            later.append((w.queued_since + w.fallback_after_s, w.id))
        later.append((_starving_from(w.queued_since, self.policy.starvation_after_s), w.id))

    def _enqueue_all(self, ws: Sequence[Queued], now: float) -> None:
        """``_enqueue`` of each of ``ws`` in turn, in bulk (a first cycle submits the whole queue): each owner's
        turn list sorted once, not an insort per workload. One that replaces a record (queued or running
        already, or twice in ``ws``) is enqueued alone, after those before it."""
        batch: dict[str, Queued] = {}
        for w in ws:
            if w.id in batch or w.id in self.queue or w.id in self.running:
                self._enqueue_new(list(batch.values()), now)
                batch = {}
                self._enqueue(w)
            else:
                batch[w.id] = w
        self._enqueue_new(list(batch.values()), now)

    def _enqueue_new(self, ws: Sequence[Queued], now: float) -> None:
        """``_enqueue`` of each of ``ws`` (ids neither queued nor running, each once), in bulk; less the fallback
        and starvation timers due by ``now``, the next cycle's: a timer coming due makes its workload's region
        dirty, which its submission did (a first cycle's are nearly all due)."""
        queue, by_region, later, backing, dirty = self.queue, self.by_region, self.later, self.backing, self.dirty
        after = self.policy.starvation_after_s
        owner_regions = self.owner_regions
        turns: dict[str, list[Key]] = {}  # each owner's new keys that take their turn now
        for w in ws:
            id, region, owner = w.id, w.region, w.owner
            queue[id] = w
            in_region = by_region.get(region)
            if in_region is None:
                in_region = by_region[region] = {}
            in_region[id] = w
            regions = owner_regions.get(owner)
            if regions is None:
                regions = owner_regions[owner] = Counter()
            regions[region] = regions.get(region, 0) + 1  # _regions_of(owner, region, 1)
            if region not in dirty or region in self.decided:
                self._dirty(region, id)
            if w.not_before > 0:
                backing.add(id)
                later.append((w.not_before, id))
            else:
                keys = turns.get(owner)
                if keys is None:
                    keys = turns[owner] = []
                keys.append((w.queued_since, id))
            if w.fallback and (when := w.queued_since + w.fallback_after_s) > now:
                later.append((when, id))
            if now - w.queued_since < after:  # (due: _starving_from(w.queued_since, after) <= now)
                later.append((_starving_from(w.queued_since, after), id))
        for owner, keys in turns.items():
            first = min(keys)
            had = self.owner_keys.setdefault(owner, [])
            behind = bool(had) and had[-1] > first  # some queued before it come after its first new one
            had += keys
            had.sort()
            if behind:  # (the new ones need no turn moved: their submission has them decided anyway)
                self._turns(owner, above=first)

    def _take_turn(self, w: Queued) -> None:
        """``w`` counts in its owner's turns (one more queued before its owner's later ones)."""
        bisect.insort(self.owner_keys.setdefault(w.owner, []), (w.queued_since, w.id))
        self._turns(w.owner, above=(w.queued_since, w.id))

    def _dirty(self, region: str, id: str) -> None:
        self.dirty.add(region)
        if region in self.decided and region not in self.whole:  # a region decided whole needs no list
            self.must.setdefault(region, set()).add(id)

    def _start(self, r: Running, *, turns: bool = True) -> None:
        """Record ``r`` as running; ``turns`` False: the caller accounts for the turns it changes."""
        was = self.running.get(r.id)
        turns = turns and (was is None or was.owner != r.owner)  # a record replaced: the same count
        self._drop(r.id, turns=turns)
        self.running[r.id] = r
        self.owner_running[r.owner] += 1
        if r.on_fallback and not r.moving:
            self.movers.setdefault(r.region, {})[r.id] = r
            for entry in preferred_over(r):
                self.prefers.setdefault((r.region, entry), set()).add(r.id)
            self._regions_of(r.owner, r.region, 1)
        self._count(r, 1)
        self.dirty.add(r.region)
        if turns:
            self._turns(r.owner, below=HIGH)  # one more running: every queued one of its owner

    def _drop(self, id: str, *, turns: bool = True) -> None:
        """Forget the queued or running record ``id`` (its replicas stay)."""
        w = self.queue.pop(id, None)
        if w is not None:
            del self.by_region[w.region][id]
            self._regions_of(w.owner, w.region, -1)
            self._unlist(w)
            self._unstand(w.region, id)
            self.dirty.add(w.region)
            if id in self.backing:
                self.backing.discard(id)
            else:
                keys = self.owner_keys[w.owner]
                del keys[bisect.bisect_left(keys, (w.queued_since, w.id))]
                if turns:
                    self._turns(w.owner, above=(w.queued_since, w.id))
        r = self.running.pop(id, None)
        if r is not None:
            self.owner_running[r.owner] -= 1
            if self.movers.get(r.region, {}).pop(id, None) is not None:
                for entry in preferred_over(r):
                    self.prefers[(r.region, entry)].discard(id)
                self._regions_of(r.owner, r.region, -1)
            self._unstand(r.region, id)
            self._count(r, -1)
            self.dirty.add(r.region)
            if turns:
                self._turns(r.owner, below=HIGH)

    def _unstand(self, region: str, id: str) -> None:
        standing = self.standing.get(region)
        d = standing.pop(id, None) if standing is not None else None
        if type(d) is Wait:
            self._tally(region, d, -1)
            self.n_waiting -= 1

    def _stand(self, region: str, d: Decision) -> None:
        self._unstand(region, d.workload.id)
        self.standing.setdefault(region, {})[d.workload.id] = d
        if type(d) is Wait:
            self._tally(region, d, 1)
            self.n_waiting += 1

    def _tally(self, region: str, d: Wait, sign: int) -> None:
        """Count a wait in (1) or out (-1): waiting for room for its class (``waited``), and each fallback
        class it found full, held or on no node (``blocked``)."""
        attempts = d.attempts
        if attempts[0].outcome in _WAITED:
            self.waited[(region, d.workload.gpu_class)] += sign
        for a in attempts[1:]:
            if a.outcome in _BLOCKED and a.entry is not None:
                self.blocked[(region, a.entry, a.cls)] += sign

    def _turns(self, owner: str, below: Key = LOW, above: Key = HIGH) -> None:
        """The owner's queued workloads with a key < ``below`` or > ``above`` change turn."""
        lo, hi = self.turns.get(owner, (LOW, HIGH))
        self.turns[owner] = (below if below > lo else lo, above if above < hi else hi)

    def _count(self, r: Running, sign: int) -> None:
        cls = self.catalog.get(r.placed_class)
        if cls is not None:
            use = self.use.setdefault(r.owner, [0.0, 0.0])
            gpus, cpu = share(cls)
            use[0] += sign * gpus
            use[1] += sign * cpu
            if self._quota_of(r.owner) is not None:
                self.touched.add(r.owner)

    def _replica(self, p: Placed, sign: int) -> None:
        if not self._book(p, sign):
            return  # not held: nothing to free
        at, cls = self.cap.index.get(p.node), self.catalog.get(p.cls)
        if at is not None and cls is not None:
            self.cap.change(at, cls, sign)
            self.dirty.add(self.cap.nodes[at].region)

    def _book(self, p: Placed, sign: int) -> bool:
        """Count replica ``p`` in (1) or out (-1) of the books; False: it was not there to count out."""
        if sign > 0:
            self.replicas.setdefault(p.workload, []).append(p)
            self.on_node.setdefault(p.node, []).append(p)
        elif p not in self.replicas.get(p.workload, ()):
            return False
        else:
            for book, key in ((self.replicas, p.workload), (self.on_node, p.node)):
                held = book[key]
                held.remove(p)
                if not held:
                    del book[key]
        return True

    def _node(self, name: str, node: Node | None) -> None:
        at = self.cap.index.get(name)
        if at is not None:
            self._whole(self.cap.nodes[at].region)
            self.cap.remove_node(name)
        if node is not None:
            classes = [c for p in self.on_node.get(name, []) if (c := self.catalog.get(p.cls)) is not None]
            self.cap.add_node(node, classes)
            self._whole(node.region)

    def _whole(self, region: str) -> None:
        """Re-decide ``region`` whole next cycle (what a class could ever fit on changed)."""
        self.dirty.add(region)
        self.whole.add(region)

    def apply(self, event: Event) -> None:
        """Take in one change."""
        match event:
            case Submitted(w):
                self._enqueue(w)
            case Started(r):
                self._start(r)
            case Stopped(id):
                self._drop(id)
                for p in list(self.replicas.get(id, [])):
                    self._replica(p, -1)
            case ReplicaPlaced(p):
                self._replica(p, 1)
            case ReplicaEnded(p):
                self._replica(p, -1)
            case NodeAdded(node):
                self._node(node.name, node)
            case NodeRemoved(name):
                self._node(name, None)
            case OwnerHeld(owner, gpus, cpu):
                self.use[owner] = [gpus, cpu]
                if self._quota_of(owner) is not None:
                    self.touched.add(owner)
            case QuotaChanged(owner, quota):
                if owner is None:
                    self.default_quota = quota
                    for region in self._all_regions():
                        self._whole(region)
                else:
                    if quota is None:
                        self.quota_by_owner.pop(owner, None)
                    else:
                        self.quota_by_owner[owner] = quota
                    self.touched.add(owner)

    def apply_all(self, events: Iterable[Event], now: float) -> None:
        """Take in each change in turn, as ``apply``, before a cycle at ``now``; submissions that come one after
        another in bulk (a first cycle submits the whole queue)."""
        run: list[Queued] = []
        for event in events:
            if type(event) is Submitted:
                run.append(event.workload)
                continue
            if run:
                self._enqueue_all(run, now)
                run = []
            self.apply(event)
        if run:
            self._enqueue_all(run, now)

    def _all_regions(self) -> set[str]:
        return self.cap.regions | set(self.by_region) | set(self.movers) | set(self.standing)

    def _quota_of(self, owner: str) -> Quotas | None:
        return self.quota_by_owner.get(owner, self.default_quota)

    # -- the priority order, per list -------------------------------------------------------
    # Each region keeps, in priority order, the requesters of each class and the listers of each fallback
    # entry whose timer ran out: a cycle decides the heads of those lists, not the whole queue.

    def _prio(self, w: Queued) -> Prio:
        if not self.policy.owner_fairness:
            return (0, w.queued_since, w.id)
        turn = self.owner_running.get(w.owner, 0) + bisect.bisect_left(self.owner_keys[w.owner], (w.queued_since, w.id))
        return (turn, w.queued_since, w.id)

    def _ordered(self, ws: Collection[Queued]) -> list[Queued]:
        """``ws`` sorted by :meth:`_prio`; where ``ws`` holds every one of its owners' workloads that take a turn
        (a region decided whole: a first cycle), without a bisect each: in (queued_since, id) order an owner's
        n-th is its n-th key, so its turn is its running count + n, and a stable bucketing by turn ends it."""
        fair = self.policy.owner_fairness
        if fair:
            count = Counter(w.owner for w in ws)
            if any(len(self.owner_keys.get(o, ())) != n for o, n in count.items()) \
                    or not self.backing.isdisjoint([w.id for w in ws]):
                return sorted(ws, key=self._prio)
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

    def _lists_of(self, w: Queued) -> list[list[Prio]]:
        out = []
        if w.gpu_class in self.catalog:  # an unknown class waits whatever happens: in no list
            out.append(self.reqs.setdefault(w.region, {}).setdefault(w.gpu_class, []))
        if w.id in self.eligible:
            lists = self.listers.setdefault(w.region, {})
            for entry in dict.fromkeys(w.fallback):
                if entry != CPU_WORD or not self._never_on_cpu(w):
                    out.append(lists.setdefault(entry, []))
        return out

    def _never_on_cpu(self, w: Queued) -> bool:
        """An endpoint whose model is over the CPU limit: the word ``cpu`` never places it, whatever is free
        (``decide`` says so before it looks at a class), so it is no lister of that word. Left at the head of
        its list, it would be decided again each cycle, as would the three after it."""
        return w.kind == WorkloadKind.ENDPOINT and model_over_cpu_limit(w.model_params, self.policy)

    def _list(self, w: Queued, now: float, *, sort: bool = True) -> None:
        """Put ``w`` in its lists (in order; ``sort`` False: at the end, for a rebuild that sorts after)."""
        if w.not_before > now:
            return  # backing off: a candidate again when its timer ends
        if w.fallback and now >= w.queued_since + w.fallback_after_s:
            self.eligible.add(w.id)
        p = self.prio[w.id] = self._prio(w)
        for lst in self._lists_of(w):
            if sort:
                bisect.insort(lst, p)
            else:
                lst.append(p)

    def _unlist(self, w: Queued) -> None:
        p = self.prio.pop(w.id, None)
        if p is not None and w.region not in self.unsorted:
            for lst in self._lists_of(w):
                i = bisect.bisect_left(lst, p)
                if i < len(lst) and lst[i] == p:
                    del lst[i]
        self.eligible.discard(w.id)

    def _relist(self, region: str, now: float) -> None:
        """Rebuild ``region``'s lists from its queue (first use, or after a cycle that changed many turns)."""
        self.reqs.pop(region, None)
        self.listers.pop(region, None)
        for w in self.by_region.get(region, {}).values():
            self.eligible.discard(w.id)
            self._list(w, now, sort=False)
        for lists in (self.reqs, self.listers):
            for lst in lists.get(region, {}).values():
                lst.sort()
        self.unsorted.discard(region)

    # -- a cycle ----------------------------------------------------------------------------

    def cycle(self, now: float) -> list[Decision]:
        """Re-decide what could have changed; assume its placements; see :func:`step`."""
        # 1. timers come due: a fallback list may be tried, a queue head starts holding a node, a back-off ends
        for id in self._due(now):
            w = self.queue.get(id)
            if w is not None:
                self._dirty(w.region, id)
                if id in self.backing and w.not_before <= now:
                    self.backing.discard(id)
                    self._take_turn(w)
        # 2. an owner's quota or use changed (the ledger spans regions): each of its workloads is decided
        #    again, in every region it waits or moves in
        for owner in self.touched:
            for _, id in self.owner_keys.get(owner, ()):
                self._dirty(self.queue[id].region, id)
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
                self.unsorted.add(region)  # decided whole: its lists are rebuilt when next needed
            elif region in self.unsorted or len(moved.get(region, ())) > len(self.by_region.get(region, ())) // 8:
                self.unsorted.add(region)
                self._relist(region, now)
            else:  # new, timer due, turn changed: in their lists again, in their place
                for id in [*self.must.get(region, ()), *moved.get(region, ())]:
                    w = self.queue.get(id)
                    if w is not None:
                        self._unlist(w)
                        self._list(w, now)
        # 3. decide them, as decide would, over what could change
        return self._decide(regions, now)

    def _due(self, now: float) -> list[str]:
        """The ids whose timers came due, off the heap (split in one pass when many are: a first cycle, where
        most workloads' two or three timers are all due, each id then given once)."""
        if self.later:
            if len(self.later) > len(self.timers):
                self.timers += self.later
                heapq.heapify(self.timers)
            else:
                for t in self.later:
                    heapq.heappush(self.timers, t)
            self.later = []
        timers = self.timers
        if len(timers) > 64 and timers[len(timers) // 2][0] <= now:  # a rough sign that many are due
            due = list(dict.fromkeys([id for t, id in timers if t <= now]))
            self.timers = [x for x in timers if x[0] > now]
            heapq.heapify(self.timers)
            return due
        due = []
        while timers and timers[0][0] <= now:
            due.append(heapq.heappop(timers)[1])
        return due

    def _decide(self, regions: set[str], now: float) -> list[Decision]:
        """``decide``'s passes over the part of ``regions`` that could change, tried again over more until
        the checks show the rest keeps its decision (:meth:`_more`)."""
        prefix: dict[tuple[int, str, str], int] = {}
        extra: dict[str, set[str]] = {}
        closed: dict[tuple[int, str, str], bool] = {}
        tries = 0
        while True:
            self.whole |= regions - self.decided
            roomy: dict[tuple[str, str], bool] = {}

            def room_for_fallbacks(regions: set[str] = regions, roomy: dict[tuple[str, str], bool] = roomy) -> None:
                """After the first pass: which fallback classes have room left (it only shrinks from there), for
                the lists with listers left out (the checks ask only of those)."""
                for region in regions - self.whole:
                    for entry, lst in self.listers.get(region, {}).items():
                        if prefix.get((1, region, entry), _FIRST_PREFIX) >= len(lst):
                            continue
                        classes = self.catalog.cpu_classes if entry == CPU_WORD else [self.catalog.get(entry)]
                        for cls in classes:
                            if cls is not None and (region, cls.name) not in roomy:
                                roomy[(region, cls.name)] = self.cap.find(region, cls) is not None

            chosen, also = self._select(regions, prefix, extra, closed, now)
            ordered = self._ordered(chosen.values())
            tried: set[str] = set()

            counted: dict[tuple[str, str], int] = {}

            def movers(regions: set[str] = regions, counted: dict[tuple[str, str], int] = counted,
                       tried: set[str] = tried) -> list[Running]:
                """The movers whose move back could change: a whole region's every one; elsewhere those with an
                offer standing, and those one of whose preferred classes has room left now and is not held (room
                only shrinks from here on; the others find nothing, whatever their owner's quota)."""
                out: list[Running] = []
                for region in regions:
                    movers = self.movers.get(region, {})
                    ids = set(movers) if region in self.whole else {id for id in self.offered.get(region, ())
                                                                      if id in movers}
                    if region not in self.whole:
                        for (r, entry), who in self.prefers.items():
                            if r == region and who and self._has_room(region, entry, counted):
                                ids |= who
                    tried |= ids
                    out += [movers[id] for id in ids]
                return out

            if regions - self.whole or self.default_quota is not None or self.quota_by_owner:
                self.cap.checkpoint()  # (decided whole with no quota, nothing can call for another try)
            out = run_cycle(ordered, self.cap, (), now, self.policy, self.quotas(), also, counted,
                            room_for_fallbacks, movers)
            wider = self._more(regions, chosen, out, counted, prefix, extra, roomy, now)
            if wider is None:
                break
            self.cap.rollback()
            tries += 1
            if tries >= _MAX_TRIES:  # each try widens what is decided, so this is never reached; if it were,
                self.whole |= wider  # deciding the regions whole ends it (their checks are skipped)
            regions = wider
        self.cap.commit()
        self._settle(regions, out, counted, tried)
        return out

    def _has_room(self, region: str, entry: str, counted: Mapping[tuple[str, str], int]) -> bool:
        """Whether a class ``entry`` stands for has room now and is not held for its requesters."""
        classes = self.catalog.cpu_classes if entry == CPU_WORD else [self.catalog.get(entry)]
        return any(cls is not None and not counted.get((region, cls.name), 0) and self.cap.find(region, cls) is not None
                   for cls in classes)

    def _closed(self, kind: int, region: str, entry: str, closed: dict[tuple[int, str, str], bool]) -> bool:
        """Whether no workload of a list can be placed by what ``entry`` stands for this cycle, decided or not:
        every class it names had no room in ``region`` when the cycle began (room only shrinks within a
        cycle), or, for fallback listers, was held for its requesters in the region's last cycle (the checks
        see to it that it still is: a class that stops being held has its listers all decided). Kept in
        ``closed``: a try again starts from the same capacity."""
        key = (kind, region, entry)
        found = closed.get(key)
        if found is None:
            classes = self.catalog.cpu_classes if entry == CPU_WORD else [self.catalog.get(entry)]
            held = self.held_last if kind == 1 else {}
            found = closed[key] = all(cls is None or held.get((region, cls.name), False)
                                      or self._no_room(region, cls, closed) for cls in classes)
        return found

    def _no_room(self, region: str, cls: ComputeClass, closed: dict[tuple[int, str, str], bool]) -> bool:
        """Whether ``cls`` had no room in ``region`` when the cycle began, kept in ``closed`` (under kind 2):
        a CPU class is asked of for its requesters and for the word ``cpu``, a class for its requesters and
        its listers."""
        key = (2, region, cls.name)
        found = closed.get(key)
        if found is None:
            found = closed[key] = self.cap.no_room(region, cls)
        return found

    def _head(self, kind: int, region: str, name: str, lst: Sequence[Prio], prefix: dict[tuple[int, str, str], int],
              closed: dict[tuple[int, str, str], bool], now: float) -> int:
        """How much of a list to decide: ``_FIRST_PREFIX``, or where it is closed (:meth:`_closed`) only a
        requesters' list's first if it may hold a node (:meth:`_may_hold`) and no lister (each finds its class
        full or held again)."""
        n = prefix.get((kind, region, name))
        if n is None:
            if not lst or not self._closed(kind, region, name, closed):
                n = _FIRST_PREFIX
            elif kind == 1:
                n = 0
            else:
                n = 1 if self._may_hold(self.queue[lst[0][2]], now) else 0
            prefix[(kind, region, name)] = n
        return n

    def _may_hold(self, first: Queued, now: float) -> bool:
        """Whether the first requester of a class with no room may hold a node for it: it starves (``decide``
        lets the first requester that finds its class full hold a node if it starves), or an owner's quota may
        keep it from trying, so that the next one finds the class full first. Else every requester of the
        class finds it full and none holds a node (while none of them is decided: see :meth:`_select`)."""
        return now - first.queued_since >= self.policy.starvation_after_s \
            or self.default_quota is not None or bool(self.quota_by_owner)

    def _select(self, regions: set[str], prefix: dict[tuple[int, str, str], int], extra: dict[str, set[str]],
                closed: dict[tuple[int, str, str], bool],
                now: float) -> tuple[dict[str, Queued], Counter[tuple[str, str]]]:
        """The workloads to decide: a whole region's every one; elsewhere those that must be (new, timer due,
        quota use changed), and the head of each list (:meth:`_head`). ``also``: the others waiting for room,
        per class."""
        chosen: dict[str, Queued] = {}
        also: Counter[tuple[str, str]] = Counter()
        for region in regions:
            queued = self.by_region.get(region, {})
            if region in self.whole:
                chosen.update((id, w) for id, w in queued.items() if w.not_before <= now)
                continue
            if region in self.unsorted:
                self._relist(region, now)
            picked: dict[str, Queued] = {}
            for id in self.must.get(region, set()) | extra.get(region, set()):
                w = queued.get(id)
                if w is not None and w.not_before <= now:
                    picked[id] = w
            unheaded: list[tuple[str, list[Prio]]] = []  # requesters' lists with no room, their first left out
            for kind, lists in ((0, self.reqs), (1, self.listers)):
                for name, lst in lists.get(region, {}).items():
                    n = self._head(kind, region, name, lst, prefix, closed, now)
                    if n == 0 and kind == 0:
                        unheaded.append((name, lst))
                    for p in lst[:n]:
                        picked[p[2]] = queued[p[2]]
            # another requester of such a class decided finds it full first, and might hold a node, where decide
            # has the first: the first is decided too
            for name, lst in unheaded:
                if lst[0][2] not in picked and any(w.gpu_class == name for w in picked.values()):
                    picked[lst[0][2]] = queued[lst[0][2]]
            standing = self.standing.get(region, {})
            for (r, cls), n in self.waited.items():
                if r == region and n:
                    also[(r, cls)] += n
            for id, w in picked.items():
                d = standing.get(id)
                if type(d) is Wait and d.attempts[0].outcome in _WAITED:
                    also[(region, w.gpu_class)] -= 1
            chosen.update(picked)
        return chosen, also

    def _more(self, regions: set[str], chosen: Mapping[str, Queued], out: Sequence[Decision],
              counted: Mapping[tuple[str, str], int], prefix: dict[tuple[int, str, str], int],
              extra: dict[str, set[str]], roomy: Mapping[tuple[str, str], bool], now: float) -> set[str] | None:
        """None when every workload left out keeps its decision; else the regions to try again, with longer
        heads (``prefix``) or more workloads (``extra``). A workload left out keeps its decision when:

        1. a class's requesters: one decided failed for want of room (each after it fails too, since capacity
           only shrinks within a cycle, and the queue head that holds a node is among those decided);
        2. a fallback entry's listers: its class had no room left after the first pass, or is held, or one decided found
           it full (or held, or on no node), or none left out found it so before (they never try it);
        3. no class went from held from fallbacks to not held, or back, unless all its listers are decided;
        4. no owner with a quota placed or promoted here has a workload left out (its use grew), and every
           region of that owner is decided in the same cycle (its use spans them).
        """
        partial = regions - self.whole  # (a region decided whole has nothing left out: no check asks of it)
        by_id = {d.workload.id: d for d in out if type(d) is Place or type(d) is Wait} if partial else {}
        again = False
        for region in partial:
            standing = self.standing.get(region, {})
            for name, lst in self.reqs.get(region, {}).items():
                n = prefix.get((0, region, name), _FIRST_PREFIX)
                if n == 0 or n >= len(lst) or not self.waited[(region, name)] \
                        or any(_waited(by_id.get(p[2])) for p in lst[:n]):
                    continue  # (n == 0: the class had no room when the cycle began, so each waits for it)
                # none decided waited for room: fine if none left out does either (they wait on a quota)
                if self.waited[(region, name)] - sum(_waited(standing.get(p[2])) for p in lst[:n]) > 0:
                    prefix[(0, region, name)], again = 2 * n, True
            for entry, lst in self.listers.get(region, {}).items():
                n = prefix.get((1, region, entry), _FIRST_PREFIX)
                if n >= len(lst):
                    continue
                if entry == CPU_WORD:
                    classes = [c.name for c in self.catalog.cpu_classes if not self.cap.unhostable(region, c)]
                else:
                    classes = [entry]
                for c in classes:
                    if not roomy.get((region, c), True) or counted.get((region, c), 0) > 0 \
                            or not self.blocked[(region, entry, c)] \
                            or any(_blocked(by_id.get(p[2]), c, entry) for p in lst[:n]):
                        continue
                    # none decided found it full: fine if none left out did either (they never try it here)
                    if self.blocked[(region, entry, c)] - sum(_blocked(standing.get(p[2]), c, entry)
                                                               for p in lst[:n]) > 0:
                        prefix[(1, region, entry)], again = max(1, 2 * n), True
                        break
            for cls in {c for r, c in counted if r == region} | {c for r, c in self.held_last if r == region}:
                if (counted.get((region, cls), 0) > 0) == self.held_last.get((region, cls), False):
                    continue
                entries = [cls, CPU_WORD] if cls in self.catalog and self.catalog[cls].is_cpu else [cls]
                for entry in entries:
                    lst = self.listers.get(region, {}).get(entry, [])
                    if prefix.get((1, region, entry), _FIRST_PREFIX) < len(lst):
                        prefix[(1, region, entry)], again = len(lst), True
        wider = set(regions)
        for d in out:
            if not (type(d) is Place or type(d) is Promote) or self._quota_of(d.workload.owner) is None:
                continue
            owner = d.workload.owner
            wider |= set(self.owner_regions.get(owner, ()))
            for _, id in self.owner_keys.get(owner, ()):
                w = self.queue[id]
                if id not in chosen and w.region in regions and w.region not in self.whole and w.not_before <= now:
                    extra.setdefault(w.region, set()).add(id)
                    again = True
        return wider if again or wider != regions else None

    def _settle(self, regions: set[str], out: Sequence[Decision], counted: Mapping[tuple[str, str], int],
                tried: set[str]) -> None:
        """Keep the cycle's waits and offers; assume its placements (what was placed is running next cycle,
        and its region and owner change)."""
        for region in regions:
            for id in self.offered.pop(region, set()) & tried:  # every mover tried is decided again
                self.standing.get(region, {}).pop(id, None)
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
                self._placed(d, on_fallback, gone, shares)
            elif type(d) is Promote:  # the same running count
                dirty.add(d.workload.region)
                self._start(replace(d.workload, moving=True), turns=False)
                self._book(Placed(d.node, d.to_class, d.workload.id), 1)
            else:
                stand.append(d)
        for owner, keys in gone.items():
            self._untake_turns(owner, keys)
            self._turns(owner, below=max(keys))
        self._stand_all(stand)
        self.dirty = dirty

    def _stand_all(self, ds: Sequence[Decision]) -> None:
        """``_stand`` each of ``ds`` (waits and restart offers) in turn, in one pass (a first cycle stands some
        50,000 waits)."""
        standing: dict[str, Decision] = {}
        region = None
        waited, blocked = self.waited, self.blocked
        n = 0
        for d in ds:
            w = d.workload
            if w.region != region:
                region = w.region
                standing = self.standing.setdefault(region, {})
            id = w.id
            was = standing.pop(id, None)
            if type(was) is Wait:
                self._tally(region, was, -1)
                n -= 1
            standing[id] = d
            if type(d) is Wait:
                n += 1
                attempts = d.attempts
                if attempts[0].outcome in _WAITED:
                    waited[(region, w.gpu_class)] += 1
                for a in attempts[1:]:
                    if a.outcome in _BLOCKED and a.entry is not None:
                        blocked[(region, a.entry, a.cls)] += 1
            else:
                self.offered.setdefault(region, set()).add(id)
        self.n_waiting += n

    def _placed(self, d: Place, on_fallback: bool, gone: dict[str, list[Key]],
                shares: dict[str, tuple[float, float] | None]) -> None:
        """Assume ``d`` (``on_fallback``: ``d.fallback``): what ``_start(running_from(d), turns=False)`` then
        ``_book`` of its replica do, for a workload queued (so not running), less its regions made dirty
        (``_settle`` keeps its own) and its key taken out of its owner's turns, added to ``gone``
        (``_untake_turns`` once per owner, after). ``shares``: each class's ``share`` (None: not in the
        catalog), this settling's, as ``_count`` finds it (a first cycle settles some 50,000 placements)."""
        w = d.workload
        id, region, owner = w.id, w.region, w.owner
        del self.queue[id]
        del self.by_region[region][id]
        if id in self.prio or id in self.eligible:  # (a region decided whole lists none: a first cycle's)
            self._unlist(w)
        standing = self.standing.get(region)
        if standing is not None and id in standing:
            self._unstand(region, id)
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
            self._regions_of(owner, region, -1)
        cls = d.cls
        if cls in shares:
            got = shares[cls]
        else:
            known = self.catalog.get(cls)
            got = shares[cls] = share(known) if known is not None else None
        if got is not None:  # _count(r, 1)
            use = self.use.get(owner)
            if use is None:
                use = self.use[owner] = [0.0, 0.0]
            use[0] += got[0]
            use[1] += got[1]
            if (self.default_quota is not None or self.quota_by_owner) and self._quota_of(owner) is not None:
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


def _waited(d: Decision | None) -> bool:
    """A requester whose class had no room for it (placed on a fallback after, or not)."""
    return d is not None and d.attempts[0].outcome in _WAITED


def _blocked(d: Decision | None, cls: str, entry: str) -> bool:
    """A lister that found ``cls`` (from ``entry``) full, held or on no node."""
    return d is not None and any(a.cls == cls and a.entry == entry and a.outcome in _BLOCKED for a in d.attempts)


def _starving_from(since: float, after: float) -> float:
    """The first ``now`` with ``now - since >= after`` (decide's test, to the float)."""
    t = since + after
    while t - since < after:
        t = math.nextafter(t, math.inf)
    while (prev := math.nextafter(t, -math.inf)) - since >= after:
        t = prev
    return t


def step(state: AdmissionState, events: Sequence[Event], now: float) -> tuple[AdmissionState, list[Decision]]:
    """Take in ``events``, then decide what they (and ``now``) could change.

    The decisions are those ``decide`` makes for the workloads re-decided (every Place and Promote, and
    the waits and offers decided again); elsewhere the waits of :meth:`AdmissionState.decisions` stand, and
    equal what ``decide`` would say."""
    with collector_paused():
        state.apply_all(events, now)
        return state, state.cycle(now)
