"""Trying classes for one workload: the entries of a list expanded to concrete classes (the word ``cpu`` to
the CPU classes that fit), each checked (held for its requesters, the model's size, the owner's quota, room) and
recorded as an :class:`~tensora.placement.decisions.Attempt`; the first that fits is taken.

Every pass of a cycle tries through one :class:`TryContext`: the capacity it takes from, what it learnt so far
(classes found full, the word ``cpu`` expanded, the attempts many workloads share) and the knobs.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import TypeGuard

from tensora.placement.capacity import Capacity
from tensora.placement.catalog import CPU_WORD, ComputeClass, entry_classes
from tensora.placement.decisions import Attempt, Outcome, Queued, Running
from tensora.placement.kinds import WorkloadKind
from tensora.placement.owner_quotas import Ledger
from tensora.placement.policy import Policy
from tensora.units import format_memory, format_params


class SharedAttempts:
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
        """``cls`` has no room in ``region`` (``NONE_IN_REGION``: no node there has its GPU model at all;
        ``NO_NODE``: no node there could ever host it)."""
        key = (region, cls.name, entry)
        made = self.made.get(key)
        if made is not None:
            if made.outcome is Outcome.NO_NODE or made.outcome is Outcome.NONE_IN_REGION:
                return made
            if made.free == self.cap.amount(region, cls, made.unit):  # (a wait's figures: Recount's, at the end)
                return made
        if self.cap.none_in_region(region, cls):
            made = Attempt(cls.name, Outcome.NONE_IN_REGION, 0, cls.gpu_count, "GPU", entry)
        elif self.cap.unhostable(region, cls) or self.cap.too_small(region, cls):
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
            made = self.lists[key] = (head, (head, *not_yet_tried(fallback)))
        return made[1]

    def held(self, region: str, cls: str, entry: str, n: int) -> Attempt:
        """``cls`` is held from fallbacks for its ``n`` requesters waiting."""
        key = (region, cls, entry, n)
        made = self.held_for.get(key)
        if made is None:
            made = self.held_for[key] = Attempt(cls, Outcome.HELD_FOR_REQUESTERS, entry=entry, detail=f"{n} waiting")
        return made


_NOT_YET: dict[tuple[str, ...], tuple[Attempt, ...]] = {}


def not_yet_tried(fallback: tuple[str, ...]) -> tuple[Attempt, ...]:
    """A fallback list not tried yet, as attempts: shared (attempts are values, and a fleet has a handful of
    lists; the first 4,096 seen are kept)."""
    found = _NOT_YET.get(fallback)
    if found is None:
        found = tuple(Attempt(entry, Outcome.NOT_ELIGIBLE_YET, entry=entry) for entry in fallback)
        if len(_NOT_YET) < 4096:
            _NOT_YET[fallback] = found
    return found



def preferred_over(r: Running) -> tuple[str, ...]:
    """The requested class and the list entries before the one ``r`` is placed on."""
    if r.placed_class in r.fallback:
        return (r.gpu_class, *r.fallback[: r.fallback.index(r.placed_class)])
    if CPU_WORD in r.fallback:  # placed through the word "cpu"
        return (r.gpu_class, *r.fallback[: r.fallback.index(CPU_WORD)])
    return (r.gpu_class,)


@dataclass(slots=True)
class TryContext:
    """What every list tried in one cycle shares: the capacity taken from, the requesters waiting for each
    class (by region and class), the classes found full (capacity only shrinks within a cycle), the word ``cpu``
    as expanded so far (by region, memory needed and class asked), the attempts many workloads make alike, the
    knobs and the owners' quota ledger."""

    cap: Capacity
    waiting_for: dict[tuple[str, str], int]
    full: set[tuple[str, str]]
    cpu_expanded: dict[tuple[str, int, str], list[ComputeClass] | Attempt]
    shared: SharedAttempts
    policy: Policy
    ledger: Ledger


def expand_entry(ctx: TryContext, entry: str, w: Queued) -> list[ComputeClass] | Attempt:
    """The concrete classes an entry stands for, in the order to try them, or why none (the word ``cpu`` is
    expanded once per cycle for a region, the memory needed and the class asked)."""
    if entry != CPU_WORD:
        cls = ctx.cap.catalog.get(entry)
        return [cls] if cls is not None else Attempt(entry, Outcome.UNKNOWN_CLASS, entry=entry)
    need_mem = ctx.policy.cpu_memory_needed(w.model_bytes) if w.kind == WorkloadKind.ENDPOINT else 0
    key = (w.region, need_mem, w.gpu_class)
    found = ctx.cpu_expanded.get(key)
    if found is None:
        found = ctx.cpu_expanded[key] = cpu_classes_for(w, need_mem, ctx.cap)
    return found


def cpu_classes_for(w: Queued, need_mem: int, cap: Capacity) -> list[ComputeClass] | Attempt:
    """The word ``cpu``: the CPU classes big enough for the workload, nearest to what it asked for first."""
    catalog = cap.catalog
    fitting = [c for c in entry_classes(CPU_WORD, catalog) if c.memory >= need_mem]
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


def try_list(
    ctx: TryContext,
    w: Queued,
    entries: Sequence[str],
    attempts: list[Attempt],
    *,
    take: bool,
    skip: Collection[str] = (),
    replaces: ComputeClass | None = None,
) -> tuple[ComputeClass, int] | None:
    """Try ``entries`` in order; record an attempt for each class tried; take the first fit (``take`` False:
    only find it)."""
    cap, policy, ledger, shared = ctx.cap, ctx.policy, ctx.ledger, ctx.shared
    region = w.region
    for entry in entries:
        expanded = expand_entry(ctx, entry, w)
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
            outcome = _eligible(cls, w, entry, ctx.waiting_for.get(key), shared, policy)
            if outcome is None and ledger.quotas is not None:
                outcome = ledger.over(w.owner, cls, entry, replaces)
            if outcome is not None:
                attempts.append(outcome)
                continue
            if key in ctx.full or (cls.gpu_model is None and cap.unhostable(region, cls)):
                attempts.append(shared.full(region, cls, entry))
                continue
            node = cap.find(region, cls)
            if node is None:
                ctx.full.add(key)
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


def _eligible(cls: ComputeClass, w: Queued, entry: str, n: int | None, shared: SharedAttempts,
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

