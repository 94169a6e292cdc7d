"""The placement decision, as a pure function.

``decide(queue, capacity, running, now, policy)`` returns one decision per queued
workload (``Place`` or ``Wait``) followed by ``Promote`` (endpoints moving back) and
``RestartAvailable`` (notebooks and VMs that could be restarted on their preferred
class). No I/O, no clock reads, no exceptions for "does not fit".

The passes, in order (each is why the next cannot starve it):

1. **Requested class.** Every queued workload tries the class it asked for, in
   priority order. A workload that does not fit does not block those behind it.
   A queue head that has waited ``starvation_after_s`` and still does not fit holds
   the node where it would fit soonest, so later, smaller workloads cannot keep
   taking that node from it forever.
2. **Fallback.** Workloads still waiting whose timer has run out
   (``now >= queued_since + fallback_after_s``) try their ``fallback`` list in order.
   A class still wanted by a waiting requester of that class is not given away.
3. **Move back.** Endpoints running on a fallback class get a ``Promote`` to their
   requested class (or an earlier entry of their list) when it has capacity no
   waiting requester wants. Notebooks and VMs never move; they get
   ``RestartAvailable`` instead, which takes no capacity.

Running quotas (``OwnerQuotas``, input like the rest): a workload that would take its owner past
``running_gpus`` (GPUs of GPU classes) or ``running_cpu`` (vCPUs of CPU classes: a GPU class's host vCPUs
come with its GPUs, which ``running_gpus`` already bounds) is not placed on that class, and waits with
``owner quota: 2 of 2 GPUs in use`` if no other class of its list fits. It neither holds a node (pass 1) nor
holds its class against fallbacks, so it never keeps another owner waiting. A GPU class over quota may still
fall back to a CPU class within ``running_cpu``. A move back replaces a replica: only what it adds counts.

A wait's figures are those at the end of the cycle, after its places and promotes: ``waiting for
l40s-48gb (0 GPU free, 1 needed)`` says what anyone reading it finds, even when the GPU was free at the
moment the wait was tried and a later, smaller workload took it (:class:`Recount`).

Priority order: with ``owner_fairness`` (the default, because a free cloud has no
price to ration it), owners take turns: a workload's rank is how many workloads its
owner already runs plus how many of its owner's are queued before it; then oldest
first (``queued_since``), then id. Without it, plain FIFO by ``queued_since``.
"""

from __future__ import annotations

import gc
import math
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from operator import attrgetter, itemgetter
from typing import TypeGuard, cast

from tensora.placement.capacity import Capacity
from tensora.placement.catalog import CPU_WORD, Catalog, ComputeClass
from tensora.placement.kinds import WorkloadKind
from tensora.placement.quotas import Quotas
from tensora.units import GIB, format_clock, format_duration, format_memory, format_params


@dataclass(frozen=True, slots=True)
class Queued:
    """A workload waiting for placement. ``fallback`` holds class names and/or ``cpu``."""

    id: str
    kind: WorkloadKind
    gpu_class: str
    owner: str = "default"
    region: str = "local"
    fallback: tuple[str, ...] = ()
    fallback_after_s: float = 0.0
    queued_since: float = 0.0
    model_params: int | None = None
    model_bytes: int | None = None
    not_before: float = 0.0
    """Its crash-loop back-off: admission leaves it alone (no decision at all) until this moment."""


@dataclass(frozen=True, slots=True)
class Running:
    """A placed workload. ``moving`` is set while a move back is already under way."""

    id: str
    kind: WorkloadKind
    gpu_class: str
    placed_class: str
    node: str
    owner: str = "default"
    region: str = "local"
    fallback: tuple[str, ...] = ()
    model_params: int | None = None
    model_bytes: int | None = None
    moving: bool = False

    @property
    def on_fallback(self) -> bool:
        return self.placed_class != self.gpu_class


class Outcome(StrEnum):
    FIT = "fit"
    NO_CAPACITY = "no capacity"
    NOT_ELIGIBLE_YET = "not eligible yet"
    MODEL_TOO_LARGE = "model too large"
    TOO_SMALL = "too small for the model"
    HELD_FOR_REQUESTERS = "held for its requesters"
    UNKNOWN_CLASS = "unknown class"
    NO_NODE = "no node is big enough"
    OWNER_QUOTA = "owner quota"


@dataclass(frozen=True, slots=True)
class Attempt:
    """One class tried for one workload, and what came of it.

    ``entry`` is the fallback-list entry it came from (``"cpu"`` for a CPU class chosen
    for the word ``cpu``); None for the requested class. ``free``/``need`` are in
    ``unit``: GPUs of the class's model, or vCPUs for CPU classes.
    """

    cls: str
    outcome: Outcome
    free: float = 0
    need: float = 0
    unit: str = ""
    entry: str | None = None
    detail: str = ""


