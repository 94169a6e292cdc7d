"""The replay behind ``tensora plan``: the workloads' submissions and stops against the nodes, on a fake clock,
with the controller's own steps (reconcile, admission, apply) over rows in memory, and the report of each
workload's state after it.

Apart from ``control.fleet`` (the files, read and validated) so that it has no pydantic model of its own: it is one
of the compiled modules (``tensora.native``), and a replay of 10,000 workloads is thousands of cycles.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from tensora.clock import FakeClock
from tensora.control import snapshot
from tensora.control.apply import apply
from tensora.control.ledger import MemoryLedger
from tensora.control.reconcile import reconcile
from tensora.control.spec import WorkloadSpec
from tensora.drivers.base import ReplicaSpec, ReplicaStatus
from tensora.drivers.simulated import SimulatedDriver
from tensora.placement.admission import (
    Attempt,
    Decision,
    Place,
    Policy,
    Promote,
    Queued,
    RestartAvailable,
    Wait,
    collector_paused,
)
from tensora.placement.admission_state import (
    AdmissionState,
    Event,
    ReplicaPlaced,
    Started,
    Stopped,
    Submitted,
    step,
)
from tensora.placement.capacity import Node, Placed
from tensora.placement.catalog import Catalog
from tensora.placement.kinds import HOLDING, ReplicaRole, ReplicaState, SlotRef, WorkloadState
from tensora.store.rows import ReplicaRow, WorkloadRow
from tensora.units import format_duration


@dataclass(frozen=True, slots=True)
class PlannedWorkload:
    """A workload of ``workloads.yaml``, checked against the catalog, with its model size read."""

    spec: WorkloadSpec
    submitted_at: float
    stop_at: float | None


MAX_CYCLES_PER_MOMENT = 32
"""Cycles replayed at one moment until nothing changes (a placement, its replica ready, a move back's
candidate ready, a replica freed for another): a bound, never reached by a plan that settles."""


@dataclass(frozen=True, slots=True)
class Replayed:
    ledger: MemoryLedger
    """The rows after the replay: workloads by name, every replica, every event."""
    offers: dict[str, str]
    """The restart offers that stand at the end (workload -> reason): what the plan reports."""


def replay(
    nodes: Sequence[Node], workloads: Sequence[PlannedWorkload], catalog: Catalog, at: float,
    policy: Policy | None = None,
) -> Replayed:
    """The state after replaying up to offset ``at``.

    Each cycle is the controller's (``control.reconcile``, admission, ``control.apply``) on a simulated
    fleet and clock, with the rows in memory: a move back starts a candidate, which becomes the primary
    when ready while the old replica drains, as it does live. Admission is kept across cycles
    (``admission_state.step``) and told what changed, so a cycle costs what changed, not every workload.
    """
    # a replay makes rows, records and decisions that outlive their cycle, and no reference cycle: the
    # collector, run as they are made, would walk them again and again (a twentieth of a long replay's time)
    with collector_paused():
        return _Replay(nodes, workloads, catalog, at, policy).run()


_STOPPED = (WorkloadState.STOPPING, WorkloadState.STOPPED)


class _Moments:
    """The offsets still to visit up to ``at``, soonest first; each once."""

    def __init__(self, at: float) -> None:
        self.at = at
        self.heap: list[float] = []
        self.seen: set[float] = set()

    def add(self, moments: Iterable[float]) -> None:
        for m in moments:
            if m <= self.at and m not in self.seen:
                self.seen.add(m)
                heapq.heappush(self.heap, m)

    def next(self) -> float | None:
        return heapq.heappop(self.heap) if self.heap else None


@dataclass(frozen=True, slots=True)
class _Told:
    """What admission was last told of a workload: its records and the replicas holding capacity."""

    records: snapshot.Records
    placed: tuple[Placed, ...]


class _Replay:
    """One replay: the simulated fleet, the rows, admission's kept state, and what changed since each step
    of a cycle last looked."""

    def __init__(self, nodes: Sequence[Node], workloads: Sequence[PlannedWorkload], catalog: Catalog, at: float,
                 policy: Policy | None) -> None:
        self.workloads, self.catalog = workloads, catalog
        self.clock = FakeClock(0.0)
        self.driver = SimulatedDriver(nodes, self.clock)
        self.ledger = MemoryLedger()
        self.state = AdmissionState(self.driver.nodes(), [], catalog, policy)
        self.moments = _Moments(at)
        self.models = {pw.spec.name: pw.spec.model for pw in workloads}
        self.told: dict[str, _Told] = {}
        self.assumed: dict[str, set[str]] = {}
        """Workloads admission placed or promoted (their record ids): it assumed its decision, the truth
        (the rows after apply) is told next cycle whatever it is."""
        self.written: set[str] = set()  # workloads written since admission was last told
        self.again: set[str] = set()  # workloads written since the last reconcile
        self.watched: set[str] = set()
        """Workloads reconciled every cycle, changed or not: a replica draining (it stops when its time
        is up) or a crash loop (it heals when a replica has run long enough)."""
        self.offers: dict[str, RestartAvailable] = {}  # the restart offers that stand, by workload id
        self.refs: dict[str, SlotRef] = {}  # admission's workload ids, parsed (each is parsed once)
        self.waits: dict[str, tuple[_WaitKey, str, str | None]] = {}
        """Each record's wait as last applied, its workload, and the reason apply wrote for it (None: a slot
        after the first, whose wait writes nothing)."""

    def run(self) -> Replayed:
        workloads = self.workloads
        submits = sorted((pw.submitted_at, i) for i, pw in enumerate(workloads))
        stops = sorted((pw.stop_at, i) for i, pw in enumerate(workloads) if pw.stop_at is not None)
        self.moments.add([0.0, self.moments.at, *(t for t, _ in submits), *(t for t, _ in stops)])
        next_submit = next_stop = 0
        while (now := self.moments.next()) is not None:
            self.clock.set(now)
            # 1. what the users did by now: submissions, then stops (the files' order among equals)
            while next_submit < len(submits) and submits[next_submit][0] <= now:
                self.ledger.add_workload(_submitted(workloads[submits[next_submit][1]]))
                next_submit += 1
            while next_stop < len(stops) and stops[next_stop][0] <= now:
                at, i = stops[next_stop]
                w = self.ledger.workloads.get(workloads[i].spec.name)
                if w is not None and w.state not in _STOPPED:
                    _stop(self.ledger, self.driver, w, now, f"stopped at {format_duration(at)}")
                next_stop += 1
            # 2. cycles until nothing changes
            for _ in range(MAX_CYCLES_PER_MOMENT):
                if not self.cycle(now):
                    break
        self._recount()
        return Replayed(self.ledger, {wid: d.reason for wid, d in self.offers.items()})

    def _recount(self) -> None:
        """The waits that stand, with their figures of now in their rows (what the report shows): a wait is
        decided again only when its decision could change, so a count alone (a class's requesters waiting,
        its free GPUs) may have moved since its row was written."""
        waits = [d for d in self.state.decisions() if isinstance(d, Wait) and self._ref(d).slot == 0]
        ids = {self._ref(d).workload_id for d in waits}
        apply(self.ledger, waits, {wid: self.ledger.workloads[wid] for wid in ids}, self.moments.at, [])

    def _written(self) -> None:
        written = self.ledger.take_touched()
        self.written |= written
        self.again |= written

    def cycle(self, now: float) -> bool:
        """One controller cycle on the simulated fleet, over what changed; whether anything moved."""
        # 1. observe and reconcile the workloads whose rows or replicas changed
        self._written()
        ids = self.again | self.watched | {self.ledger.replicas[i].workload_id for i in self.driver.changed()}
        self.again = set()
        done = reconcile(self.ledger, *self._observed(ids), now)
        _effects(self.driver, self.models, done.start, done.stop)
        # 2. admission, told what changed
        self._written()
        events, gone = self._events()
        self.state, decisions = step(self.state, events, now)
        offers = self._offers(decisions)
        # 3. apply what would write something: the decided workloads' rows, and those whose offer was withdrawn
        fresh = [d for d in decisions if not (isinstance(d, Wait) and self._written_before(d))]
        decided = {self._ref(d).workload_id for d in fresh} | (self.offers.keys() - offers.keys())
        self.offers = offers
        rows = {wid: self.ledger.workloads[wid] for wid in sorted(decided)}
        applied = apply(self.ledger, fresh, rows, now, gone)
        _effects(self.driver, self.models, applied.start, [])
        for d in fresh:
            if isinstance(d, Wait):
                ref = self._ref(d)
                reason = self.ledger.workloads[ref.workload_id].reason if ref.slot == 0 else None
                self.waits[d.workload.id] = ((d.workload, d.attempts, d.fallback_eligible_at), ref.workload_id, reason)
        for d in decisions:
            if isinstance(d, Place | Promote):
                wid = self._ref(d).workload_id
                self.assumed.setdefault(wid, set()).add(d.workload.id)
                self.written.add(wid)
        self.moments.add([*applied.later, *done.drains_end])
        return bool(done.transitions or done.start or done.stop or applied.start)

    def _written_before(self, d: Wait) -> bool:
        """``d`` is the wait applied last time for its record, and its row still shows what apply wrote then:
        applying it again would write nothing (and its timer is a moment already)."""
        was = self.waits.get(d.workload.id)
        if was is None or was[0] != (d.workload, d.attempts, d.fallback_eligible_at):
            return False
        _, workload_id, reason = was
        w = self.ledger.workloads[workload_id]
        return reason is None or (w.reason == reason and w.fallback_eligible_at == d.fallback_eligible_at)

    def _observed(self, ids: set[str]) -> tuple[list[WorkloadRow], list[ReplicaRow], dict[str, ReplicaStatus]]:
        """Reconcile's inputs for workloads ``ids``: those holding replicas or asked to stop, every replica of
        theirs that holds capacity, and what the driver shows of each."""
        asked: list[WorkloadRow] = []
        replicas: list[ReplicaRow] = []
        observed: dict[str, ReplicaStatus] = {}
        for wid in sorted(ids):
            w = self.ledger.workloads[wid]
            held = [r for r in self.ledger.replicas_of(wid) if r.state in HOLDING]
            if not held and w.state is not WorkloadState.STOPPING:
                continue
            asked.append(w)
            replicas += held
            for r in held:
                seen = self.driver.status(r.id)
                if seen is not None:
                    observed[r.id] = seen
        return asked, replicas, observed

    def _events(self) -> tuple[list[Event], list[WorkloadRow]]:
        """What changed since admission was last told, as its events: for each workload written whose records
        or replicas differ from what was told (or whose decision admission assumed), its records and replicas
        anew. Also the workloads whose class left the catalog (apply fails them)."""
        events: list[Event] = []
        gone: list[WorkloadRow] = []
        for wid in sorted(self.written):
            w = self.ledger.workloads[wid]
            held = [r for r in self.ledger.replicas_of(wid) if r.state in HOLDING]
            self._watch(w, held)
            records = snapshot.admission_records(w, held, self.catalog)  # nothing for a workload not live
            if records.gone:
                gone.append(w)
            now = _Told(records, tuple(Placed(r.node, r.cls, str(r.ref)) for r in held))
            was = self.told.get(wid, _NOTHING)
            assumed = self.assumed.pop(wid, set())
            if now == was and not assumed:
                continue
            refs = {*_refs(was), *_refs(now), *assumed}
            # what admission assumed may be so already: then telling it again would change nothing
            if not (assumed and self.state.holds(refs, records.queue, records.running, now.placed)):
                events += [Stopped(ref) for ref in sorted(refs)]
                events += [ReplicaPlaced(p) for p in now.placed]
                events += [Submitted(q) for q in records.queue]
                events += [Started(r) for r in records.running]
            if now == _NOTHING:
                self.told.pop(wid, None)
            else:
                self.told[wid] = now
        self.written = set()
        return events, gone

    def _watch(self, w: WorkloadRow, held: Sequence[ReplicaRow]) -> None:
        if w.failures > 0 or any(r.role is ReplicaRole.DRAINING for r in held):
            self.watched.add(w.id)
        else:
            self.watched.discard(w.id)

    def _offers(self, decisions: Sequence[Decision]) -> dict[str, RestartAvailable]:
        """The restart offers that stand after a step (by workload id): with no offer standing before, the
        step's own are all; else the state's (a step says an offer again only where it decided its mover)."""
        standing = decisions if not self.offers else self.state.offers()
        return {self._ref(d).workload_id: d for d in standing if isinstance(d, RestartAvailable)}

    def _ref(self, d: Decision) -> SlotRef:
        """The slot ``d`` decides (parsed once per id: a wait standing in a long queue is decided again and
        again)."""
        ref = self.refs.get(d.workload.id)
        if ref is None:
            ref = self.refs[d.workload.id] = SlotRef.parse(d.workload.id)
        return ref


_NOTHING = _Told(snapshot.Records(), ())
_WaitKey = tuple[Queued, tuple[Attempt, ...], float | None]


def _refs(told: _Told) -> list[str]:
    return [*(q.id for q in told.records.queue), *(r.id for r in told.records.running),
            *(p.workload for p in told.placed)]


def _submitted(pw: PlannedWorkload) -> WorkloadRow:
    """The row ``POST /v1/workloads`` would make, queued at ``submitted_at`` (one replica: the plan has
    always counted one per workload)."""
    s, t = pw.spec, pw.submitted_at
    return WorkloadRow(s.name, s.owner, s.kind, s.region, s.gpu_class, s.gpu_class, None, tuple(s.fallback),
                       s.fallback_after_s, "policy", WorkloadState.QUEUED, "", None, False, 1, s.model_params,
                       s.model_bytes, t, t, queued_since=t)


def _stop(ledger: MemoryLedger, driver: SimulatedDriver, w: WorkloadRow, now: float, reason: str) -> None:
    """What ``POST .../stop`` records (the workload and its replicas ``stopping``), and the simulated
    replicas stopped at once: the next reconcile sees them gone and frees their capacity."""
    ledger.update_workload(w.id, {"state": WorkloadState.STOPPING, "updated_at": now, "restart_available": False,
                                  "reason": reason})
    for r in ledger.replicas_of(w.id):
        if r.state in HOLDING:
            ledger.update_replica(r.id, {"state": ReplicaState.STOPPING, "updated_at": now})
            driver.stop(r.id)


def _effects(driver: SimulatedDriver, models: dict[str, str | None],
             start: Sequence[tuple[WorkloadRow, ReplicaRow]], stop: Sequence[str]) -> None:
    for w, r in start:
        status = driver.start(ReplicaSpec(r.id, w.id, w.kind, r.cls, r.node, models.get(w.id)))
        assert status.state in (ReplicaState.RUNNING, ReplicaState.STARTING)
    for replica_id in stop:
        driver.stop(replica_id)


@dataclass(frozen=True, slots=True)
class PlanRow:
    """One workload at the reported moment (the ``-o json`` shape, plus ``restart_available``)."""

    name: str
    kind: str
    requested_class: str
    placed_class: str | None
    state: str
    reason: str
    fallback_eligible_at: str | None
    node: str | None = None
    restart_available: bool = False

    def as_json(self) -> dict[str, str | bool | None]:
        return {
            "name": self.name, "kind": self.kind, "requested_class": self.requested_class,
            "placed_class": self.placed_class, "state": self.state, "reason": self.reason,
            "fallback_eligible_at": self.fallback_eligible_at, "node": self.node,
            "restart_available": self.restart_available,
        }


def report(workloads: Sequence[PlannedWorkload], replayed: Replayed) -> list[PlanRow]:
    """Each workload's row, from the rows after a replay."""
    ledger, offers = replayed.ledger, replayed.offers
    rows = []
    for pw in workloads:
        spec, w = pw.spec, ledger.workloads.get(pw.spec.name)
        if w is None:
            rows.append(PlanRow(spec.name, spec.kind.value, spec.gpu_class, None, "not submitted",
                                f"submitted at {format_duration(pw.submitted_at)}", None))
            continue
        reason = w.reason or f"submitted at {format_duration(pw.submitted_at)}"
        if w.id in offers:
            reason = f"{reason}; {offers[w.id]}"
        queued = w.state is WorkloadState.QUEUED
        eligible = format_duration(w.fallback_eligible_at) if w.fallback_eligible_at is not None and queued else None
        primary = [r for r in ledger.replicas_of(w.id) if r.slot == 0 and r.role is ReplicaRole.PRIMARY]
        node = primary[-1].node if primary and w.placed_class is not None else None
        rows.append(PlanRow(spec.name, spec.kind.value, spec.gpu_class, w.placed_class, w.state.value, reason,
                            eligible, node, w.id in offers))
    return rows
