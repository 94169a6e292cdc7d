"""AdmissionTracker: the admission state a region's controller keeps between cycles, told the store's changes.

``decide`` from a snapshot reads every live workload of the region each cycle, so an idle region with a
long queue costs a read of the whole queue per tick. Here the controller keeps
:class:`~tensora.placement.admission_state.AdmissionState` and reads, each cycle, one watermark
(``store.changes.moved``, migration 0010): nothing new, and the cycle is ``step(state, [], now)`` (timers still
come due there). Something new, and only the rows changed since are read and told as events
(``snapshot.changes``, which shares ``snapshot.admit`` with the full snapshot, so they cannot disagree).

There is no state on a first cycle, after a restart, and after a lost lease or a failed cycle (the
controller calls :meth:`AdmissionTracker.forget`): it is rebuilt from a full snapshot once, with the watermark read
before it in the same read transaction (a change after the mark is read again next cycle: saying a
workload's truth twice is harmless, missing it is not).

Beside the state it keeps what the store holds of admission's own answers (each queued workload's wait
reason, the restart offers), so only the decisions that change a row are applied, and only their rows
are read: a re-decided region with a long queue whose waits read the same writes nothing.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from sqlalchemy import Connection

from tensora.config.quotas import Quotas
from tensora.control import snapshot
from tensora.control.apply import Applied
from tensora.placement.admission import (
    Decision,
    Place,
    Policy,
    Queued,
    RestartAvailable,
    Wait,
    decide,
)
from tensora.placement.admission_state import (
    AdmissionState,
    Event,
    NodeAdded,
    NodeRemoved,
    OwnerHeld,
    QuotaChanged,
    Started,
    Stopped,
    Submitted,
    step,
)
from tensora.placement.capacity import GpuReserve, Node
from tensora.placement.catalog import Catalog
from tensora.placement.kinds import SlotRef, WorkloadState
from tensora.store import changes as changes_repo
from tensora.store import owners as owners_repo
from tensora.store import workloads as workloads_repo
from tensora.store.rows import WorkloadRow

REFRESH_S = 30.0
"""How often a standing wait's figures are written when only they changed (a GPU freed that nobody waiting
could use: ``0 GPU free`` becomes ``1 GPU free``). A decision that changes is written in its cycle."""

WaitMark = tuple[str, float | None]
"""What a queued workload's row holds of its wait: (reason, fallback_eligible_at)."""


@dataclass
class CycleRead:
    """One cycle's read: the events for the state, the rows read, the workloads to fail."""

    events: list[Event]
    rows: dict[str, WorkloadRow]
    """The workloads read this cycle, by id (all live ones on a rebuild; the changed ones otherwise)."""
    gone: list[WorkloadRow]
    rebuilt: bool


@dataclass
class Cycle:
    """What ``step`` said this cycle, and what the controller applies of it."""

    decisions: list[Decision]
    """Every decision ``step`` returned: when the region was re-decided, all of its (as ``decide``'s)."""
    decided: bool
    """The region's waits and offers are those of ``decisions`` (False: they stand as after the last cycle)."""
    to_apply: list[Decision]
    """The decisions that change a row: placements, moves, offers, and waits whose reason is new."""
    need: set[str]
    """The workloads ``apply`` needs rows of (those of ``to_apply``, and offers to withdraw)."""
    waiting: int
    backing_off: int
    queue: dict[tuple[str, str], int] = field(default_factory=dict)
    """The waits that stand in the region after this cycle, by (class asked, kind): all of them, not only those
    ``decisions`` decided again."""