@dataclass(frozen=True, slots=True)
class Policy:
    """Knobs of admission. ``cpu_param_limit``: endpoints above it never go on CPU.

    ``timer_slack_s``: how late a cycle may notice a fallback timer (a tick and the cycle
    itself). A fallback placement within it of the timer says the policy's wait
    (``unavailable for 10m``), not the policy plus the seconds the loop took to look.
    """

    cpu_param_limit: float = 8.5e9
    cpu_memory_factor: float = 1.2
    cpu_memory_overhead: int = 2 * GIB
    starvation_after_s: float = 300.0
    owner_fairness: bool = True
    timer_slack_s: float = 5.0

    def cpu_memory_needed(self, model_bytes: int | None) -> int:
        """Host memory an endpoint's model needs on a CPU class (weights, KV cache, runtime)."""
        if not model_bytes:
            return 0
        return int(model_bytes * self.cpu_memory_factor) + self.cpu_memory_overhead


@dataclass(frozen=True, slots=True)
class OwnerQuotas:
    """Each owner's running quotas: ``by_owner``, else ``default`` (None: no quota for it). ``held``: what
    each owner's replicas hold now, as (GPUs, vCPUs of CPU classes), starting and stopping ones too; None:
    what ``running`` holds (enough for a caller with no starting or stopping replicas)."""

    default: Quotas | None = None
    by_owner: Mapping[str, Quotas] = field(default_factory=dict)
    held: Mapping[str, tuple[float, float]] | None = None


def share(cls: ComputeClass) -> tuple[float, float]:
    """What one replica of ``cls`` counts against its owner's quotas: (GPUs, vCPUs of a CPU class)."""
    return (0.0, cls.cpu) if cls.is_cpu else (float(cls.gpu_count), 0.0)


class Ledger:
    """What each owner holds as this cycle's decisions are made, checked against its quotas."""

    def __init__(self, quotas: OwnerQuotas | None, running: Sequence[Running], catalog: Catalog) -> None:
        self.quotas = quotas
        self.use: dict[str, list[float]] = {}
        if quotas is None:
            return
        if quotas.held is not None:
            self.use = {o: list(h) for o, h in quotas.held.items()}
            return
        for r in running:
            cls = catalog.get(r.placed_class)
            if cls is not None:
                self.add(r.owner, cls)

    def over(self, owner: str, cls: ComputeClass, entry: str | None = None,
             replaces: ComputeClass | None = None) -> Attempt | None:
        """Why ``cls`` would take ``owner`` past a quota (None: it would not)."""
        if self.quotas is None:
            return None
        quota = self.quotas.by_owner.get(owner, self.quotas.default)
        if quota is None:
            return None
        use = self.use.get(owner, [0.0, 0.0])
        old = share(replaces) if replaces is not None else (0.0, 0.0)
        for i, (need, limit, unit) in enumerate(zip(share(cls), (quota.running_gpus, quota.running_cpu),
                                                    ("GPU", "vCPU"), strict=True)):
            if need > old[i] and use[i] - old[i] + need > limit:
                return Attempt(cls.name, Outcome.OWNER_QUOTA, use[i], need, unit, entry,
                               _quota_text(use[i], limit, need, unit))
        return None

    def recount(self, owner: str, a: Attempt) -> Attempt:
        """An ``OWNER_QUOTA`` attempt with the owner's use now."""
        quota = self.quotas.by_owner.get(owner, self.quotas.default) if self.quotas is not None else None
        if quota is None:
            return a
        i = 0 if a.unit == "GPU" else 1
        limit = (quota.running_gpus, quota.running_cpu)[i]
        used = self.use.get(owner, [0.0, 0.0])[i]
        return Attempt(a.cls, a.outcome, used, a.need, a.unit, a.entry, _quota_text(used, limit, a.need, a.unit))

    def add(self, owner: str, cls: ComputeClass, replaces: ComputeClass | None = None) -> None:
        if self.quotas is None:
            return
        use = self.use.setdefault(owner, [0.0, 0.0])
        old = share(replaces) if replaces is not None else (0.0, 0.0)
        for i, need in enumerate(share(cls)):
            use[i] += need - old[i]


def _quota_text(used: float, limit: float, need: float, unit: str) -> str:
    """``owner quota: 2 of 2 GPUs in use``; ``owner quota: 30 of 32 vCPUs in use, 4 needed`` when some is left."""
    if limit == 0:
        return f"owner quota: no {unit}s allowed"
    text = f"owner quota: {used:g} of {limit:g} {unit}{'' if limit == 1 else 's'} in use"
    return text + (f", {need:g} needed" if used < limit else "")


@dataclass(frozen=True, slots=True)
class Place:
    """Start ``workload`` on ``cls`` at ``node``. ``slack_s``: the policy's ``timer_slack_s``."""

    workload: Queued
    cls: str
    node: str
    attempts: tuple[Attempt, ...]
    now: float
    slack_s: float = 0.0

    @property
    def fallback(self) -> bool:
        return self.cls != self.workload.gpu_class

    @property
    def reason(self) -> str:
        return render_place(self)


@dataclass(frozen=True, slots=True)
class Wait:
    """Leave ``workload`` queued. ``fallback_eligible_at`` is when its list may be tried."""

    workload: Queued
    attempts: tuple[Attempt, ...]
    fallback_eligible_at: float | None
    now: float

    @property
    def reason(self) -> str:
        return render_wait(self)


