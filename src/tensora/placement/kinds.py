"""The words the control plane speaks: what a workload is, the states it and its replicas pass
through, a replica's role, and how one replica slot of a workload is named.

String enums (``StrEnum``), so a member equals the text stored in the database and sent over the
API (``WorkloadState.QUEUED == "queued"``): rows, JSON bodies and the gateway's routes are unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class WorkloadKind(StrEnum):
    NOTEBOOK = "notebook"
    VM = "vm"
    ENDPOINT = "endpoint"


class WorkloadState(StrEnum):
    """``queued -> starting -> running -> stopping -> stopped``, plus ``failed``."""

    QUEUED = "queued"
    STARTING = "starting"
    RUNNING = "running"
    STOPPING = "stopping"
    STOPPED = "stopped"
    FAILED = "failed"


class ReplicaState(StrEnum):
    STARTING = "starting"
    RUNNING = "running"
    STOPPING = "stopping"
    STOPPED = "stopped"
    FAILED = "failed"


HOLDING: tuple[ReplicaState, ...] = (ReplicaState.STARTING, ReplicaState.RUNNING, ReplicaState.STOPPING)
"""Replica states that hold capacity (the store's "active" replicas)."""


class ReplicaRole(StrEnum):
    """``primary`` serves (the gateway routes to primaries); ``candidate`` is a move back being started;
    ``draining`` is the replica a move replaced: out of the routes, serving its requests in flight."""

    PRIMARY = "primary"
    CANDIDATE = "candidate"
    DRAINING = "draining"


@dataclass(frozen=True, slots=True, order=True)
class SlotRef:
    """One replica slot of a workload (an endpoint has ``replicas`` slots; a notebook or VM one, 0).

    Written ``wid/slot`` where it is stored or sent (admission's workload ids): ``str`` and ``parse``
    convert, so the text stays what it was.
    """

    workload_id: str
    slot: int = 0

    def __str__(self) -> str:
        return f"{self.workload_id}/{self.slot}"

    @classmethod
    def parse(cls, text: str) -> SlotRef:
        """``"wl_1/2"`` -> ``SlotRef("wl_1", 2)``; a text without ``/<number>`` is a ValueError."""
        wid, sep, slot = text.rpartition("/")
        if not sep or not wid or not slot.isdigit():
            raise ValueError(f"not a replica slot: {text!r} (expected <workload id>/<slot>)")
        return cls(wid, int(slot))
