"""Admission kept across cycles: ``step(state, events, now) -> (state, decisions)``.

:func:`tensora.admission.decide` starts from nothing every cycle: it sorts the whole queue and
re-decides it against a copy of the whole fleet, even when nothing changed. The state here keeps
what decide would rebuild (the queue, the running records, their replicas, the free capacity,
each owner's quota use and turn) and is told what changed as events, so a cycle costs what changed:

* **Capacity by deltas**: a replica placed or ended, a node added, removed or cordoned changes
  the figures of one node and its region's totals (:meth:`Capacity.change` and friends), exactly
  as a rebuild would count them.
* **Parked until something could let it fit**: a region whose last cycle placed nothing is at a fixed
  point; its waits stand (they are not re-decided, and ``step`` does not repeat them) until an event
  could change one of them: capacity or a node of that region, a workload submitted or stopped there, a
  fallback or starvation timer of one of its workloads coming due, or a change to an owner with
  workloads there (a turn or a quota: an owner's turn and quota span regions). A cycle with no such
  event reads one heap top and returns nothing.
* **The same decisions**: a region that changed is re-decided by the passes of ``decide`` itself
  (:func:`tensora.admission.run_cycle`), over its queue in the global priority order (owner turns count
  every region), with each owner's quota use kept here. So every rule keeps every property it has
  (anti-starvation holds, fallback order, move-back after primary requesters, RestartAvailable, quotas);
  tests/test_admission_step.py checks, on random histories, that the state's decisions equal
  ``decide`` run from scratch on the same world, cycle by cycle.

Decisions are assumed as they are made (kube-scheduler's *assume*): a ``Place`` moves its workload
to the running records with its replica; a ``Promote`` marks the endpoint ``moving`` with its new
replica. The caller reports what happens next as events (a replica that ends, a move finished as
``Started``, a placement that failed as ``Stopped`` then ``Submitted``).

The unit of re-deciding is a region: inside one, every class shares nodes with the CPU classes (idle
CPU of GPU servers) and a wait's reason counts the region's free GPUs, so one freed GPU can change any
wait of that region. ``step`` mutates and returns ``state`` (it is pure otherwise: no I/O, no clock);
use the state it returns, not the one passed in.
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace

from tensora.placement.admission import (
    Decision,
    OwnerQuotas,
    Place,
    Policy,
    Promote,
    Queued,
    Running,
    run_cycle,
    share,
)
from tensora.placement.capacity import Capacity, GpuReserve, Node, Placed
from tensora.placement.catalog import Catalog
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
        counts when ``held`` is None)."""
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
        self.running: dict[str, Running] = {}
        self.movers: dict[str, dict[str, Running]] = {}  # by region: on a fallback class, not moving
        self.owner_running: Counter[str] = Counter()
        self.owner_regions: dict[str, Counter[str]] = {}  # where an owner has queued or movers
        self.use: dict[str, list[float]] = {}  # each owner's (GPUs, vCPUs of CPU classes), from running
        self.timers: list[tuple[float, str]] = []  # (when, workload id): a fallback or starvation due
        self.standing: dict[str, list[Decision]] = {}  # by region: the waits and restarts that stand
        self.dirty: set[str] = self.cap.regions
        self.touched: set[str] = set()  # owners with a quota whose quota or use changed: all their regions
        self.turns: dict[str, tuple[Key, Key]] = {}  # owner -> (below, above): queued keys whose turn changed

    # -- reading ------------------------------------------------------------------------

    def decisions(self) -> Iterator[Decision]:
        """The waits and restart offers that stand now, every region."""
        for region in sorted(self.standing):
            yield from self.standing[region]

    def quotas(self) -> OwnerQuotas:
        """The quotas as ``decide`` takes them, with each owner's use kept here as ``held``."""
        return OwnerQuotas(self.default_quota, self.quota_by_owner,
                           {o: (u[0], u[1]) for o, u in self.use.items()})

    # -- records --------------------------------------------------------------------------

    def _regions_of(self, owner: str, region: str, n: int) -> None:
        regions = self.owner_regions.get(owner)
        if regions is None:
            regions = self.owner_regions[owner] = Counter()
        regions[region] += n
        if regions[region] <= 0:
            del regions[region]

    def _enqueue(self, w: Queued) -> None:
        self._drop(w.id)
        self.queue[w.id] = w
        self.by_region.setdefault(w.region, {})[w.id] = w
        bisect.insort(self.owner_keys.setdefault(w.owner, []), (w.queued_since, w.id))
        self._regions_of(w.owner, w.region, 1)
        self.dirty.add(w.region)
        self._turns(w.owner, above=(w.queued_since, w.id))  # one more queued before its later ones
        if w.fallback:
            heapq.heappush(self.timers, (w.queued_since + w.fallback_after_s, w.id))
        heapq.heappush(self.timers, (_starving_from(w.queued_since, self.policy.starvation_after_s), w.id))

    def _start(self, r: Running, *, turns: bool = True) -> None:
        """Record ``r`` as running; ``turns`` False: the caller accounts for the turns it changes."""
        was = self.running.get(r.id)
        turns = turns and (was is None or was.owner != r.owner)  # a record replaced: the same count
        self._drop(r.id, turns=turns)
        self.running[r.id] = r
        self.owner_running[r.owner] += 1
        if r.on_fallback and not r.moving:
            self.movers.setdefault(r.region, {})[r.id] = r
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
            keys = self.owner_keys[w.owner]
            del keys[bisect.bisect_left(keys, (w.queued_since, w.id))]
            self._regions_of(w.owner, w.region, -1)
            self.dirty.add(w.region)
            if turns:
                self._turns(w.owner, above=(w.queued_since, w.id))
        r = self.running.pop(id, None)
        if r is not None:
            self.owner_running[r.owner] -= 1
            if self.movers.get(r.region, {}).pop(id, None) is not None:
                self._regions_of(r.owner, r.region, -1)
            self._count(r, -1)
            self.dirty.add(r.region)
            if turns:
                self._turns(r.owner, below=HIGH)

    def _turns(self, owner: str, below: Key = LOW, above: Key = HIGH) -> None:
        """The owner's queued workloads with a key < ``below`` or > ``above`` change turn."""
        was = self.turns.get(owner, (LOW, HIGH))
        self.turns[owner] = (max(was[0], below), min(was[1], above))

    def _count(self, r: Running, sign: int) -> None:
        cls = self.catalog.get(r.placed_class)
        if cls is not None:
            use = self.use.setdefault(r.owner, [0.0, 0.0])
            for i, n in enumerate(share(cls)):
                use[i] += sign * n
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
            self.dirty.add(self.cap.nodes[at].region)
            self.cap.remove_node(name)
        if node is not None:
            classes = [c for p in self.on_node.get(name, []) if (c := self.catalog.get(p.cls)) is not None]
            self.cap.add_node(node, classes)
            self.dirty.add(node.region)

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
                    self.dirty |= self._all_regions()
                else:
                    if quota is None:
                        self.quota_by_owner.pop(owner, None)
                    else:
                        self.quota_by_owner[owner] = quota
                    self.touched.add(owner)

    def _all_regions(self) -> set[str]:
        return self.cap.regions | set(self.by_region) | set(self.movers) | set(self.standing)

    # -- a cycle ----------------------------------------------------------------------------

    def _order_key(self, w: Queued) -> tuple[float, float, str] | tuple[float, str]:
        if not self.policy.owner_fairness:
            return (w.queued_since, w.id)
        turn = self.owner_running[w.owner] + bisect.bisect_left(self.owner_keys[w.owner], (w.queued_since, w.id))
        return (turn, w.queued_since, w.id)

    def _cycle(self, regions: set[str], now: float) -> tuple[set[str], list[Decision], Capacity]:
        """``decide``'s passes over ``regions``, widened until no owner with a quota there takes
        capacity while it has workloads in a region outside (its quota use spans regions)."""
        while True:
            queued = [w for r in regions for w in self.by_region.get(r, {}).values()
                      if w.not_before <= now]  # one backing off is not a candidate yet
            queued.sort(key=self._order_key)
            movers = [m for r in regions for m in self.movers.get(r, {}).values()]
            cap = self.cap.copy()
            out = run_cycle(queued, cap, movers, now, self.policy, self.quotas())
            wider = set(regions)
            for d in out:
                if isinstance(d, Place | Promote) and self._quota_of(d.workload.owner) is not None:
                    wider |= set(self.owner_regions.get(d.workload.owner, ()))
            if wider == regions:
                return regions, out, cap
            regions = wider

    def _quota_of(self, owner: str) -> Quotas | None:
        return self.quota_by_owner.get(owner, self.default_quota)

    def cycle(self, now: float) -> list[Decision]:
        """Re-decide the regions that changed; assume their placements; see :func:`step`."""
        # 1. timers come due: a fallback list may be tried, a queue head starts holding a node
        while self.timers and self.timers[0][0] <= now:
            _, id = heapq.heappop(self.timers)
            w = self.queue.get(id)
            if w is not None:
                self.dirty.add(w.region)
        # 2. an owner's turn changed: the regions of its workloads whose turn did; its quota or use (the
        #    ledger spans regions): every region it waits or could move back in
        for owner in self.touched:
            self.dirty |= set(self.owner_regions.get(owner, ()))
        for owner, (below, above) in self.turns.items():
            if self.dirty.issuperset(self.owner_regions.get(owner, ())):
                continue
            keys = self.owner_keys.get(owner, [])
            changed = keys[: bisect.bisect_left(keys, below)] + keys[bisect.bisect_right(keys, above):]
            self.dirty.update(self.queue[id].region for _, id in changed)
        self.touched, self.turns = set(), {}
        if not self.dirty:
            return []
        regions, self.dirty = self.dirty, set()
        # 3. decide them, as decide would
        regions, out, cap = self._cycle(regions, now)
        for region in regions:
            self.standing[region] = []
        # 4. assume: what was placed is running next cycle, and its region (and owner) change; the
        #    capacity is the cycle's own, which took exactly what was placed and promoted
        cap.release()
        self.cap = cap
        for d in out:
            if isinstance(d, Place):  # one more running, one fewer queued before its later ones
                self._start(running_from(d), turns=False)
                self._turns(d.workload.owner, below=(d.workload.queued_since, d.workload.id))
                self._book(Placed(d.node, d.cls, d.workload.id), 1)
            elif isinstance(d, Promote):  # the same running count
                self._start(replace(d.workload, moving=True), turns=False)
                self._book(Placed(d.node, d.to_class, d.workload.id), 1)
            else:
                self.standing[d.workload.region].append(d)
        return out


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

    The decisions are those ``decide`` makes for the regions re-decided (every Place and Promote, and
    there every Wait and RestartAvailable again); elsewhere the waits of :meth:`AdmissionState.decisions`
    stand, and equal what ``decide`` would say."""
    for event in events:
        state.apply(event)
    return state, state.cycle(now)