@dataclass(frozen=True, slots=True)
class Promote:
    """Start a replica of endpoint ``workload`` on ``to_class`` at ``node``, then move traffic to it."""

    workload: Running
    to_class: str
    node: str
    attempts: tuple[Attempt, ...]

    @property
    def reason(self) -> str:
        return render_promote(self)


@dataclass(frozen=True, slots=True)
class RestartAvailable:
    """A notebook or VM on a fallback class could be restarted on ``to_class`` now (never automatic)."""

    workload: Running
    to_class: str
    attempts: tuple[Attempt, ...]

    @property
    def reason(self) -> str:
        return f"{self.to_class} has capacity again: restart on it to leave {self.workload.placed_class}"


Decision = Place | Wait | Promote | RestartAvailable


_Waiting = tuple[int, Queued, Sequence[Attempt], float | None]
"""A wait of a cycle, built at its end (its figures are the cycle's last): its place in the decisions, the
workload, its attempts, when its fallback list may be tried."""


class _Shared:
    """The attempts that many workloads of a cycle make alike, one object each while its figures stay: a
    class found full (or on no node), by region and entry, while its free figure stays; a class held for its
    requesters, while their count stays. Thousands of waits behind a full class share one, and
    :class:`Recount` recounts it once."""

    def __init__(self, cap: Capacity) -> None:
        self.cap = cap
        self.made: dict[tuple[str, str, str | None], Attempt] = {}
        self.held_for: dict[tuple[str, str, str, int], Attempt] = {}
        self.lists: dict[tuple[str, str, tuple[str, ...]], tuple[Attempt, tuple[Attempt, ...]]] = {}

    def full(self, region: str, cls: ComputeClass, entry: str | None = None) -> Attempt:
        """``cls`` has no room in ``region`` (``NO_NODE``: no node there could ever host it)."""
        key = (region, cls.name, entry)
        made = self.made.get(key)
        if made is not None and (made.outcome is Outcome.NO_NODE or made.free == self.cap.free_amount(region, cls)):
            return made
        if self.cap.unhostable(region, cls):
            made = Attempt(cls.name, Outcome.NO_NODE, entry=entry)
        else:
            free = self.cap.free(region, cls)
            made = Attempt(cls.name, Outcome.NO_CAPACITY, free.free, free.need, free.unit, entry)
        self.made[key] = made
        return made

    def not_tried(self, region: str, head: Attempt, fallback: tuple[str, ...]) -> tuple[Attempt, ...]:
        """The attempts of a wait that found ``head`` and may not try its ``fallback`` yet (``head`` is kept
        with them: the same object, not only an equal one)."""
        key = (region, head.cls, fallback)
        made = self.lists.get(key)
        if made is None or made[0] is not head:
            made = self.lists[key] = (head, (head, *_not_yet(fallback)))
        return made[1]

    def held(self, region: str, cls: str, entry: str, n: int) -> Attempt:
        """``cls`` is held from fallbacks for its ``n`` requesters waiting."""
        key = (region, cls, entry, n)
        made = self.held_for.get(key)
        if made is None:
            made = self.held_for[key] = Attempt(cls, Outcome.HELD_FOR_REQUESTERS, entry=entry, detail=f"{n} waiting")
        return made


_NOT_YET: dict[tuple[str, ...], tuple[Attempt, ...]] = {}


def _not_yet(fallback: tuple[str, ...]) -> tuple[Attempt, ...]:
    """A fallback list not tried yet, as attempts: shared (attempts are values, and a fleet has a handful of
    lists; the first 4,096 seen are kept)."""
    found = _NOT_YET.get(fallback)
    if found is None:
        found = tuple(Attempt(entry, Outcome.NOT_ELIGIBLE_YET, entry=entry) for entry in fallback)
        if len(_NOT_YET) < 4096:
            _NOT_YET[fallback] = found
    return found


# -- the decision ------------------------------------------------------------------


def decide(
    queue: Iterable[Queued],
    capacity: Capacity,
    running: Iterable[Running] = (),
    now: float = 0.0,
    policy: Policy | None = None,
    quotas: OwnerQuotas | None = None,
) -> list[Decision]:
    """Decide placements for one cycle; ``capacity`` is left unchanged (a copy is used)."""
    policy = policy or Policy()
    with collector_paused():
        running = list(running)
        queue = [w for w in queue if w.not_before <= now]  # backing off: as if absent (owner turns too)
        return run_cycle(_priority_order(queue, running, policy), capacity.copy(), running, now, policy, quotas)


class collector_paused:
    """Python's cyclic garbage collector off for one cycle, then as it was.

    A cycle over a large queue allocates hundreds of thousands of objects that outlive it (its decisions,
    a kept state's records) and no reference cycle. The collector, triggered by allocations, walks every
    object of the process each time its oldest generation is due: six full walks in the first cycle of
    100,000 queued (bench/admission.py), about a third of its CPU. Reference counting frees what the cycle
    drops either way; what it keeps is walked once, by the first collection after. The gateway does the
    same for its start-up (``tensora.gateway.server.quiet_gc``). A class, not a ``contextmanager``: it is entered
    once per cycle, 11,700 times in the 10k plan, and a generator's setup costs microseconds each time."""

    def __init__(self) -> None:
        self.was = False

    def __enter__(self) -> None:
        self.was = gc.isenabled()
        gc.disable()

    def __exit__(self, *exc: object) -> None:
        if self.was:
            gc.enable()


