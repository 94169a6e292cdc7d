"""The records a kept admission state holds between cycles, and how each change is taken in.

:class:`KeptRecords` holds what ``decide`` would rebuild each cycle: the queue (by region, each owner's queued in
turn order, those backing off), the running records (and the movers among them, on a fallback class), each
owner's quota use, the replicas and the free capacity, the timers, the standing waits and offers
(:class:`~tensora.placement.standing.StandingDecisions`) and the lists in priority order
(:class:`~tensora.placement.priority_lists.PriorityLists`). Each event changes what it touches and marks the
regions (and the workloads in them) that the next cycle must look at again.
"""

from __future__ import annotations

import bisect
import math
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence

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
)
from tensora.placement.attempts import preferred_over
from tensora.placement.capacity import Capacity, GpuReserve, Node, Placed
from tensora.placement.catalog import Catalog
from tensora.placement.decisions import Decision, Queued, Running
from tensora.placement.owner_quotas import OwnerQuotas, share
from tensora.placement.policy import Policy
from tensora.placement.priority_lists import Prio, PriorityLists
from tensora.placement.quotas import RunningQuotas
from tensora.placement.standing import StandingDecisions
from tensora.placement.timers import Timers, starving_from

Key = tuple[float, str]
"""A queued workload's (queued_since, id): its place among its owner's."""
LOW: Key = (-math.inf, "")
HIGH: Key = (math.inf, "")


