"""An in-memory fleet that "runs" what admission places: capacity planning and benchmarks
without hardware, and a driver for tests that need faults on demand.

Replicas become ``running`` ``start_delay_s`` after ``start`` and ``stopped`` after
``stop``, on the driver's clock. ``fail`` and ``set_schedulable`` inject faults; ``wait_on`` a step a
starting replica waits on (a runtime's install, as the local driver reports it). ``changed`` and
``status`` let a caller (``tensora plan``) look only at the replicas whose state changed, not every one.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace

from tensora.clock import Clock, FakeClock
from tensora.drivers.base import ReplicaSpec, ReplicaStatus
from tensora.placement.capacity import Node
from tensora.placement.kinds import ReplicaState, WorkloadKind


@dataclass(slots=True)
class _Replica:
    spec: ReplicaSpec
    state: ReplicaState
    ready_at: float
    detail: str = ""
    waiting: str = ""


class SimulatedDriver:
    """The simulated fleet: a product feature (``tensora plan``), not a test mock."""

    def __init__(
        self,
        nodes: Iterable[Node],
        clock: Clock | None = None,
        start_delay_s: Mapping[WorkloadKind, float] | float = 0.0,
    ) -> None:
        self._nodes: dict[str, Node] = {n.name: n for n in nodes}
        self._clock = clock or FakeClock()
        self._delays = start_delay_s
        self._replicas: dict[str, _Replica] = {}
        self._changed: set[str] = set()
        self._starting: list[tuple[float, str]] = []  # (ready_at, id), soonest first
        self.released: list[str] = []

    def _delay(self, kind: WorkloadKind) -> float:
        if isinstance(self._delays, int | float):
            return float(self._delays)
        return float(self._delays.get(kind, 0.0))

    def nodes(self) -> Sequence[Node]:
        return list(self._nodes.values())

    def start(self, spec: ReplicaSpec) -> ReplicaStatus:
        if spec.node not in self._nodes:
            raise KeyError(f"no node {spec.node!r} in the simulated fleet")
        if spec.id in self._replicas and self._replicas[spec.id].state is not ReplicaState.STOPPED:
            return self._status(self._replicas[spec.id])
        delay = self._delay(spec.kind)
        state = ReplicaState.RUNNING if delay <= 0 else ReplicaState.STARTING
        replica = self._replicas[spec.id] = _Replica(spec, state, self._clock.now() + delay)
        if state is ReplicaState.STARTING:
            heapq.heappush(self._starting, (replica.ready_at, spec.id))
        self._changed.add(spec.id)
        return self._status(self._replicas[spec.id])

    def specs(self) -> list[ReplicaSpec]:
        """What each replica was started with (the fleet's record, as a real cloud's API would show)."""
        return [r.spec for r in self._replicas.values()]

    def stop(self, replica_id: str) -> ReplicaStatus:
        replica = self._replicas[replica_id]
        if replica.state is not ReplicaState.FAILED:
            replica.state = ReplicaState.STOPPED
        self._changed.add(replica_id)
        return self._status(replica)

    def release(self, workload_id: str) -> None:
        """The fleet keeps no storage; what was given back is recorded, as a cloud's audit log would."""
        if workload_id not in self.released:
            self.released.append(workload_id)

    def prune(self, ended_before: float) -> int:
        """The fleet keeps its record of every replica, as a cloud's API lists them: nothing to forget."""
        return 0

    def observe(self) -> Sequence[ReplicaStatus]:
        self._ripen()
        return [self._status(r) for r in self._replicas.values()]

    def changed(self) -> set[str]:
        """The replicas whose state changed since the last call (started, ready, stopped, failed)."""
        self._ripen()
        changed, self._changed = self._changed, set()
        return changed

    def status(self, replica_id: str) -> ReplicaStatus | None:
        """One replica as ``observe`` shows it; None: never started here."""
        self._ripen()
        replica = self._replicas.get(replica_id)
        return self._status(replica) if replica is not None else None

    def _ripen(self) -> None:
        """Replicas whose start delay has run out are running."""
        now = self._clock.now()
        while self._starting and self._starting[0][0] <= now:
            ready_at, id = heapq.heappop(self._starting)
            replica = self._replicas[id]
            if replica.state is ReplicaState.STARTING and replica.ready_at == ready_at:
                replica.state = ReplicaState.RUNNING
                self._changed.add(id)

    # -- faults and fleet changes ----------------------------------------------------

    def fail(self, replica_id: str, detail: str = "simulated failure") -> None:
        replica = self._replicas[replica_id]
        replica.state, replica.detail = ReplicaState.FAILED, detail
        self._changed.add(replica_id)

    def wait_on(self, replica_id: str, step: str) -> None:
        """A starting replica says it waits on ``step`` (its runtime's install) until it runs or ends."""
        self._replicas[replica_id].waiting = step

    def set_schedulable(self, node: str, schedulable: bool) -> None:
        self._nodes[node] = replace(self._nodes[node], schedulable=schedulable)

    def add_node(self, node: Node) -> None:
        self._nodes[node.name] = node

    def remove_node(self, name: str) -> None:
        """The node is lost: its replicas fail."""
        self._nodes.pop(name)
        for replica in self._replicas.values():
            if replica.spec.node == name and replica.state is not ReplicaState.STOPPED:
                replica.state, replica.detail = ReplicaState.FAILED, f"node {name} lost"
                self._changed.add(replica.spec.id)

    @staticmethod
    def _status(r: _Replica) -> ReplicaStatus:
        s = r.spec
        waiting = r.waiting if r.state is ReplicaState.STARTING else ""
        return ReplicaStatus(s.id, s.workload_id, s.cls, s.node, r.state, None, r.detail, waiting=waiting)