def run_cycle(
    ordered: Sequence[Queued],
    cap: Capacity,
    running: Sequence[Running],
    now: float,
    policy: Policy,
    quotas: OwnerQuotas | None,
    also_waiting: Mapping[tuple[str, str], int] | None = None,
    counted: dict[tuple[str, str], int] | None = None,
    after_first: Callable[[], None] | None = None,
    movers: Callable[[], Sequence[Running]] | None = None,
) -> list[Decision]:
    """The passes of :func:`decide` over a queue already in priority order, taking from ``cap`` itself.

    Apart so that a state kept across cycles (:mod:`tensora.admission_state`) can run them over the part of
    a queue that could change, with the global order and each owner's ``held`` it keeps itself. ``ordered``
    holds no workload backing off (``not_before`` past ``now``): the caller leaves those out, once.
    ``also_waiting``: requesters left out of ``ordered`` that wait for their class (by region and class);
    they come after every requester of that class in ``ordered``, so they hold no node, but they hold their
    class against fallbacks like the others. ``counted``, when given, receives the requesters waiting for
    each class after the first pass (what held classes from fallbacks); ``after_first`` is called then, when
    ``cap`` holds what is left for fallbacks and move-backs (with the nodes held for queue heads). ``movers``,
    when given, names the running workloads the third pass tries to move back, asked for after the second
    (``running`` is then only what quota use is counted from, where ``quotas.held`` does not say)."""
    ledger = Ledger(quotas, running, cap.catalog)
    waiting_for: dict[tuple[str, str], int] = {}
    full: set[tuple[str, str]] = set()  # (region, class) where find found nothing this cycle
    seen: dict[tuple[str, int, str], list[ComputeClass] | Attempt] = {}  # the word cpu, expanded
    out: list[Decision | None] = [None] * len(ordered)  # in ordered's order; a wait's slot is filled last
    waits: list[_Waiting] = []
    shared = _Shared(cap)
    classes = dict(cap.catalog.items())  # (a dict's own get: asked once per workload)

    # 1. requested class first, for everyone; a workload whose fallback list may not be tried yet is done here
    pending: list[tuple[int, Queued, list[Attempt]]] = []
    for i, w in enumerate(ordered):
        cls = classes.get(w.gpu_class)
        if cls is None:
            head = Attempt(w.gpu_class, Outcome.UNKNOWN_CLASS)
        elif quotas is not None and (over := ledger.over(w.owner, cls)) is not None:
            head = over  # holds no node and no class: its owner's quota, not capacity, keeps it waiting
        else:
            key = (w.region, cls.name)
            node = None if key in full else cap.find(w.region, cls)
            if node is not None:
                cap.take(node, cls)
                if quotas is not None:
                    ledger.add(w.owner, cls)
                attempt = _fit(cap.free_amount(w.region, cls), cls)
                out[i] = Place(w, cls.name, cap.nodes[node].name, (attempt,), now)
                continue
            head = shared.full(w.region, cls)
            full.add(key)  # capacity only shrinks within a cycle: no later workload fits this class here
            if not waiting_for.get(key) and now - w.queued_since >= policy.starvation_after_s:
                cap.hold(w.region, cls)
            waiting_for[key] = waiting_for.get(key, 0) + 1
        if w.fallback and now >= w.queued_since + w.fallback_after_s:
            pending.append((i, w, [head]))
        else:  # its list is not tried (nothing taken): its wait is known now
            waits.append((i, w, shared.not_tried(w.region, head, w.fallback),
                          w.queued_since + w.fallback_after_s if w.fallback else None))

    for key, n in (also_waiting or {}).items():
        waiting_for[key] = waiting_for.get(key, 0) + n
    if counted is not None:
        counted.update(waiting_for)
    if after_first is not None:
        after_first()

    # 2. fallback lists, for those whose timer has run out
    fell_back: list[Place] = []
    in_vain: dict[_Alike, tuple[Attempt, ...]] = {}  # lists tried without a fit (:func:`_alike`)
    on_cpu: dict[tuple[str, ...], bool] = {}  # by fallback list: _on_cpu
    for i, w, tried in pending:
        modelled = False
        if w.kind == WorkloadKind.ENDPOINT:
            found = on_cpu.get(w.fallback)
            if found is None:
                found = on_cpu[w.fallback] = _on_cpu(w.fallback, classes)
            modelled = found
        alike = _alike(tried[0], w, quotas is not None, modelled)
        known = in_vain.get(alike) if REMEMBER_IN_VAIN else None
        if known is not None:  # the same checks over the same figures: the same attempts
            waits.append((i, w, known, w.queued_since + w.fallback_after_s))
            continue
        result = _try_list(cap, w, w.fallback, tried, waiting_for, full, seen, shared, policy, ledger,
                           take=True, skip=(w.gpu_class,))
        if result is None:
            known = in_vain[alike] = tuple(tried)
            waits.append((i, w, known, w.queued_since + w.fallback_after_s))
        else:
            if quotas is not None:
                in_vain.clear()  # the owner's quota use grew: a class under its quota may not be now
            cls, node = result
            place = out[i] = Place(w, cls.name, cap.nodes[node].name, tuple(tried), now, policy.timer_slack_s)
            fell_back.append(place)

    # each owner's quota use as its records will say next cycle: a move back's new replica replaces the old one
    # only when the move ends, so what pass 3 counts is not kept
    use = Ledger(quotas, (), cap.catalog)
    if quotas is not None:
        use.use = {o: list(u) for o, u in ledger.use.items()}

    # 3. move back: endpoints are promoted, notebooks and VMs are offered a restart
    moves: list[Decision] = []
    for r in sorted(movers() if movers is not None else running, key=lambda r: r.id):
        if not r.on_fallback or r.moving:
            continue
        targets = preferred_over(r)
        if not targets:
            continue
        attempts: list[Attempt] = []
        as_queued = Queued(
            r.id, r.kind, r.gpu_class, r.owner, r.region, r.fallback, 0.0, 0.0, r.model_params, r.model_bytes
        )
        is_endpoint = r.kind == WorkloadKind.ENDPOINT
        result = _try_list(cap, as_queued, targets, attempts, waiting_for, full, seen, shared, policy, ledger,
                           take=is_endpoint, skip={r.placed_class}, replaces=cap.catalog.get(r.placed_class))
        if result is None:
            continue
        cls, node = result
        if is_endpoint:
            moves.append(Promote(r, cls.name, cap.nodes[node].name, tuple(attempts)))
        else:
            moves.append(RestartAvailable(r, cls.name, tuple(attempts)))
    # 4. a wait says what holds now: the region's figures after this cycle's places and promotes; a requester
    #    placed on a fallback waits no longer (up to this step it held its class from fallbacks and move-backs)
    for d in fell_back:
        key = (d.workload.region, d.workload.gpu_class)
        if d.attempts[0].outcome in _WAITED and waiting_for.get(key):
            waiting_for[key] -= 1
    recount = Recount(cap, use, waiting_for)
    for i, w, made, eligible_at in waits:
        out[i] = Wait(w, recount.attempts(made, w.region, w.owner), eligible_at, now)
    return [*cast(list[Decision], out), *moves]