class KeptRecords:
    """The records of a kept admission state; see the module docstring."""

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
        self.quota_by_owner: dict[str, RunningQuotas] = dict(quotas.by_owner) if quotas else {}
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
        self.timer_queue = Timers()  # fallback, starvation, back-off end
        self.standing_decisions = StandingDecisions()
        self.held_last: dict[tuple[str, str], bool] = {}  # a class held from fallbacks in its region's last cycle
        self.dirty: set[str] = self.cap.regions
        self.whole: set[str] = set(self.dirty)  # regions to re-decide whole (never decided, a node changed)
        self.must: dict[str, set[str]] = {}  # by region: ids to re-decide (new, timer due, quota use changed)
        self.touched: set[str] = set()  # owners with a quota whose quota or use changed: all their regions
        self.turns: dict[str, tuple[Key, Key]] = {}  # owner -> (below, above): queued keys whose turn changed
        self.lists = PriorityLists(catalog, self.policy, self.owner_running, self.owner_keys, self.backing,
                                   self.by_region)
        self.decided: set[str] = set()  # regions decided at least once (the others are decided whole)

    # -- read views of the parts (what they keep, under the names a reader of the state looks for) ---------

    @property
    def standing(self) -> dict[str, dict[str, Decision]]:
        return self.standing_decisions.by_region

    @property
    def offered(self) -> dict[str, set[str]]:
        return self.standing_decisions.offered

    @property
    def n_waiting(self) -> int:
        return self.standing_decisions.n_waiting

    @property
    def waited(self) -> Counter[tuple[str, str]]:
        return self.standing_decisions.waited

    @property
    def blocked(self) -> Counter[tuple[str, str, str]]:
        return self.standing_decisions.blocked

    @property
    def prio(self) -> dict[str, Prio]:
        return self.lists.prio

    @property
    def reqs(self) -> dict[str, dict[str, list[Prio]]]:
        return self.lists.reqs

    @property
    def listers(self) -> dict[str, dict[str, list[Prio]]]:
        return self.lists.listers

    @property
    def eligible(self) -> set[str]:
        return self.lists.eligible

    @property
    def unsorted(self) -> set[str]:
        return self.lists.unsorted

    @property
    def timers(self) -> list[tuple[float, str]]:
        return self.timer_queue.heap

    @property
    def later(self) -> list[tuple[float, str]]:
        return self.timer_queue.later

    # -- records --------------------------------------------------------------------------

    def _count_in_region(self, owner: str, region: str, n: int) -> None:
        """``n`` more (or fewer) of ``owner``'s queued workloads or movers in ``region``."""
        regions = self.owner_regions.get(owner)
        if regions is None:
            regions = self.owner_regions[owner] = Counter()
        left = regions.get(region, 0) + n
        if left > 0:
            regions[region] = left
        else:
            regions.pop(region, None)

    def _enqueue(self, w: Queued) -> None:
        """Queue ``w`` (in place of any record of its id), with its timers."""
        if w.id in self.queue or w.id in self.running:
            self._forget(w.id)
        self.queue[w.id] = w
        self.by_region.setdefault(w.region, {})[w.id] = w
        self._count_in_region(w.owner, w.region, 1)
        self._mark_dirty(w.region, w.id)
        later = self.timer_queue.later  # onto the heap at the next cycle, in one go (a first cycle submits the queue)
        if w.not_before > 0:  # it may be backing off: it takes its turn when its timer ends (as if absent till then)
            self.backing.add(w.id)
            later.append((w.not_before, w.id))
        else:
            self._take_turn(w)
        if w.fallback:
            later.append((w.queued_since + w.fallback_after_s, w.id))
        later.append((starving_from(w.queued_since, self.policy.starvation_after_s), w.id))

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
        queue, by_region, backing, dirty = self.queue, self.by_region, self.backing, self.dirty
        later = self.timer_queue.later
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
            regions[region] = regions.get(region, 0) + 1  # _count_in_region(owner, region, 1)
            if region not in dirty or region in self.decided:
                self._mark_dirty(region, id)
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
            if now - w.queued_since < after:  # (due: starving_from(w.queued_since, after) <= now)
                later.append((starving_from(w.queued_since, after), id))
        for owner, keys in turns.items():
            first = min(keys)
            had = self.owner_keys.setdefault(owner, [])
            behind = bool(had) and had[-1] > first  # some queued before it come after its first new one
            had += keys
            had.sort()
            if behind:  # (the new ones need no turn moved: their submission has them decided anyway)
                self._move_turns(owner, above=first)

    def _take_turn(self, w: Queued) -> None:
        """``w`` counts in its owner's turns (one more queued before its owner's later ones)."""
        bisect.insort(self.owner_keys.setdefault(w.owner, []), (w.queued_since, w.id))
        self._move_turns(w.owner, above=(w.queued_since, w.id))

    def _mark_dirty(self, region: str, id: str) -> None:
        """The next cycle looks at ``region``, and decides ``id`` in it again."""
        self.dirty.add(region)
        if region in self.decided and region not in self.whole:  # a region decided whole needs no list
            self.must.setdefault(region, set()).add(id)

    def _record_running(self, r: Running, *, turns: bool = True) -> None:
        """Record ``r`` as running; ``turns`` False: the caller accounts for the turns it changes."""
        was = self.running.get(r.id)
        turns = turns and (was is None or was.owner != r.owner)  # a record replaced: the same count
        self._forget(r.id, turns=turns)
        self.running[r.id] = r
        self.owner_running[r.owner] += 1
        if r.on_fallback and not r.moving:
            self.movers.setdefault(r.region, {})[r.id] = r
            for entry in preferred_over(r):
                self.prefers.setdefault((r.region, entry), set()).add(r.id)
            self._count_in_region(r.owner, r.region, 1)
        self._count_use(r, 1)
        self.dirty.add(r.region)
        if turns:
            self._move_turns(r.owner, below=HIGH)  # one more running: every queued one of its owner

    def _forget(self, id: str, *, turns: bool = True) -> None:
        """Forget the queued or running record ``id`` (its replicas stay)."""
        w = self.queue.pop(id, None)
        if w is not None:
            del self.by_region[w.region][id]
            self._count_in_region(w.owner, w.region, -1)
            self.lists.remove(w)
            self.standing_decisions.withdraw(w.region, id)
            self.dirty.add(w.region)
            if id in self.backing:
                self.backing.discard(id)
            else:
                keys = self.owner_keys[w.owner]
                del keys[bisect.bisect_left(keys, (w.queued_since, w.id))]
                if turns:
                    self._move_turns(w.owner, above=(w.queued_since, w.id))
        r = self.running.pop(id, None)
        if r is not None:
            self.owner_running[r.owner] -= 1
            if self.movers.get(r.region, {}).pop(id, None) is not None:
                for entry in preferred_over(r):
                    self.prefers[(r.region, entry)].discard(id)
                self._count_in_region(r.owner, r.region, -1)
            self.standing_decisions.withdraw(r.region, id)
            self._count_use(r, -1)
            self.dirty.add(r.region)
            if turns:
                self._move_turns(r.owner, below=HIGH)

    def _move_turns(self, owner: str, below: Key = LOW, above: Key = HIGH) -> None:
        """The owner's queued workloads with a key < ``below`` or > ``above`` change turn."""
        lo, hi = self.turns.get(owner, (LOW, HIGH))
        self.turns[owner] = (below if below > lo else lo, above if above < hi else hi)

    def _count_use(self, r: Running, sign: int) -> None:
        """Count ``r``'s class in (1) or out (-1) of its owner's quota use."""
        cls = self.catalog.get(r.placed_class)
        if cls is not None:
            use = self.use.setdefault(r.owner, [0.0, 0.0])
            gpus, cpu = share(cls)
            use[0] += sign * gpus
            use[1] += sign * cpu
            if self.quota_of(r.owner) is not None:
                self.touched.add(r.owner)

    def _hold_replica(self, p: Placed, sign: int) -> None:
        """Replica ``p`` takes (1) or frees (-1) its capacity, and is booked so."""
        if not self._book_replica(p, sign):
            return  # not held: nothing to free
        at, cls = self.cap.index.get(p.node), self.catalog.get(p.cls)
        if at is not None and cls is not None:
            self.cap.change(at, cls, sign)
            self.dirty.add(self.cap.nodes[at].region)

    def _book_replica(self, p: Placed, sign: int) -> bool:
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

    def _replace_node(self, name: str, node: Node | None) -> None:
        """Node ``name`` leaves (``node`` None) or is replaced by ``node``, with the replicas booked on it."""
        at = self.cap.index.get(name)
        if at is not None:
            self._redecide_whole(self.cap.nodes[at].region)
            self.cap.remove_node(name)
        if node is not None:
            classes = [c for p in self.on_node.get(name, []) if (c := self.catalog.get(p.cls)) is not None]
            self.cap.add_node(node, classes)
            self._redecide_whole(node.region)

    def _redecide_whole(self, region: str) -> None:
        """Re-decide ``region`` whole next cycle (what a class could ever fit on changed)."""
        self.dirty.add(region)
        self.whole.add(region)

    def apply(self, event: Event) -> None:
        """Take in one change."""
        match event:
            case Submitted(w):
                self._enqueue(w)
            case Started(r):
                self._record_running(r)
            case Stopped(id):
                self._forget(id)
                for p in list(self.replicas.get(id, [])):
                    self._hold_replica(p, -1)
            case ReplicaPlaced(p):
                self._hold_replica(p, 1)
            case ReplicaEnded(p):
                self._hold_replica(p, -1)
            case NodeAdded(node):
                self._replace_node(node.name, node)
            case NodeRemoved(name):
                self._replace_node(name, None)
            case OwnerHeld(owner, gpus, cpu):
                self.use[owner] = [gpus, cpu]
                if self.quota_of(owner) is not None:
                    self.touched.add(owner)
            case QuotaChanged(owner, quota):
                if owner is None:
                    self.default_quota = quota
                    for region in self._all_regions():
                        self._redecide_whole(region)
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
        return self.cap.regions | set(self.by_region) | set(self.movers) | set(self.standing_decisions.by_region)

    def quota_of(self, owner: str) -> RunningQuotas | None:
        """``owner``'s running quotas (None: it has none)."""
        return self.quota_by_owner.get(owner, self.default_quota)
