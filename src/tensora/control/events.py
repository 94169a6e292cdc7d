"""What the controller records of a workload, as values; ``render`` makes each one's sentence.

Admission renders its reasons from the attempts it recorded (``admission.render_*``); the
controller's own events (a replica ready, failed, drained; a move back done) are rendered the same
way, from values, in one place: a test can table every sentence, and a step that records an event
says what happened, not how to word it.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from tensora.units import format_clock


class EventType(StrEnum):
    """The ``type`` column of an event."""

    TRANSITION = "transition"
    MOVING = "moving"
    MOVED = "moved"
    MOVE_FAILED = "move_failed"
    DRAINED = "drained"
    REPLICA_FAILED = "replica_failed"
    REPLICA_PLACED = "replica_placed"
    RESTART_AVAILABLE = "restart_available"


@dataclass(frozen=True, slots=True)
class Where:
    """A replica's class and node."""

    cls: str
    node: str


@dataclass(frozen=True, slots=True)
class Ready:
    """The workload's first replica is running."""

    at: Where


@dataclass(frozen=True, slots=True)
class AllStopped:
    """A workload asked to stop has no replica left."""


@dataclass(frozen=True, slots=True)
class Drained:
    """A replica a move back replaced had its time for requests in flight; it is stopped now."""

    at: Where


@dataclass(frozen=True, slots=True)
class MoveFailed:
    """A move back's candidate failed; the workload stays where it is."""

    to: str
    why: str
    staying_on: str | None


class Then(StrEnum):
    """What a replica's failure does to its workload."""

    FAIL = "fail"  # a notebook's or VM's only replica: the workload failed
    REPLACE = "replace"  # an endpoint still has another primary: the slot is placed again
    REQUEUE = "requeue"  # an endpoint's only primary: the workload is queued again


@dataclass(frozen=True, slots=True)
class ReplicaFailed:
    at: Where
    why: str
    then: Then


@dataclass(frozen=True, slots=True)
class Moved:
    """A move back's candidate is ready: it is the primary now, ``was`` (classes) drain for ``drain_s``."""

    to: Where
    was: tuple[str, ...]
    drain_s: float


@dataclass(frozen=True, slots=True)
class ReplicaPlaced:
    """An endpoint's further replica (slot > 0) was placed, for admission's ``reason``."""

    slot: int
    reason: str


@dataclass(frozen=True, slots=True)
class BackingOff:
    """Its replicas failed ``count`` times in a row: admission places it again at ``retry_at`` (a
    workload's ``reason`` while it waits; ``control.backoff``)."""

    count: int
    why: str
    retry_at: float


@dataclass(frozen=True, slots=True)
class FailedForGood:
    """A failure retrying cannot fix (the driver said so: a runtime missing, a model or image refused; or
    the class left the catalog): the workload fails at once."""

    why: str


Happened = (Ready | AllStopped | Drained | MoveFailed | ReplicaFailed | Moved | ReplicaPlaced | BackingOff
            | FailedForGood)


def render(e: Happened) -> str:
    """The sentence of an event (stored in ``events.reason``, shown by ``tensora events``)."""
    match e:
        case Ready(at):
            return f"running on {at.cls} at {at.node}"
        case AllStopped():
            return "stopped: all replicas stopped"
        case Drained(at):
            return f"drained: stopping the {at.cls} replica at {at.node}"
        case MoveFailed(to, why, staying_on):
            return f"move back to {to} failed ({why}); staying on {staying_on}"
        case ReplicaFailed(at, why, Then.FAIL):
            return f"failed: replica on {at.cls} at {at.node}: {why}"
        case ReplicaFailed(at, why, Then.REPLACE):
            return f"replica on {at.cls} at {at.node} failed ({why}); replacing it"
        case ReplicaFailed(at, why, _):
            return f"queued: its only replica ({at.cls} at {at.node}) failed: {why}"
        case Moved(to, was, drain_s):
            return (f"moved back to {to.cls}: replica ready at {to.node}, traffic shifted, "
                    f"draining the {', '.join(sorted(set(was))) or 'nothing'} replica "
                    f"({drain_s:g} s for requests in flight)")
        case ReplicaPlaced(slot, reason):
            return f"replica {slot}: {reason}"
        case BackingOff(count, why, retry_at):
            return f"failed {count} time{'s' if count != 1 else ''}: {why}; next try at {format_clock(retry_at)}"
        case FailedForGood(why):
            return f"failed: {why} (retrying cannot fix this)"
    raise AssertionError(e)  # pragma: no cover: the match covers Happened


def event_type(e: Happened) -> EventType:
    """The ``type`` an event is stored with (a transition's events are ``transition``, whatever said it)."""
    match e:
        case Drained():
            return EventType.DRAINED
        case MoveFailed():
            return EventType.MOVE_FAILED
        case ReplicaFailed(then=Then.REPLACE):
            return EventType.REPLICA_FAILED
        case Moved():
            return EventType.MOVED
        case ReplicaPlaced():
            return EventType.REPLICA_PLACED
    return EventType.TRANSITION