REMEMBER_IN_VAIN = True
"""Whether pass 2 keeps the lists tried in vain (:func:`_alike`); a test turns it off to compare with trying every
list. A module variable, not a constant: compiled (``tensora.native``), a constant is inlined."""

_Alike = tuple[str, Outcome, str, tuple[str, ...], WorkloadKind, int | None, int | None, str]
"""What a fallback list's attempts depend on, besides the cycle's figures: its head's class (the class asked)
and outcome, the region, the list, the kind (an endpoint's model), the owner (where quotas count)."""


def _alike(head: Attempt, w: Queued, owned: bool, modelled: bool) -> _Alike:
    """Thousands of workloads behind the same full classes try the same list in vain. Capacity only shrinks
    within a cycle, so a list that found no room finds none later, for the same checks, class by class: the
    same attempts but for their figures, and a wait's figures are the cycle's last (:class:`Recount`), not
    those of when it was tried. ``_try_list`` reads nothing else of a workload; quota use grows with each
    place, so where quotas count the owner is part of it and a place forgets the rest. ``modelled``: an
    endpoint whose list names a CPU class or the word ``cpu`` (only there does its model count)."""
    return (head.cls, head.outcome, w.region, w.fallback, w.kind,
            w.model_params if modelled else None, w.model_bytes if modelled else None, w.owner if owned else "")


def _on_cpu(entries: tuple[str, ...], classes: Mapping[str, ComputeClass]) -> bool:
    """Whether a fallback list names the word ``cpu`` or a CPU class."""
    return any(entry == CPU_WORD or ((c := classes.get(entry)) is not None and c.is_cpu) for entry in entries)


def _fit(free: float, cls: ComputeClass) -> Attempt:
    """A requested class that fit, with ``free`` left after it: ``cap.free``'s figures with the one placed
    counted back, made without a ``Free`` (one per placement, some 50,000 in a first cycle)."""
    if cls.gpu_model is None:
        return Attempt(cls.name, Outcome.FIT, free + cls.cpu, cls.cpu, "vCPU")
    return Attempt(cls.name, Outcome.FIT, free + cls.gpu_count, cls.gpu_count, "GPU")


_WAITED = (Outcome.NO_CAPACITY, Outcome.NO_NODE)
"""A requested class failed for want of room: the workload counts as one of that class's waiting requesters."""


