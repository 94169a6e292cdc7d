"""What changed, told to a kept admission state (:mod:`tensora.placement.admission_state`) as values."""

from __future__ import annotations

from dataclasses import dataclass

from tensora.placement.capacity import Node, Placed
from tensora.placement.decisions import Place, Queued, Running
from tensora.placement.quotas import RunningQuotas


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
    quota: RunningQuotas | None


@dataclass(frozen=True, slots=True)
class OwnerHeld:
    """What an owner's replicas hold now in every region, as (GPUs, vCPUs of CPU classes), starting and
    stopping ones too: the store's count (``OwnerQuotas.held``), which a running record cannot see. From
    then on the owner's quota use is this figure, plus what this state's own decisions place, until the
    next ``OwnerHeld``. Send it after the other events of a step (they may change the running records)."""

    owner: str
    gpus: float
    cpu: float


Event = (Submitted | Started | Stopped | ReplicaPlaced | ReplicaEnded | NodeAdded | NodeRemoved | QuotaChanged
         | OwnerHeld)


def running_from(p: Place) -> Running:
    """The running record a ``Place`` makes (what the controller stores for it)."""
    w = p.workload
    return Running(w.id, w.kind, w.gpu_class, p.cls, p.node, w.owner, w.region, w.fallback,
                   w.model_params, w.model_bytes)

