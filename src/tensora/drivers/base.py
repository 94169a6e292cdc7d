"""The one interface to whatever runs replicas: local processes, Kubernetes, or the simulated fleet.

Drivers decide nothing: admission decides, the controller tells a driver to start or
stop a replica on a given node and class, and reads back what it observes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from tensora.placement.capacity import Node
from tensora.placement.kinds import HOLDING, ReplicaState, WorkloadKind


@dataclass(frozen=True, slots=True)
class ReplicaSpec:
    """One replica to start: a workload's instance of ``cls`` on ``node``."""

    id: str
    workload_id: str
    kind: WorkloadKind
    cls: str
    node: str
    model: str | None = None
    image: str | None = None
    """VMs: the disk image to boot, if any."""
    owner: str = ""
    """Whose workload it is (Kubernetes labels its objects with it)."""
    trusted: bool = False
    """An admin marked the owner trusted (``PUT /v1/owners/{owner}``). Every other owner is untrusted:
    Kubernetes runs its notebook and endpoint pods under Kata."""
    uid: int | None = None
    """The owner's sandbox uid (``store.uids.owner_uid``, never 0): the local driver runs the replica as it."""
    gid: int | None = None
    """The owner's sandbox gid (the same number as ``uid``)."""


@dataclass(frozen=True, slots=True)
class ReplicaStatus:
    """What a driver sees of a replica."""

    id: str
    workload_id: str
    cls: str
    node: str
    state: ReplicaState
    url: str | None = None
    detail: str = ""
    served_model: str | None = None
    """The model name the replica's server answers to (``/model`` for a server started on the sandbox's
    model path): what the gateway sends upstream. None: the workload's own ``model``."""
    permanent: bool = False
    """Failed for a reason retrying cannot fix (a runtime missing, a model or image refused): the controller
    fails the workload at once instead of placing it again."""
    waiting: str = ""
    """Why a starting replica waits before its process starts (its runtime installing): the workload's reason
    meanwhile."""

    @property
    def holds_capacity(self) -> bool:
        return self.state in HOLDING


class Driver(Protocol):
    """Start, stop and observe replicas on the nodes a driver knows."""

    def nodes(self) -> Sequence[Node]:
        """The nodes and their allocatable resources, as the driver sees them now."""
        ...

    def start(self, spec: ReplicaSpec) -> ReplicaStatus:
        """Begin starting a replica; returns at once with its first status."""
        ...

    def stop(self, replica_id: str) -> ReplicaStatus:
        """Begin stopping a replica (graceful first)."""
        ...

    def observe(self) -> Sequence[ReplicaStatus]:
        """Every replica the driver knows of, with its current state."""
        ...

    def release(self, workload_id: str) -> None:
        """Give back what outlives a workload's replicas (a notebook's home dir), once the workload is
        deleted and none of its replicas runs. Idempotent: nothing there is done."""
        ...

    def prune(self, ended_before: float) -> int:
        """Forget replicas that ended (stopped or failed) at or before ``ended_before`` (seconds since the epoch):
        what a driver keeps of each (the local driver's replica dir: its record and log) is not kept
        forever. The number forgotten."""
        ...