class Recount:
    """A wait's figures as of the end of a cycle: the free GPUs or vCPUs of each class it found full, the
    requesters still waiting for each class held from it, its owner's quota use.

    Within a cycle those figures move as workloads are placed; a wait shows the last of them, so every wait
    of a region (and of an owner) shows the same, and a state kept across cycles
    (:mod:`tensora.placement.admission_state`) can keep its waits and recount them when a figure moves."""

    def __init__(self, cap: Capacity, ledger: Ledger, waiting_for: Mapping[tuple[str, str], int]) -> None:
        self.cap, self.ledger, self.waiting_for = cap, ledger, waiting_for
        self.done: dict[tuple[int, str, str], tuple[Attempt, Attempt]] = {}
        # (a tuple, its region, "") -> (the tuple, recounted; None: it holds an owner's quota, so see owned)
        self.lists: dict[tuple[int, str, str], tuple[tuple[Attempt, ...], tuple[Attempt, ...] | None]] = {}
        self.owned: dict[tuple[int, str, str], tuple[tuple[Attempt, ...], tuple[Attempt, ...]]] = {}

    def wait(self, d: Wait) -> Wait:
        w = d.workload
        attempts = self.attempts(d.attempts, w.region, w.owner)
        return d if attempts == d.attempts else Wait(w, attempts, d.fallback_eligible_at, d.now)

    def attempts(self, attempts: Sequence[Attempt], region: str, owner: str) -> tuple[Attempt, ...]:
        """``attempts`` recounted; a tuple (shared by many waits: :class:`_Shared`) is recounted once per
        region (and owner, if it holds an owner's quota), and kept with its answer so that its id is not
        reused meanwhile."""
        if type(attempts) is not tuple:
            return self._each(attempts, region, owner)
        key = (id(attempts), region, "")
        done = self.lists.get(key)
        if done is None:
            mine = any(a.outcome is Outcome.OWNER_QUOTA for a in attempts)
            done = self.lists[key] = (attempts, None if mine else self._each(attempts, region, owner))
        if done[1] is not None:
            return done[1]
        key = (id(attempts), region, owner)
        owned = self.owned.get(key)
        if owned is None:
            owned = self.owned[key] = (attempts, self._each(attempts, region, owner))
        return owned[1]

    def _each(self, attempts: Sequence[Attempt], region: str, owner: str) -> tuple[Attempt, ...]:
        return tuple([self.attempt(a, region, owner) for a in attempts])

    def attempt(self, a: Attempt, region: str, owner: str) -> Attempt:
        outcome = a.outcome
        if outcome is not Outcome.NO_CAPACITY and outcome is not Outcome.HELD_FOR_REQUESTERS \
                and outcome is not Outcome.OWNER_QUOTA:
            return a
        # by identity: the waits of a cycle share their attempts (:class:`_Shared`), and hashing one by value
        # costs more than recounting it; ``a`` is kept with its answer, so its id is not reused meanwhile
        key = (id(a), region, owner if outcome is Outcome.OWNER_QUOTA else "")
        done = self.done.get(key)
        if done is None:
            done = self.done[key] = (a, self._recount(a, region, owner))
        return done[1]

    def _recount(self, a: Attempt, region: str, owner: str) -> Attempt:
        # Attempt(...) rather than dataclasses.replace: a cycle recounts every wait it decides, and replace
        # costs about four times as much
        if a.outcome is Outcome.HELD_FOR_REQUESTERS:
            detail = f"{self.waiting_for.get((region, a.cls), 0)} waiting"
            return a if detail == a.detail else Attempt(a.cls, a.outcome, a.free, a.need, a.unit, a.entry, detail)
        cls = self.cap.catalog.get(a.cls)
        if cls is None:
            return a
        if a.outcome is Outcome.NO_CAPACITY:
            return Attempt(a.cls, a.outcome, self.cap.free(region, cls).free, a.need, a.unit, a.entry, a.detail)
        return self.ledger.recount(owner, a)


def _priority_order(queue: Iterable[Queued], running: Sequence[Running], policy: Policy) -> list[Queued]:
    items = sorted(queue, key=attrgetter("queued_since", "id"))
    if not policy.owner_fairness:
        return items
    seen: dict[str, int] = {}
    for r in running:
        seen[r.owner] = seen.get(r.owner, 0) + 1
    ranked = []
    for w in items:
        rank = seen.get(w.owner, 0)
        seen[w.owner] = rank + 1
        ranked.append((rank, w))
    ranked.sort(key=itemgetter(0))  # stable: within a rank, still by (queued_since, id)
    return [t[1] for t in ranked]


def preferred_over(r: Running) -> tuple[str, ...]:
    """The requested class and the list entries before the one ``r`` is placed on."""
    if r.placed_class in r.fallback:
        return (r.gpu_class, *r.fallback[: r.fallback.index(r.placed_class)])
    if CPU_WORD in r.fallback:  # placed through the word "cpu"
        return (r.gpu_class, *r.fallback[: r.fallback.index(CPU_WORD)])
    return (r.gpu_class,)


