"""The reconcile loop of one region: lead -> observe -> reconcile -> changes -> decide -> apply.

The controller holds no decisions of its own (admission makes them) and no state of its own
(the store has it) but a cache: the admission state, kept between cycles and told the store's
changes since a watermark (``tracker``), dropped on any failure or lost lease and rebuilt from a
full snapshot. One controller per region leads, by a lease in the store; every write
transaction of a cycle renews that lease first, so a controller that lost it cannot write
(a fence), and a workload moves ``queued -> starting`` only by a conditional update, so no
workload is placed twice.

Effects on the driver happen after the transaction that records the intent commits. A
crash between the two loses nothing: the next cycle (of this or the next leader) finds a
replica recorded ``starting`` that the driver does not know and starts it, or one recorded
``stopping`` that still runs and stops it. Driver calls are idempotent by replica id.

The steps are units of ``tensora.control``: ``snapshot`` and ``tracker`` (admission's inputs), ``reconcile``
(observed against recorded), ``apply`` (admission's decisions recorded), ``housekeeping`` and
``events`` (sentences rendered from values); this module is the loop that runs them in order,
leads, fences and calls the driver. ``tensora plan`` runs the same reconcile and apply.

Workload states (``placement.kinds.WorkloadState``): ``queued -> starting -> running ->
stopping -> stopped``, plus ``failed``. An endpoint moving back stays ``running`` while a
``candidate`` replica starts on the better class; when it is ready it becomes the primary
(traffic shifts: the gateway routes to primaries) and the old one drains: out of the routes at
once, it keeps serving the requests in flight for ``drain_s``, then stops.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from sqlalchemy import Connection

from tensora.clock import Clock, SystemClock
from tensora.config.quotas import OwnerSettings
from tensora.control import housekeeping
from tensora.control.apply import apply
from tensora.control.metrics import ControllerMetrics
from tensora.control.reconcile import DRAIN_S, reconcile
from tensora.control.store_ledger import StoreLedger
from tensora.control.tracker import AdmissionTracker, CycleRead
from tensora.drivers.base import Driver, ReplicaSpec
from tensora.errors import Conflict, StoreUnavailable
from tensora.names import controller_lease
from tensora.placement.admission import Decision, Policy
from tensora.placement.capacity import GpuReserve, Node
from tensora.placement.catalog import Catalog
from tensora.placement.kinds import WorkloadState
from tensora.store import leases as leases_repo
from tensora.store import nodes as nodes_repo
from tensora.store import owners as owners_repo
from tensora.store import uids as uids_repo
from tensora.store import workloads as workloads_repo
from tensora.store.db import Database
from tensora.store.rows import NodeRow, ReplicaRow, WorkloadRow
from tensora.telemetry.tracing import Tracing

log = logging.getLogger("tensora.controller")

LEASE_TTL_S = 15.0
"""How long a leader's lease lasts unless renewed (every write transaction renews it): a standby takes
over within this long of a leader's death; several ticks, so a slow cycle does not lose it."""
TICK_S = 2.0
"""Seconds between cycles when nothing wakes the loop (creates and stops wake it at once)."""
STARTING_TICK_S = 0.5
"""The tick while replicas are starting, stopping or draining: a ready replica is noticed within this."""
MIN_GAP_S = 0.02
"""The least rest between two cycles when woken early (a burst of creates)."""
BUSY_REST = 2.0
"""A woken loop rests this many times as long as its last cycle took: a busy controller serves many
requests per cycle and takes at most about a third of a core."""
TIMER_SLACK_TICKS = 2
"""A fallback timer is noticed up to a tick (and a cycle) late: admission's reason says the policy's wait
for a placement within this many ticks of the timer."""
STOP_JOIN_S = 10.0
"""How long ``stop`` waits for the loop's thread to end its cycle."""
_ASKED_TO_STOP = (WorkloadState.STOPPING,)
"""The workloads reconcile reads besides those holding replicas: asked to stop, maybe with none left."""


class LostLease(Exception):
    """This controller is no longer the leader; the transaction is rolled back."""


