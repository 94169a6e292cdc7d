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

The parts, each its own module: the records and decisions with their reasons (``decisions``), the knobs
(``policy``), the quota ledger (``owner_quotas``), trying a list of classes for one workload (``attempts``) and a
wait's figures at the end of a cycle (``recount``). This module holds the passes, and names the parts' public
values for its callers.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterable, Mapping, Sequence
from operator import attrgetter, itemgetter
from typing import cast

from tensora.placement.attempts import (
    SharedAttempts,
    TryContext,
    model_over_cpu_limit,
    preferred_over,
    try_list,
)
from tensora.placement.capacity import Capacity
from tensora.placement.catalog import CPU_WORD, ComputeClass
from tensora.placement.decisions import (
    WAITED_FOR_ROOM,
    Attempt,
    Decision,
    Outcome,
    Place,
    Promote,
    Queued,
    RestartAvailable,
    Running,
    Wait,
    render_place,
    render_promote,
    render_unavailable,
    render_wait,
)
from tensora.placement.kinds import WorkloadKind
from tensora.placement.owner_quotas import Ledger, OwnerQuotas, share
from tensora.placement.policy import Policy
from tensora.placement.recount import Recount

__all__ = [  # the records, decisions, quotas and knobs are admission's vocabulary: its callers import them here
    "Attempt", "Decision", "Ledger", "Outcome", "OwnerQuotas", "Place", "Policy", "Promote", "Queued", "Recount",
    "RestartAvailable", "Running", "Wait", "collector_paused", "decide", "model_over_cpu_limit", "preferred_over",
    "render_place", "render_promote", "render_unavailable", "render_wait", "run_cycle", "share",
]


_Waiting = tuple[int, Queued, Sequence[Attempt], float | None]
"""A wait of a cycle, built at its end (its figures are the cycle's last): its place in the decisions, the
workload, its attempts, when its fallback list may be tried."""

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
    object of the process each time its oldest generation is due, several times in a first cycle over a
    large queue, for nothing. Reference counting frees what the cycle drops either way; what it keeps is walked
    once, by the first collection after. The gateway does the same for its start-up
    (``tensora.gateway.server.quiet_gc``). A class, not a ``contextmanager``: it is entered once per cycle, and a
    generator's setup would cost more than a small cycle."""

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
    out: list[Decision | None] = [None] * len(ordered)  # in ordered's order; a wait's slot is filled last
    waits: list[_Waiting] = []
    shared = SharedAttempts(cap)
    ctx = TryContext(cap, waiting_for, full, {}, shared, policy, ledger)
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
        result = try_list(ctx, w, w.fallback, tried, take=True, skip=(w.gpu_class,))
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
        result = try_list(ctx, as_queued, targets, attempts, take=is_endpoint, skip={r.placed_class},
                          replaces=cap.catalog.get(r.placed_class))
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
        if d.attempts[0].outcome in WAITED_FOR_ROOM and waiting_for.get(key):
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
    those of when it was tried. ``try_list`` reads nothing else of a workload; quota use grows with each
    place, so where quotas count the owner is part of it and a place forgets the rest. ``modelled``: an
    endpoint whose list names a CPU class or the word ``cpu`` (only there does its model count)."""
    return (head.cls, head.outcome, w.region, w.fallback, w.kind,
            w.model_params if modelled else None, w.model_bytes if modelled else None, w.owner if owned else "")


def _on_cpu(entries: tuple[str, ...], classes: Mapping[str, ComputeClass]) -> bool:
    """Whether a fallback list names the word ``cpu`` or a CPU class."""
    return any(entry == CPU_WORD or ((c := classes.get(entry)) is not None and c.is_cpu) for entry in entries)


def _fit(free: float, cls: ComputeClass) -> Attempt:
    """A requested class that fit, with ``free`` left after it: ``cap.free``'s figures with the one placed
    counted back, made without a ``Free`` (one per placement: a first cycle makes one for most of its queue)."""
    if cls.gpu_model is None:
        return Attempt(cls.name, Outcome.FIT, free + cls.cpu, cls.cpu, "vCPU")
    return Attempt(cls.name, Outcome.FIT, free + cls.gpu_count, cls.gpu_count, "GPU")



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