def _expand(entry: str, w: Queued, cap: Capacity, policy: Policy,
            seen: dict[tuple[str, int, str], list[ComputeClass] | Attempt]) -> list[ComputeClass] | Attempt:
    """The concrete classes an entry stands for, in the order to try them, or why none (``seen``: this
    cycle's answers for the word ``cpu``, which depend on the region, the memory needed and the class asked)."""
    catalog = cap.catalog
    if entry != CPU_WORD:
        cls = catalog.get(entry)
        return [cls] if cls is not None else Attempt(entry, Outcome.UNKNOWN_CLASS, entry=entry)
    need_mem = policy.cpu_memory_needed(w.model_bytes) if w.kind == WorkloadKind.ENDPOINT else 0
    key = (w.region, need_mem, w.gpu_class)
    found = seen.get(key)
    if found is None:
        found = seen[key] = _expand_cpu(w, need_mem, cap)
    return found


def _expand_cpu(w: Queued, need_mem: int, cap: Capacity) -> list[ComputeClass] | Attempt:
    """The word ``cpu``: the CPU classes big enough for the workload, nearest to what it asked for first."""
    catalog = cap.catalog
    fitting = [c for c in catalog.cpu_classes if c.memory >= need_mem]
    # only the classes some node here could ever host (a 2-core machine runs none of 4 cores); a region with
    # no node at all keeps them all (unhostable is False there), so its wait still names what it needs
    hostable = [c for c in fitting if not cap.unhostable(w.region, c)]
    if fitting and not hostable:
        return Attempt(CPU_WORD, Outcome.NO_NODE, entry=CPU_WORD)
    fitting = hostable
    requested = catalog.get(w.gpu_class)
    if requested is None or not fitting:
        return fitting
    at_least = [c for c in fitting if c.cpu >= requested.cpu and c.memory >= requested.memory]
    smaller = [c for c in reversed(fitting) if c not in at_least]
    return at_least + smaller


def _try_list(
    cap: Capacity,
    w: Queued,
    entries: Sequence[str],
    attempts: list[Attempt],
    waiting_for: dict[tuple[str, str], int],
    full: set[tuple[str, str]],
    seen: dict[tuple[str, int, str], list[ComputeClass] | Attempt],
    shared: _Shared,
    policy: Policy,
    ledger: Ledger,
    *,
    take: bool,
    skip: Collection[str] = (),
    replaces: ComputeClass | None = None,
) -> tuple[ComputeClass, int] | None:
    """Try ``entries`` in order; record an attempt for each class tried; take the first fit."""
    region = w.region
    for entry in entries:
        expanded = _expand(entry, w, cap, policy, seen)
        if isinstance(expanded, Attempt):
            attempts.append(expanded)
            continue
        if entry == CPU_WORD and w.kind == WorkloadKind.ENDPOINT:
            too_large = _model_too_large(w, policy, entry)
            if too_large is not None:
                attempts.append(too_large)
                continue
            if not expanded:
                need = policy.cpu_memory_needed(w.model_bytes)
                attempts.append(Attempt(CPU_WORD, Outcome.TOO_SMALL, entry=entry,
                                        detail=f"no CPU class has {format_memory(need)}"))
                continue
        for cls in expanded:
            if cls.name in skip:
                continue
            key = (region, cls.name)
            outcome = _eligible(cls, w, entry, waiting_for.get(key), shared, policy)
            if outcome is None and ledger.quotas is not None:
                outcome = ledger.over(w.owner, cls, entry, replaces)
            if outcome is not None:
                attempts.append(outcome)
                continue
            if key in full or (cls.gpu_model is None and cap.unhostable(region, cls)):
                attempts.append(shared.full(region, cls, entry))
                continue
            node = cap.find(region, cls)
            if node is None:
                full.add(key)
                attempts.append(shared.full(region, cls, entry))
                continue
            free = cap.free(w.region, cls)
            attempts.append(Attempt(cls.name, Outcome.FIT, free.free, free.need, free.unit, entry))
            if take:
                cap.take(node, cls)
                ledger.add(w.owner, cls, replaces)
            return cls, node
    return None


def model_over_cpu_limit(params: int | None, policy: Policy) -> TypeGuard[int]:
    """A model (of ``params``) over the CPU parameter limit: for an endpoint, no CPU class (nor the word ``cpu``)
    may serve it."""
    return params is not None and params > policy.cpu_param_limit


def _model_too_large(w: Queued, policy: Policy, entry: str, cls: str = CPU_WORD) -> Attempt | None:
    if model_over_cpu_limit(w.model_params, policy):
        detail = f"{format_params(w.model_params)} params > {format_params(policy.cpu_param_limit)} CPU limit"
        return Attempt(cls, Outcome.MODEL_TOO_LARGE, entry=entry, detail=detail)
    return None


def _eligible(cls: ComputeClass, w: Queued, entry: str, n: int | None, shared: _Shared,
              policy: Policy) -> Attempt | None:
    """Why ``cls`` may not be used as a substitute for ``w`` (None: it may); ``n``: its requesters waiting
    in ``w``'s region."""
    if n:
        return shared.held(w.region, cls.name, entry, n)
    if cls.is_cpu and w.kind == WorkloadKind.ENDPOINT:
        too_large = _model_too_large(w, policy, entry, cls.name)
        if too_large is not None:
            return too_large
        need = policy.cpu_memory_needed(w.model_bytes)
        if cls.memory < need:
            return Attempt(cls.name, Outcome.TOO_SMALL, entry=entry,
                           detail=f"{format_memory(cls.memory)} < {format_memory(need)}")
    return None