@dataclass
class CycleReport:
    """What one cycle did (for tests, logs and the benchmark)."""

    leader: bool
    placed: int = 0
    waiting: int = 0
    """Queued replicas admission has a wait for (as after the last cycle that re-decided the region)."""
    starting: int = 0
    """Replicas still starting or stopping after this cycle: the loop looks again soon, not a tick later."""
    promoted: int = 0
    transitions: int = 0
    started: list[str] = field(default_factory=list)
    stopped: list[str] = field(default_factory=list)
    released: list[str] = field(default_factory=list)
    """Deleted workloads whose storage the driver gave back this cycle."""
    decisions: Sequence[Decision] = ()
    """The admission's this cycle, for the metrics: all of the region's when it was re-decided."""
    decided: bool = True
    """False: admission re-decided nothing this cycle; the waits and offers of the last one stand."""
    queue: dict[tuple[str, str], int] | None = None
    """The waits that stand after this cycle, by (class asked, kind): every queued replica admission has a wait
    for, however few of them this cycle decided again (None: a cycle that did not decide)."""
    backing_off: int = 0
    """Queued replicas waiting out a crash-loop back-off (admission does not see them until then), as the
    admission state was told them (``AdmissionTracker.backoff``), not a count read from the store."""
    pruned: int = 0
    """Ended replicas the driver forgot this cycle (past the retention)."""


@dataclass
class _Effects:
    start: list[ReplicaSpec] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)
    release: list[str] = field(default_factory=list)
    prune: float | None = None
    """Forget replicas that ended before this moment (the driver's records), after the transaction."""