@dataclass
class AdmissionTracker:
    """The kept state and what it was last told; ``read`` then ``step`` then ``applied``, once a cycle."""

    catalog: Catalog
    region: str
    policy: Policy
    defaults: Quotas
    """The server's default quotas (an owner's stored overrides lie over them)."""
    reserves: Mapping[str, GpuReserve] | None = None
    admission: AdmissionState | None = None
    seen_rev: int = 0
    """The watermark the state is up to: every change below it has been told."""
    nodes: dict[str, Node] = field(default_factory=dict)
    quotas: dict[str, Quotas] = field(default_factory=dict)
    waits: dict[str, WaitMark] = field(default_factory=dict)
    """Each queued workload's wait as its row holds it (so a wait that reads the same is not written)."""
    offered: set[str] = field(default_factory=set)
    """The workloads whose row holds a restart offer."""
    backoff: dict[str, Queued] = field(default_factory=dict)
    """Queued slots waiting out a crash-loop back-off (``not_before``), by id."""
    waiting: int = 0
    refreshed_at: float = float("-inf")
    """When the standing waits' figures were last brought up to date in their rows."""

    def forget(self) -> None:
        """Drop the state: the next cycle rebuilds it from a full snapshot (a lost lease, a failed cycle)."""
        self.admission = None

    # -- 4. read ------------------------------------------------------------------------

    def read(self, conn: Connection, nodes: Sequence[Node]) -> CycleRead:
        """What changed since the last cycle, as events (everything, when there is no state)."""
        mine = {n.name: n for n in nodes if n.region == self.region}
        if self.admission is None:
            return self._rebuild(conn, mine)
        events = self._node_events(mine)
        moved = changes_repo.moved(conn, self.region, self.seen_rev)
        rows: list[WorkloadRow] = []
        gone: list[WorkloadRow] = []
        if moved.quotas:
            events += self._quota_events(snapshot.quotas_by_owner(self.defaults, owners_repo.owner_quotas(conn)))
        if moved.rows:
            ids = changes_repo.changed_workloads(conn, self.region, self.seen_rev)
            owners = changes_repo.owners_of_changed_replicas(conn, self.seen_rev)
            rows = workloads_repo.workloads_by_id(conn, ids)
            changed = snapshot.changes(rows, workloads_repo.replicas_of(conn, sorted(ids)), self.catalog)
            events += changed.events
            gone = changed.gone
            owners |= {w.owner for w in rows}
            held = snapshot.held_by_owner(workloads_repo.held_replicas(conn, sorted(owners)), self.catalog)
            events += [OwnerHeld(o, *held.get(o, (0.0, 0.0))) for o in sorted(owners)]  # after the others
        self.seen_rev = moved.mark
        self._remember(rows)
        return CycleRead(events, {w.id: w for w in rows}, gone, rebuilt=False)

    def _rebuild(self, conn: Connection, nodes: dict[str, Node]) -> CycleRead:
        mark = changes_repo.watermark(conn)  # first: a change committed during the reads below is read again
        replicas = workloads_repo.active_replicas(conn, self.region)
        live = workloads_repo.workloads_in(conn, self.region, snapshot.LIVE)
        snap = snapshot.take(list(nodes.values()), replicas, live, self.catalog, self.reserves, self.region)
        by_owner = snapshot.quotas_by_owner(self.defaults, owners_repo.owner_quotas(conn))
        held = snapshot.held_by_owner(workloads_repo.held_replicas(conn), self.catalog)
        self.admission = AdmissionState(nodes.values(), snapshot.placed(replicas), self.catalog, self.policy,
                                        snapshot.running_quotas(self.defaults, by_owner), self.reserves)
        self.seen_rev, self.nodes, self.quotas = mark, nodes, by_owner
        self.waits, self.offered, self.backoff = {}, set(), {}
        self._remember(snap.workloads.values())
        events: list[Event] = [*(Submitted(q) for q in snap.queue), *(Started(r) for r in snap.running)]
        events += [OwnerHeld(o, gpus, cpu) for o, (gpus, cpu) in sorted(held.items())]
        return CycleRead(events, dict(snap.workloads), snap.gone, rebuilt=True)

    def _node_events(self, nodes: dict[str, Node]) -> list[Event]:
        events: list[Event] = [NodeRemoved(name) for name in sorted(self.nodes.keys() - nodes.keys())]
        events += [NodeAdded(n) for name, n in sorted(nodes.items()) if self.nodes.get(name) != n]
        self.nodes = nodes
        return events

    def _quota_events(self, by_owner: dict[str, Quotas]) -> list[Event]:
        events: list[Event] = [QuotaChanged(o, q.running() if (q := by_owner.get(o)) is not None else None)
                               for o in sorted(self.quotas.keys() | by_owner.keys())
                               if self.quotas.get(o) != by_owner.get(o)]
        self.quotas = by_owner
        return events

    def _remember(self, rows: Iterable[WorkloadRow]) -> None:
        """What the store holds of admission's answers, for the rows just read."""
        for w in rows:
            if w.state is WorkloadState.QUEUED and w.deleted_at is None:
                self.waits[w.id] = (w.reason, w.fallback_eligible_at)
            else:
                self.waits.pop(w.id, None)
            if w.restart_available:
                self.offered.add(w.id)
            else:
                self.offered.discard(w.id)

    # -- 5. decide ----------------------------------------------------------------------

    def step(self, events: Sequence[Event], now: float) -> Cycle:
        """``step`` the state; which of its decisions change a row; the counts the report shows."""
        assert self.admission is not None, "read() first"
        # a back-off that ran out is no event of the store, and the state keeps no timer for it: said again,
        # the workload is a candidate once more (first: a change read this cycle comes after and prevails)
        due = [q for q in self.backoff.values() if q.not_before <= now]
        events = [*(Submitted(q) for q in due), *events]
        for q in due:
            del self.backoff[q.id]
        for e in events:
            if isinstance(e, Stopped):
                self.backoff.pop(e.id, None)
            elif isinstance(e, Submitted) and e.workload.not_before > now:
                self.backoff[e.workload.id] = e.workload
        self.admission, decisions = step(self.admission, events, now)
        # step decides again what could have changed (its offers among them: each is tried whenever its region
        # is); the other waits stand, with their figures recounted when read
        decided = bool(decisions) or next(self.admission.decisions(), None) is None
        self.waiting = self.admission.waiting()
        to_apply = [d for d in decisions if self._changes_a_row(d)]
        if now >= self.refreshed_at + REFRESH_S:
            to_apply += self._refreshed({d.workload.id for d in to_apply})
            self.refreshed_at = now
        need = {SlotRef.parse(d.workload.id).workload_id for d in to_apply}
        if decided:  # offers no longer made are withdrawn
            need |= self.offered - {SlotRef.parse(d.workload.id).workload_id for d in decisions
                                    if isinstance(d, RestartAvailable)}
        return Cycle(decisions, decided, to_apply, need, self.waiting, len(self.backoff),
                     self.admission.queue_depth(self.region))

    def _refreshed(self, already: set[str]) -> list[Decision]:
        """The standing waits whose figures (free GPUs, requesters waiting, the owner's use) moved since their
        row was written: a wait is decided again only when its decision could change, so a count alone is
        brought up to date here, every ``REFRESH_S`` (a pass over the waits)."""
        assert self.admission is not None
        return [d for d in self.admission.decisions()
                if type(d) is Wait and d.workload.id not in already and self._changes_a_row(d)]

    def _changes_a_row(self, d: Decision) -> bool:
        if not isinstance(d, Wait):
            return True
        ref = SlotRef.parse(d.workload.id)
        return ref.slot == 0 and self.waits.get(ref.workload_id) != (d.reason, d.fallback_eligible_at)

    # -- 6. apply -----------------------------------------------------------------------

    def applied(self, cycle: Cycle, out: Applied) -> None:
        """Remember what ``apply`` wrote of admission's answers."""
        for d in cycle.to_apply:
            ref = SlotRef.parse(d.workload.id)
            if isinstance(d, Wait):
                self.waits[ref.workload_id] = (d.reason, d.fallback_eligible_at)
            elif isinstance(d, Place) and ref.slot == 0:
                self.waits.pop(ref.workload_id, None)
        if cycle.decided:
            self.offered = set(out.offers)


def from_scratch(conn: Connection, nodes: Sequence[Node], catalog: Catalog, region: str, policy: Policy,
                 defaults: Quotas, now: float,
                 reserves: Mapping[str, GpuReserve] | None = None) -> tuple[snapshot.Snapshot, list[Decision]]:
    """What ``decide`` says from a full snapshot of the store: the answer the kept state must give (tests and
    the benchmark compare the two)."""
    replicas = workloads_repo.active_replicas(conn, region)
    live = workloads_repo.workloads_in(conn, region, snapshot.LIVE)
    snap = snapshot.take(nodes, replicas, live, catalog, reserves, region)
    held = workloads_repo.held_replicas(conn)
    quotas = snapshot.owner_quotas(defaults, owners_repo.owner_quotas(conn), held, catalog)
    return snap, decide(snap.queue, snap.capacity, snap.running, now, policy, quotas)