# -- reasons, rendered from attempts ---------------------------------------------------


def _free_text(a: Attempt) -> str:
    return f"{a.free:g} {a.unit} free, {a.need:g} needed" if a.unit else ""


def _failure(a: Attempt) -> str:
    if a.outcome is Outcome.OWNER_QUOTA:
        return f"{a.cls} ({a.detail})"
    if a.outcome is Outcome.NO_NODE:
        return f"{a.cls} (no node here is big enough for it)"
    if a.outcome is Outcome.NO_CAPACITY:
        if a.free >= a.need:
            return f"{a.cls} (no single node has room; {_free_text(a)})"
        return f"{a.cls} ({_free_text(a)})"
    detail = f": {a.detail}" if a.detail else ""
    return f"{a.cls} {a.outcome.value}{detail}"


def render_place(p: Place) -> str:
    """``placed on cpu-32c-128g: l40s-48gb unavailable for 10m`` (or just ``placed on X``)."""
    if not p.fallback:
        return f"placed on {p.cls}"
    tried = _failures(p.attempts[1:])
    head = p.attempts[0]
    why = f"({head.detail})" if head.outcome is Outcome.OWNER_QUOTA else render_unavailable(p)
    text = f"placed on {p.cls}: {p.workload.gpu_class} {why}"
    if tried:
        text += "; also tried " + ", ".join(tried)
    return text


def render_unavailable(p: Place) -> str:
    """How long the requested class was unavailable before ``p`` fell back.

    Placed as its timer ran out (within ``slack_s``): the policy's wait, ``unavailable for 10m``,
    or ``unavailable (fallback after 0s)`` for a policy of 0. Later (its fallback classes were
    full too): the real wait, rounded down, never up, so it never claims more than passed.
    """
    after = p.workload.fallback_after_s
    waited = p.now - p.workload.queued_since
    shown = format_duration(after) if waited <= after + p.slack_s else format_duration(math.floor(waited))
    return "unavailable (fallback after 0s)" if shown == "0s" else f"unavailable for {shown}"


def render_wait(wt: Wait) -> str:
    """``waiting for l40s-48gb (0 GPU free, 1 needed); fallback to a100-80gb, cpu from 14:32:10``."""
    head, rest = wt.attempts[0], wt.attempts[1:]
    if head.outcome is Outcome.UNKNOWN_CLASS:
        text = f"waiting: {head.cls} is not in the catalog"
    elif head.outcome is Outcome.OWNER_QUOTA:
        text = f"waiting for {head.cls} ({head.detail})"
    elif head.outcome is Outcome.NO_NODE:
        text = f"waiting for {head.cls}: no node here is big enough for it (a bigger node must join)"
    else:
        text = f"waiting for {head.cls} ({_free_text(head)})"
        if head.free >= head.need:
            text = f"waiting for {head.cls} (no single node has room; {_free_text(head)})"
    if not wt.workload.fallback:
        return text + "; no fallback accepted"
    if rest and all(a.outcome is Outcome.NOT_ELIGIBLE_YET for a in rest):
        assert wt.fallback_eligible_at is not None
        return f"{text}; fallback to {', '.join(wt.workload.fallback)} from {format_clock(wt.fallback_eligible_at)}"
    failures = _failures(rest)
    return f"{text}; fallback tried: {', '.join(failures) if failures else 'nothing usable'}"


def _failures(attempts: Sequence[Attempt]) -> list[str]:
    """One phrase per failed attempt. The CPU classes tried for the word ``cpu`` that had no room
    (or were over the owner's quota) are one phrase, naming the smallest of them (the nearest miss)
    and counting the others."""
    out: list[str] = []
    groups = {o: [a for a in attempts if a.entry == CPU_WORD and a.outcome is o]
              for o in (Outcome.NO_CAPACITY, Outcome.OWNER_QUOTA)}
    for a in attempts:
        if a.outcome is Outcome.FIT:
            continue
        group = groups.get(a.outcome, [])
        if a in group:
            if a is group[0]:
                out.append(_cpu_full(group))
            continue
        out.append(_failure(a))
    return out


def _cpu_full(full: Sequence[Attempt]) -> str:
    """``cpu-2c-8g (1 vCPU free, 2 needed)``, then ``and 4 larger CPU classes`` if more were full."""
    smallest = min(full, key=lambda a: a.need)
    others = [a for a in full if a is not smallest]
    if not others:
        return _failure(smallest)
    size = "larger" if all(a.need > smallest.need for a in others) else "other"
    return f"{_failure(smallest)} and {len(others)} {size} CPU class{'es' if len(others) > 1 else ''}"


def render_promote(p: Promote) -> str:
    return f"moving back to {p.to_class} from {p.workload.placed_class}: {p.to_class} has capacity again"