class Controller:
    """One region's reconcile loop. ``run_once`` is one cycle; ``start`` runs cycles in a thread."""

    def __init__(self, db: Database, driver: Driver, catalog: Catalog, *, region: str = "local",
                 clock: Clock | None = None, policy: Policy | None = None, holder: str | None = None,
                 lease_ttl_s: float = LEASE_TTL_S, tick_s: float = TICK_S, min_gap_s: float = MIN_GAP_S,
                 drain_s: float = DRAIN_S, reserves: dict[str, GpuReserve] | None = None,
                 release_every: int = housekeeping.RELEASE_EVERY,
                 retention_s: float = housekeeping.RETENTION_S, prune_every: int = housekeeping.PRUNE_EVERY,
                 sandbox_uids: tuple[int, int] = (uids_repo.UID_FIRST, uids_repo.UID_LAST),
                 owner_defaults: OwnerSettings | None = None, metrics: ControllerMetrics | None = None) -> None:
        self.db, self.driver, self.catalog, self.region = db, driver, catalog, region
        self.owner_defaults = owner_defaults or OwnerSettings()  # quotas unless an admin set an owner's own
        self.clock = clock or SystemClock()
        self.policy = policy or Policy(timer_slack_s=max(Policy().timer_slack_s, TIMER_SLACK_TICKS * tick_s))
        self.holder = holder or f"controller-{uuid.uuid4().hex[:12]}"
        self.lease_name = controller_lease(region)
        self.lease_ttl_s, self.tick_s, self.min_gap_s = lease_ttl_s, tick_s, min_gap_s
        self.drain_s = drain_s  # a replica replaced by a move back serves its in-flight requests this long
        self.starting_tick_s = STARTING_TICK_S
        self.sandbox_uids = sandbox_uids  # the range owners' sandbox uids are allocated from
        self.reserves = reserves
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.tracing: Tracing | None = None  # a span per cycle when set (``tracing``)
        self.metrics = metrics or ControllerMetrics()  # this controller's counts (``ControllerCollector`` reads them)
        self._known_nodes: list[NodeRow] | None = None
        self._cycles = 0
        self.release_every = release_every  # cycles between looks for deleted workloads' storage to give back
        self._released: list[str] = []  # given back by the driver, recorded in the next cycle's write
        self.retention_s, self.prune_every = retention_s, prune_every  # deleted workloads' events, ended replicas
        self._trusted: set[str] | None = None  # owners an admin marked trusted, read once a cycle when needed
        self.tracker = AdmissionTracker(catalog, region, self.policy, self.owner_defaults.quotas, reserves)
        """The admission state kept between cycles, and the watermark of the changes it was told."""
        self._lease_until = 0.0  # when this controller's lease lapses unless renewed (as far as it knows)

    # -- the loop -----------------------------------------------------------------------

    def wake(self) -> None:
        """Run a cycle now (a workload was created, stopped or restarted)."""
        self._wake.set()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name=f"controller-{self.region}", daemon=True)
        self._thread.start()

    def stop(self, release: bool = True) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread:
            self._thread.join(timeout=STOP_JOIN_S)
        if self.tracing is not None:
            self.tracing.close()  # the spans batched are sent
        if release:
            try:
                with self.db.write() as conn:
                    leases_repo.release_lease(conn, self.lease_name, self.holder)
            except StoreUnavailable:
                pass

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._wake.clear()
            began = time.monotonic()
            report = CycleReport(leader=False)
            try:
                report = self.run_once() if self.tracing is None else self._traced()
            except StoreUnavailable as exc:
                log.warning("store unavailable, cycle skipped: %s", exc)
            except Exception:
                log.exception("controller cycle failed; the next one redoes its work")
            ended = time.monotonic()
            self.metrics.cycle(self.region, report, ended - began)
            self._wake.wait(min(self.tick_s, self.starting_tick_s) if report.starting else self.tick_s)
            # woken early: rest at least min_gap_s, and BUSY_REST times as long as the last cycle took
            rest = max(self.min_gap_s, BUSY_REST * (ended - began)) - (time.monotonic() - ended)
            if rest > 0:
                self._stop.wait(rest)

    def _traced(self) -> CycleReport:
        """``run_once`` in a span, its steps as events."""
        assert self.tracing is not None
        with self.tracing.span("controller.cycle", {"tensora.region": self.region}) as span:
            report = self.run_once()
            span.set_attribute("tensora.leader", bool(report.leader))
            span.set_attribute("tensora.decisions", len(getattr(report, "decisions", ()) or ()))
            return report

    def _step(self, name: str) -> None:
        if self.tracing is not None:
            self.tracing.event(name)

    def run_once(self) -> CycleReport:
        """One cycle. A cycle that fails (or finds another leader) drops the admission state it kept: the
        next one rebuilds it from the store, whatever the failure left half done."""
        try:
            report = self._cycle()
        except BaseException:
            self.tracker.forget()
            raise
        if not report.leader:
            self.tracker.forget()
        return report

    def forget(self) -> None:
        """Rebuild the admission state from a full snapshot next cycle (tests, the benchmark)."""
        self.tracker.forget()

    def _cycle(self) -> CycleReport:
        """One cycle. Each numbered step is named for what it does."""
        now = self.clock.now()
        report = CycleReport(leader=False)
        self._trusted = None  # read again this cycle, if anything starts
        self._step("lead")
        # 1. lead: take or renew the region's lease, or do nothing this cycle
        if not self._lead(now):
            return report
        report.leader = True
        self._step("observe")
        # 2. observe: what the driver sees now (nodes, replica states)
        nodes = list(self.driver.nodes())
        observed = {s.id: s for s in self.driver.observe()}
        self._step("reconcile")
        # 3. reconcile: record replica transitions; redo starts and stops a crash left undone
        effects = _Effects()
        try:
            with self.db.write() as conn:
                self._fence(conn, now)
                self._sync_nodes(conn, nodes, now)
                replicas = workloads_repo.active_replicas(conn, self.region)
                # the workloads that hold replicas (failed or deleted ones too: their replicas still drain),
                # and those asked to stop; queued workloads have nothing to reconcile and are not read here
                held = {r.workload_id for r in replicas}
                workloads = workloads_repo.workloads_by_id_or_state(conn, held, self.region, _ASKED_TO_STOP)
                done = reconcile(StoreLedger(conn), workloads, replicas, observed, now, self.drain_s)
                for kind, role in done.failures:
                    self.metrics.replica_failed(self.region, kind, role)
                for _ in range(done.moved_back):
                    self.metrics.moved_back(self.region)
                effects.start = self._specs(conn, done.start) if done.start else []
                effects.stop = done.stop
        except LostLease:
            return CycleReport(leader=False)  # run_once drops the state
        report.transitions = done.transitions
        self._apply_effects(effects, report)
        self._step("changes")
        # 4. changes: what the store says changed since the last cycle, as events for the admission state
        #    kept between cycles (all of it, from a full snapshot, when there is none); a snapshot read:
        #    no write lock is held while admission decides, and only this leader adds replicas
        with self.db.read() as conn:
            seen = self.tracker.read(conn, nodes)
        self._step("decide")
        # 5. decide: the pure admission step over what changed (timers come due in it too)
        cycle = self.tracker.step(seen.events, now)
        report.decisions, report.decided = cycle.decisions, cycle.decided
        report.waiting, report.backing_off, report.queue = cycle.waiting, cycle.backing_off, cycle.queue
        self._step("apply")
        # 6. apply: record intents (fenced, one transaction, each conditional on the state the rows read
        #    showed: a workload stopped meanwhile is left alone), then tell the driver; the rows of the
        #    workloads decided about are read for it, never the queue's
        # 7. housekeeping, in the same transaction
        rows = self._rows(seen, cycle.need)
        effects = _Effects()
        try:
            with self.db.write() as conn:
                self._fence(conn, now)
                applied = apply(StoreLedger(conn), cycle.to_apply, rows, now, seen.gone)
                effects.start = self._specs(conn, applied.start) if applied.start else []
                self._cycles += 1
                effects.release = housekeeping.housekeep(conn, self._cycles, now, self.region, self._released,
                                                         self.release_every, self.retention_s, self.prune_every)
                if housekeeping.due(self._cycles, self.prune_every):
                    effects.prune = now - self.retention_s
                self._released = []
        except LostLease:
            return CycleReport(leader=False)  # run_once drops the state
        self.tracker.applied(cycle, applied)
        report.placed, report.promoted = applied.placed, applied.promoted
        self._apply_effects(effects, report)
        report.starting = done.busy + len(effects.start)
        return report

    def _rows(self, seen: CycleRead, need: set[str]) -> dict[str, WorkloadRow]:
        """The rows ``apply`` needs: those read this cycle, and the others read by id."""
        rows = {wid: seen.rows[wid] for wid in need if wid in seen.rows}
        missing = need - rows.keys()
        if missing:
            with self.db.read() as conn:
                rows.update((w.id, w) for w in workloads_repo.workloads_by_id(conn, sorted(missing)))
        return rows

    # -- 1. lead ------------------------------------------------------------------------

    def _lead(self, now: float) -> bool:
        try:
            with self.db.write() as conn:
                led = leases_repo.acquire_lease(conn, self.lease_name, self.holder, now, self.lease_ttl_s)
        except Conflict:  # another controller inserted the lease first
            return False
        if led and now >= self._lease_until:  # it had lapsed: another may have led meanwhile, unseen here
            self.tracker.forget()
        if led:
            self._lease_until = now + self.lease_ttl_s
        return led

    def _fence(self, conn: Connection, now: float) -> None:
        if not leases_repo.acquire_lease(conn, self.lease_name, self.holder, now, self.lease_ttl_s):
            raise LostLease(self.lease_name)
        self._lease_until = now + self.lease_ttl_s  # (renewed if the transaction commits; never later than this)

    def is_leader(self) -> bool:
        with self.db.read() as conn:
            return leases_repo.lease_holder(conn, self.lease_name, self.clock.now()) == self.holder

    # -- 2. observe ---------------------------------------------------------------------

    def _sync_nodes(self, conn: Connection, nodes: Sequence[Node], now: float) -> None:
        rows = [NodeRow.of_node(n) for n in nodes if n.region == self.region]
        if rows != self._known_nodes:  # updated_at is left out of the comparison: it is 0 in both
            nodes_repo.replace_nodes(conn, self.region, [replace(r, updated_at=now) for r in rows])
            self._known_nodes = rows

    # -- the driver ---------------------------------------------------------------------

    def _specs(self, conn: Connection, starts: Sequence[tuple[WorkloadRow, ReplicaRow]]) -> list[ReplicaSpec]:
        """What the driver needs to start each replica: read only for those (never a queue's specs)."""
        # the host paths the API resolved the owner's names to (workloads.validate), never a client's value:
        # a row without them (made before names) starts with no model or image
        specs = workloads_repo.workload_specs(conn, {w.id for w, _ in starts})
        if starts and self._trusted is None:  # one read a cycle, not one a start: a flag set since applies
            self._trusted = owners_repo.trusted_owners(conn)
        trusted = self._trusted or set()
        first, last = self.sandbox_uids  # the owner's sandbox uid, allocated on its first replica
        out = []
        for w, r in starts:
            spec = specs.get(w.id) or {}
            uid = uids_repo.owner_uid(conn, w.owner, self.clock.now(), first=first, last=last)
            out.append(ReplicaSpec(r.id, w.id, w.kind, r.cls, r.node, spec.get("model_path"), spec.get("image_path"),
                                   w.owner, trusted=w.owner in trusted, uid=uid, gid=uid))
        return out

    def _apply_effects(self, fx: _Effects, report: CycleReport) -> None:
        """Driver calls, after the intents committed. A failure here is redone next cycle."""
        for spec in fx.start:
            try:
                self.driver.start(spec)
                report.started.append(spec.id)
            except Exception:
                log.exception("driver could not start %s; retrying next cycle", spec.id)
        for replica_id in fx.stop:
            try:
                self.driver.stop(replica_id)
                report.stopped.append(replica_id)
            except KeyError:
                report.stopped.append(replica_id)  # the driver has no such replica: nothing to stop
            except Exception:
                log.exception("driver could not stop %s; retrying next cycle", replica_id)
        if fx.prune is not None:
            try:
                report.pruned = self.driver.prune(fx.prune)
            except Exception:
                log.exception("driver could not prune ended replicas; retrying later")
        for workload_id in fx.release:
            try:
                self.driver.release(workload_id)
            except Exception:
                log.exception("driver could not give back the storage of %s; retrying later", workload_id)
            else:
                report.released.append(workload_id)
                self._released.append(workload_id)
