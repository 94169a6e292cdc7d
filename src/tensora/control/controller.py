"""The reconcile loop of one region: observe -> capacity -> decide -> apply -> events and usage.

The controller holds no decisions of its own (admission makes them) and no state of its own
(the store has it). One controller per region leads, by a lease in the store; every write
transaction of a cycle renews that lease first, so a controller that lost it cannot write
(a fence), and a workload moves ``queued -> starting`` only by a conditional update, so no
workload is placed twice.

Effects on the driver happen after the transaction that records the intent commits. A
crash between the two loses nothing: the next cycle (of this or the next leader) finds a
replica recorded ``starting`` that the driver does not know and starts it, or one recorded
``stopping`` that still runs and stops it. Driver calls are idempotent by replica id.

Workload states: ``queued -> starting -> running -> stopping -> stopped``, plus ``failed``.
An endpoint moving back stays ``running`` while a ``candidate`` replica starts on the better
class; when it is ready it becomes the primary (traffic shifts: the gateway routes to
primaries) and the old one drains: out of the routes at once, it keeps serving the requests in
flight for ``drain_s``, then stops.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from tensora.clock import Clock, SystemClock
from tensora.control import metrics
from tensora.drivers.base import Driver, ReplicaSpec, ReplicaState, ReplicaStatus
from tensora.errors import Conflict, StoreUnavailable
from tensora.placement.admission import (
    OwnerQuotas,
    Place,
    Policy,
    Promote,
    Queued,
    RestartAvailable,
    Running,
    Wait,
    WorkloadKind,
    decide,
    share,
)
from tensora.placement.capacity import Capacity, GpuReserve, Node, Placed
from tensora.placement.catalog import Catalog
from tensora.placement.quotas import OwnerSettings, Quotas
from tensora.store import repo
from tensora.store.db import Database

log = logging.getLogger("tensora.controller")



class LostLease(Exception):
    """This controller is no longer the leader; the transaction is rolled back."""


@dataclass
class CycleReport:
    """What one cycle did (for tests, logs and the benchmark)."""

    leader: bool
    placed: int = 0
    waiting: int = 0
    starting: int = 0
    """Replicas still starting or stopping after this cycle: the loop looks again soon, not a tick later."""
    promoted: int = 0
    transitions: int = 0
    started: list[str] = field(default_factory=list)
    stopped: list[str] = field(default_factory=list)
    released: list[str] = field(default_factory=list)
    """Deleted workloads whose storage the driver gave back this cycle."""
    decisions: Sequence[Any] = ()  # the admission's, for the metrics


@dataclass
class _Effects:
    start: list[ReplicaSpec] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)
    release: list[str] = field(default_factory=list)


class Controller:
    """One region's reconcile loop. ``run_once`` is one cycle; ``start`` runs cycles in a thread."""

    def __init__(self, db: Database, driver: Driver, catalog: Catalog, *, region: str = "local",
                 clock: Clock | None = None, policy: Policy | None = None, holder: str | None = None,
                 lease_ttl_s: float = 15.0, tick_s: float = 2.0, min_gap_s: float = 0.02, drain_s: float = 5.0,
                 reserves: dict[str, GpuReserve] | None = None, release_every: int = 15,
                 sandbox_uids: tuple[int, int] = (repo.UID_FIRST, repo.UID_LAST),
                 owner_defaults: OwnerSettings | None = None) -> None:
        self.db, self.driver, self.catalog, self.region = db, driver, catalog, region
        self.owner_defaults = owner_defaults or OwnerSettings()  # quotas unless an admin set an owner's own
        self.clock = clock or SystemClock()
        # a fallback timer is noticed up to a tick (and a cycle) late: the reason says the policy's wait
        self.policy = policy or Policy(timer_slack_s=max(Policy().timer_slack_s, 2 * tick_s))
        self.holder = holder or f"controller-{uuid.uuid4().hex[:12]}"
        self.lease_name = f"controller/{region}"
        self.lease_ttl_s, self.tick_s, self.min_gap_s = lease_ttl_s, tick_s, min_gap_s
        self.drain_s = drain_s  # a replica replaced by a move back serves its in-flight requests this long
        self.starting_tick_s = 0.5
        self.sandbox_uids = sandbox_uids  # the range owners' sandbox uids are allocated from
        self.reserves = reserves
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._known_nodes: list[dict[str, Any]] | None = None
        self._starting = 0
        self._cycles = 0
        self.release_every = release_every  # cycles between looks for deleted workloads' storage to give back
        self._released: list[str] = []  # given back by the driver, recorded in the next cycle's write
        self._trusted: set[str] | None = None  # owners an admin marked trusted, read once a cycle when needed

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
            self._thread.join(timeout=10)
        if release:
            try:
                with self.db.write() as conn:
                    repo.release_lease(conn, self.lease_name, self.holder)
            except StoreUnavailable:
                pass

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._wake.clear()
            began = time.monotonic()
            report = CycleReport(leader=False)
            try:
                report = self.run_once()
            except StoreUnavailable as exc:
                log.warning("store unavailable, cycle skipped: %s", exc)
            except Exception:
                log.exception("controller cycle failed; the next one redoes its work")
            ended = time.monotonic()
            metrics.cycle(self.region, report, ended - began)
            self._wake.wait(min(self.tick_s, self.starting_tick_s) if report.starting else self.tick_s)
            # Woken early (a burst of creates): rest at least min_gap_s, and twice as long as the
            # last cycle took, before the next one. An idle controller still reacts at once; a
            # busy one serves many requests per cycle and takes at most about a third of a core.
            rest = max(self.min_gap_s, 2 * (ended - began)) - (time.monotonic() - ended)
            if rest > 0:
                self._stop.wait(rest)

    def run_once(self) -> CycleReport:
        """One cycle. Each numbered step is named for what it does."""
        now = self.clock.now()
        report = CycleReport(leader=False)
        self._trusted = None  # read again this cycle, if anything starts
        # 1. lead: take or renew the region's lease, or do nothing this cycle
        if not self._lead(now):
            return report
        report.leader = True
        # 2. observe: what the driver sees now (nodes, replica states)
        nodes = list(self.driver.nodes())
        observed = {s.id: s for s in self.driver.observe()}
        # 3. reconcile: record replica transitions; redo starts and stops a crash left undone
        effects = _Effects()
        self._starting = 0
        try:
            with self.db.write() as conn:
                self._fence(conn, now)
                self._sync_nodes(conn, nodes, now)
                report.transitions = self._reconcile(conn, observed, now, effects)
        except LostLease:
            return CycleReport(leader=False)
        self._apply_effects(effects, report)
        # 4. capacity: nodes' allocatable minus every replica that holds capacity, from a snapshot
        #    read (no write lock is held while admission decides; only this leader adds replicas,
        #    so capacity can only have grown since)
        with self.db.read() as conn:
            capacity, queue, running, rows = self._snapshot(conn, nodes)
            quotas = self._quotas(conn)
        # 5. decide: the pure admission decision
        decisions = report.decisions = decide(queue, capacity, running, now, self.policy, quotas)
        # 6. apply: record intents (fenced, one transaction, each conditional on the state the
        #    snapshot saw: a workload stopped meanwhile is left alone), then tell the driver
        effects = _Effects()
        try:
            with self.db.write() as conn:
                self._fence(conn, now)
                self._apply(conn, decisions, rows, now, effects, report)
                # 7. housekeeping: forget idempotency records past their expiry; give back the
                #    storage of deleted workloads whose replicas are all gone (a notebook's home
                #    outlives its replicas, so a restart keeps its files), recorded once the driver
                #    did it (a crash in between only gives back again: the driver's release is idempotent)
                self._cycles += 1
                if self._cycles % 30 == 1:
                    repo.expire_idempotency(conn, now)
                repo.mark_released(conn, self._released, now)
                self._released = []
                if (self._cycles - 1) % self.release_every == 0:
                    effects.release = repo.unreleased(conn, self.region)
        except LostLease:
            return CycleReport(leader=False)
        self._apply_effects(effects, report)
        report.starting = self._starting + len(effects.start)
        return report

    # -- 1. lead ------------------------------------------------------------------------

    def _lead(self, now: float) -> bool:
        try:
            with self.db.write() as conn:
                return repo.acquire_lease(conn, self.lease_name, self.holder, now, self.lease_ttl_s)
        except Conflict:  # another controller inserted the lease first
            return False

    def _fence(self, conn: Any, now: float) -> None:
        if not repo.acquire_lease(conn, self.lease_name, self.holder, now, self.lease_ttl_s):
            raise LostLease(self.lease_name)

    def is_leader(self) -> bool:
        with self.db.read() as conn:
            return repo.lease_holder(conn, self.lease_name, self.clock.now()) == self.holder

    # -- 2/3. observe and reconcile ----------------------------------------------------------

    def _sync_nodes(self, conn: Any, nodes: Sequence[Node], now: float) -> None:
        rows = [{"name": n.name, "region": n.region, "cpu": n.cpu, "memory": n.memory, "gpus": dict(n.gpus),
                 "labels": dict(n.labels), "schedulable": n.schedulable, "updated_at": now}
                for n in nodes if n.region == self.region]
        comparable = [{k: v for k, v in r.items() if k != "updated_at"} for r in rows]
        if comparable != self._known_nodes:
            repo.replace_nodes(conn, self.region, rows)
            self._known_nodes = comparable

    def _reconcile(self, conn: Any, observed: dict[str, ReplicaStatus], now: float, fx: _Effects) -> int:
        replicas = repo.active_replicas(conn, self.region)
        # the workloads that hold replicas (failed or deleted ones too: their replicas still drain),
        # and those asked to stop; queued workloads have nothing to reconcile and are not read here
        held = {r["workload_id"] for r in replicas}
        workloads = {w["id"]: w for w in repo.workloads_by_id_or_state(conn, held, self.region, ("stopping",),
                                                                        without=_NOT_READ)}
        transitions = 0
        by_workload: dict[str, list[dict[str, Any]]] = {}
        for r in replicas:
            by_workload.setdefault(r["workload_id"], []).append(r)
        for r in replicas:
            w = workloads.get(r["workload_id"])
            if w is None:
                continue
            seen = observed.get(r["id"])
            transitions += self._reconcile_replica(conn, w, r, seen, by_workload[w["id"]], now, fx)
            self._starting += r["state"] in ("starting", "stopping") or r["role"] == "draining"
        # workloads asked to stop whose replicas are all gone
        for w in workloads.values():
            if w["state"] != "stopping":
                continue
            live = [r for r in by_workload.get(w["id"], []) if r["state"] in repo.ACTIVE_REPLICA]
            if not live:
                self._transition(conn, w, "stopping", "stopped", "stopped: all replicas stopped", now)
                transitions += 1
        return transitions

    def _reconcile_replica(self, conn: Any, w: dict[str, Any], r: dict[str, Any], seen: ReplicaStatus | None,
                           siblings: list[dict[str, Any]], now: float, fx: _Effects) -> int:
        wants_stop = r["state"] == "stopping" or w["state"] in ("stopping", "stopped", "failed") or (
            w["deleted_at"] is not None)
        if wants_stop:
            if seen is None or seen.state in (ReplicaState.STOPPED, ReplicaState.FAILED):
                self._replica_done(conn, r, "stopped", now, seen.detail if seen else "")
                return 0
            if r["state"] != "stopping":
                repo.update_replica(conn, r["id"], {"state": "stopping", "updated_at": now})
            fx.stop.append(r["id"])
            return 0
        if r["role"] == "draining":  # replaced by a move back: out of the routes; stop it once drained
            if seen is not None and seen.state in (ReplicaState.STOPPED, ReplicaState.FAILED):
                self._replica_done(conn, r, "stopped", now, seen.detail)
            elif now >= r["updated_at"] + self.drain_s:
                repo.update_replica(conn, r["id"], {"state": "stopping", "updated_at": now})
                repo.add_event(conn, w["id"], now, "drained",
                               f"drained: stopping the {r['cls']} replica at {r['node']}")
                fx.stop.append(r["id"])
            return 0
        if seen is None:  # recorded but never handed to the driver (or the driver forgot it): start it
            fx.start.append(self._replica_spec(conn, w, r))
            return 0
        if seen.state is ReplicaState.FAILED:
            return self._replica_failed(conn, w, r, seen, siblings, now)
        if seen.state is ReplicaState.STOPPED:
            return self._replica_failed(conn, w, r, seen, siblings, now, "stopped by itself")
        if seen.state is ReplicaState.RUNNING and r["state"] == "starting":
            repo.update_replica(conn, r["id"], {"state": "running", "url": seen.url,
                                                "served_model": seen.served_model, "updated_at": now})
            r["state"] = "running"
            if r["role"] == "candidate":
                return self._finish_move(conn, w, r, siblings, now, fx)
            if w["state"] == "starting":
                self._transition(conn, w, "starting", "running",
                                 f"running on {r['cls']} at {r['node']}", now)
                return 1
        return 0

    def _replica_done(self, conn: Any, r: dict[str, Any], state: str, now: float, detail: str = "") -> None:
        repo.update_replica(conn, r["id"], {"state": state, "updated_at": now, "detail": detail})
        repo.close_segment(conn, r["id"], now)
        r["state"] = state

    def _replica_failed(self, conn: Any, w: dict[str, Any], r: dict[str, Any], seen: ReplicaStatus,
                        siblings: list[dict[str, Any]], now: float, detail: str | None = None) -> int:
        why = detail or seen.detail or "replica failed"
        metrics.replica_failed(self.region, w["kind"], r["role"])
        self._replica_done(conn, r, "failed", now, why)
        if r["role"] == "candidate":
            repo.add_event(conn, w["id"], now, "move_failed",
                           f"move back to {r['cls']} failed ({why}); staying on {w['placed_class']}")
            return 0
        if w["kind"] != WorkloadKind.ENDPOINT:
            self._transition(conn, w, w["state"], "failed", f"failed: replica on {r['cls']} at {r['node']}: {why}",
                             now)
            return 1
        others = [s for s in siblings if s["id"] != r["id"] and s["role"] == "primary"
                  and s["state"] in ("starting", "running")]
        if others:
            repo.add_event(conn, w["id"], now, "replica_failed",
                           f"replica on {r['cls']} at {r['node']} failed ({why}); replacing it")
            return 0
        self._transition(conn, w, w["state"], "queued",
                         f"queued: its only replica ({r['cls']} at {r['node']}) failed: {why}", now,
                         extra={"queued_since": now, "placed_class": None})
        return 1

    def _finish_move(self, conn: Any, w: dict[str, Any], r: dict[str, Any], siblings: list[dict[str, Any]],
                     now: float, fx: _Effects) -> int:
        """The preferred replica is ready: it becomes the primary, traffic shifts, the old one drains."""
        old = [s for s in siblings if s["slot"] == r["slot"] and s["role"] == "primary" and s["id"] != r["id"]]
        repo.update_replica(conn, r["id"], {"role": "primary", "updated_at": now})
        for s in old:  # routes stop naming it now; it stops once in-flight requests had drain_s to finish
            repo.update_replica(conn, s["id"], {"role": "draining", "updated_at": now})
        placed = r["cls"] if r["slot"] == 0 else w["placed_class"]
        was = ", ".join(sorted({s["cls"] for s in old})) or "nothing"
        reason = (f"moved back to {r['cls']}: replica ready at {r['node']}, traffic shifted, "
                  f"draining the {was} replica ({self.drain_s:g} s for requests in flight)")
        repo.update_workload(conn, w["id"], {"placed_class": placed, "reason": reason, "updated_at": now})
        repo.add_event(conn, w["id"], now, "moved", reason)
        metrics.moved_back(self.region)
        return 1

    def _transition(self, conn: Any, w: dict[str, Any], from_state: str, to_state: str, reason: str, now: float,
                    extra: dict[str, Any] | None = None) -> bool:
        values = {"state": to_state, "updated_at": now, **(extra or {})}
        if to_state == "failed":  # the why of a failure is what a user needs to see first
            values.setdefault("reason", reason)
        if to_state != "queued":
            values.setdefault("restart_available", False)
        if not repo.update_workload(conn, w["id"], values, expect_state=from_state):
            return False
        repo.add_event(conn, w["id"], now, "transition", reason, from_state, to_state)
        w.update(values)
        return True

    # -- 4/5. capacity and the admission snapshot ---------------------------------------

    def _snapshot(self, conn: Any, nodes: Sequence[Node]) -> tuple[Capacity, list[Queued], list[Running],
                                                                     dict[str, dict[str, Any]]]:
        replicas = repo.active_replicas(conn, self.region)
        placed = [Placed(r["node"], r["cls"], r["workload_id"]) for r in replicas]
        capacity = Capacity([n for n in nodes if n.region == self.region], placed, self.catalog, self.reserves)
        rows = {w["id"]: w for w in repo.workloads_in(conn, self.region, ("queued", "starting", "running"),
                                                      without=_NOT_READ)}
        by_slot: dict[tuple[str, int], list[dict[str, Any]]] = {}
        for r in replicas:
            by_slot.setdefault((r["workload_id"], r["slot"]), []).append(r)
        queue: list[Queued] = []
        running: list[Running] = []
        for w in rows.values():
            if w["deleted_at"] is not None:
                continue
            kind = WorkloadKind(w["kind"])
            fallback = () if w["placement"] == "requested" else tuple(w["fallback"])
            for slot in range(w["replicas"] if kind == WorkloadKind.ENDPOINT else 1):
                held = by_slot.get((w["id"], slot), [])
                primary = next((r for r in held if r["role"] == "primary" and r["state"] != "stopping"), None)
                if primary is None:
                    if w["state"] == "queued" or slot > 0:
                        since = w["queued_since"] if w["queued_since"] is not None else w["created_at"]
                        queue.append(Queued(f"{w['id']}/{slot}", kind, w["gpu_class"], w["owner"], w["region"],
                                            fallback, w["fallback_after_s"], since, w["model_params"],
                                            w["model_bytes"]))
                    continue
                if w["state"] == "running" and primary["state"] == "running":
                    moving = any(r["role"] == "candidate" for r in held)
                    running.append(Running(f"{w['id']}/{slot}", kind, w["gpu_class"], primary["cls"],
                                           primary["node"], w["owner"], w["region"], tuple(w["fallback"]),
                                           w["model_params"], w["model_bytes"], moving))
        return capacity, queue, running, rows

    def _quotas(self, conn: Any) -> OwnerQuotas:
        """Each owner's running quotas (the admins' overrides over the server's defaults, in one read) and
        what its replicas hold now in every region, starting and stopping ones too: per replica slot, the
        largest of its replicas (a move back or a restart replaces one; while both exist, the larger counts,
        so no sequence of moves or restarts holds more than one replica's worth per slot against the quota)."""
        defaults = self.owner_defaults
        by_owner: dict[str, Quotas] = {}
        for owner, stored in repo.owner_quotas(conn).items():
            try:  # effective(), validated: a bad row must cost its owner the override, not every owner the cycle
                by_owner[owner] = Quotas.model_validate({**defaults.quotas.model_dump(), **dict(stored)})
            except (TypeError, ValueError) as exc:
                log.warning("owner %r: its stored quotas are not valid, the defaults apply: %s", owner, exc)
        slots: dict[tuple[str, str, int], tuple[float, float]] = {}
        for r in repo.held_replicas(conn):
            cls = self.catalog.get(r["cls"])
            if cls is None:
                continue
            key = (r["owner"], r["workload_id"], r["slot"])
            was, now = slots.get(key, (0.0, 0.0)), share(cls)
            slots[key] = (max(was[0], now[0]), max(was[1], now[1]))
        held: dict[str, tuple[float, float]] = {}
        for (owner, _, _), (gpus, cpu) in slots.items():
            total = held.get(owner, (0.0, 0.0))
            held[owner] = (total[0] + gpus, total[1] + cpu)
        return OwnerQuotas(defaults.quotas, by_owner, held)

    # -- 6. apply -----------------------------------------------------------------------

    def _apply(self, conn: Any, decisions: Sequence[Any], rows: dict[str, dict[str, Any]], now: float,
               fx: _Effects, report: CycleReport) -> None:
        restart: dict[str, RestartAvailable] = {}
        events: list[dict[str, Any]] = []
        waits: list[dict[str, Any]] = []
        starting = {_split(d.workload.id)[0] for d in decisions if isinstance(d, Place | Promote)}
        for wid, spec in repo.workload_specs(conn, starting).items():  # only what starts: never a queue's specs
            rows[wid]["spec"] = spec
        for d in decisions:
            if isinstance(d, Place):
                wid, slot = _split(d.workload.id)
                w = rows[wid]
                if slot == 0 and not self._transition(conn, w, "queued", "starting", d.reason, now,
                                                      {"placed_class": d.cls, "reason": d.reason,
                                                       "fallback_eligible_at": None}):
                    continue  # someone else moved it meanwhile: never place twice
                if slot > 0 and not self._still(conn, w, now):
                    continue
                replica = self._new_replica(conn, w, slot, d.cls, d.node, "primary", now)
                if slot > 0:
                    events.append(_event(wid, now, "replica_placed", f"replica {slot}: {d.reason}"))
                fx.start.append(self._replica_spec(conn, w, replica))
                report.placed += 1
            elif isinstance(d, Wait):
                wid, slot = _split(d.workload.id)
                w = rows[wid]
                report.waiting += 1
                if slot == 0 and (w["reason"] != d.reason or w["fallback_eligible_at"] != d.fallback_eligible_at):
                    waits.append({"id": wid, "reason": d.reason, "fallback_eligible_at": d.fallback_eligible_at})
            elif isinstance(d, Promote):
                wid, slot = _split(d.workload.id)
                w = rows[wid]
                if not self._still(conn, w, now):
                    continue
                replica = self._new_replica(conn, w, slot, d.to_class, d.node, "candidate", now)
                events.append(_event(wid, now, "moving", d.reason))
                fx.start.append(self._replica_spec(conn, w, replica))
                report.promoted += 1
            elif isinstance(d, RestartAvailable):
                restart[_split(d.workload.id)[0]] = d
        repo.add_events(conn, events)
        repo.set_wait_reasons(conn, waits)
        for wid, w in rows.items():
            offer = restart.get(wid)
            if offer is not None and not w["restart_available"]:
                if repo.update_workload(conn, wid, {"restart_available": True, "restart_reason": offer.reason},
                                        expect_state=w["state"]):
                    repo.add_event(conn, wid, now, "restart_available", offer.reason)
            elif offer is None and w["restart_available"]:
                repo.update_workload(conn, wid, {"restart_available": False, "restart_reason": ""})

    @staticmethod
    def _still(conn: Any, w: dict[str, Any], now: float) -> bool:
        """The workload is still in the state the snapshot saw (and not deleted since)."""
        return repo.update_workload(conn, w["id"], {"updated_at": now}, expect_state=w["state"],
                                    live_only=True)

    def _new_replica(self, conn: Any, w: dict[str, Any], slot: int, cls: str, node: str, role: str,
                     now: float) -> dict[str, Any]:
        row = {"id": repo.new_id("rp_"), "workload_id": w["id"], "slot": slot, "cls": cls, "node": node,
               "region": w["region"], "state": "starting", "role": role, "url": None, "detail": "",
               "created_at": now, "updated_at": now}
        repo.insert_replica(conn, row)
        repo.open_segment(conn, row, w, now)
        return row

    def _replica_spec(self, conn: Any, w: dict[str, Any], r: dict[str, Any]) -> ReplicaSpec:
        if self._trusted is None:  # one read a cycle, not one a start: a flag set since applies to new replicas
            self._trusted = repo.trusted_owners(conn)
        # the host paths the API resolved the owner's names to (workloads.validate), never a client's value:
        # a row without them (made before names) starts with no model or image
        if "spec" not in w:  # a start the reconcile redoes (rare): its spec alone
            w["spec"] = repo.workload_specs(conn, [w["id"]]).get(w["id"], {})
        spec = w["spec"] or {}
        first, last = self.sandbox_uids  # the owner's sandbox uid, allocated on its first replica
        uid = repo.owner_uid(conn, w["owner"], self.clock.now(), first=first, last=last)
        return ReplicaSpec(r["id"], w["id"], WorkloadKind(w["kind"]), r["cls"], r["node"], spec.get("model_path"),
                           spec.get("image_path"), w["owner"], trusted=w["owner"] in self._trusted,
                           uid=uid, gid=uid)

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
        for workload_id in fx.release:
            try:
                self.driver.release(workload_id)
            except Exception:
                log.exception("driver could not give back the storage of %s; retrying later", workload_id)
            else:
                report.released.append(workload_id)
                self._released.append(workload_id)


_NOT_READ = ("name", "restart_reason", "model", "spec")
"""Columns a cycle's bulk reads leave out: ``spec`` (up to 16 KiB each) is read only for workloads that start."""


def _split(slot_id: str) -> tuple[str, int]:
    wid, _, slot = slot_id.rpartition("/")
    return wid, int(slot)


def _event(wid: str, at: float, type_: str, reason: str) -> dict[str, Any]:
    return {"workload_id": wid, "at": at, "type": type_, "reason": reason, "from_state": None, "to_state": None}

