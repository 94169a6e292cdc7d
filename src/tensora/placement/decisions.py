"""What admission decides, as values: the workloads it reads (``Queued``, ``Running``), each class it tried for
one of them (``Attempt``, with its ``Outcome``), and the decisions (``Place``, ``Wait``, ``Promote``,
``RestartAvailable``), whose human reasons are rendered from their attempts (``render_*``), never written by hand
at a call site.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

from tensora.placement.catalog import CPU_WORD
from tensora.placement.kinds import WorkloadKind
from tensora.units import format_clock, format_duration, format_memory


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
    NONE_IN_REGION = "none in this region"
    OWNER_QUOTA = "owner quota"


@dataclass(frozen=True, slots=True)
class Attempt:
    """One class tried for one workload, and what came of it.

    ``entry`` is the fallback-list entry it came from (``"cpu"`` for a CPU class chosen
    for the word ``cpu``); None for the requested class. ``free``/``need`` are in
    ``unit``, the resource that is short (:data:`SHORT_UNITS`): GPUs of the class's model, vCPUs,
    memory in bytes, or nodes' pods (the replicas they can hold); where none is short in the region, only spread
    over its nodes, the class's headline one (GPUs, or vCPUs for CPU classes).
    """

    cls: str
    outcome: Outcome
    free: float = 0
    need: float = 0
    unit: str = ""
    entry: str | None = None
    detail: str = ""



SHORT_UNITS = ("GPU", "vCPU", "memory", "pods")
"""The resources a class needs that a region can be short of, in the order a reason names the first short one."""

WAITED_FOR_ROOM = (Outcome.NO_CAPACITY, Outcome.NO_NODE, Outcome.NONE_IN_REGION)
"""A requested class failed for want of room: the workload counts as one of that class's waiting requesters."""


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


# -- reasons, rendered from attempts ---------------------------------------------------


def _free_text(a: Attempt) -> str:
    """``0 GPU free, 1 needed``, ``3 vCPU free, 4 needed``, ``1.5Gi memory free, 8Gi needed``,
    ``0 pods free, 1 needed``."""
    if a.unit == "memory":
        return f"{format_memory(int(a.free))} memory free, {format_memory(int(a.need))} needed"
    return f"{a.free:g} {a.unit} free, {a.need:g} needed" if a.unit else ""


def none_in_region(cls: str) -> str:
    """A class the region has none of at all (no node of its GPU model): waiting is not for a busy class."""
    return f"this region has no {cls} (0 of 0); it waits until one is added"


def none_in_region_warning(cls: str, fallback: Sequence[str]) -> str:
    """What a workload asking for a class its region has none of is told at create."""
    if not fallback:
        return none_in_region(cls) + ", or add a fallback"
    return none_in_region(cls) + f", or runs on its fallback ({', '.join(fallback)}) meanwhile"


def shortage(a: Attempt) -> str:
    """Why a class found full has no room, with the figures of what is short: ``1.5Gi memory free, 8Gi needed``,
    ``no single node has room; 4 vCPU free, 2 needed``, ``this region has none``, ``no node here is big enough
    for it`` (the catalog says it too)."""
    if a.outcome is Outcome.NO_NODE:
        return "no node here is big enough for it"
    if a.outcome is Outcome.NONE_IN_REGION:
        return "this region has none"
    if a.free >= a.need:
        return f"no single node has room; {_free_text(a)}"
    return _free_text(a)


def _failure(a: Attempt) -> str:
    if a.outcome is Outcome.OWNER_QUOTA:
        return f"{a.cls} ({a.detail})"
    if a.outcome in WAITED_FOR_ROOM:
        return f"{a.cls} ({shortage(a)})"
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
    elif head.outcome is Outcome.NONE_IN_REGION:
        text = none_in_region(head.cls)
        if not wt.workload.fallback:
            return text + ", or add a fallback"
    else:
        text = f"waiting for {head.cls} ({shortage(head)})"
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
