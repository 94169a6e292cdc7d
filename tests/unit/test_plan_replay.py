"""``tensora plan``'s replay, kept across cycles and told only what changed, reports what a replay that runs the
controller's whole cycle from scratch at every step reports (the reference below: every workload submitted or
stopped by a scan, reconcile over every replica, a snapshot of every row, ``decide`` from nothing, apply over
every row), on random histories of submissions, stops, fallbacks, timers and moves back."""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import example, given, settings
from hypothesis import strategies as st

from tensora.config.catalog import default_catalog
from tensora.control import fleet, replay, snapshot
from tensora.control.apply import apply
from tensora.control.ledger import MemoryLedger
from tensora.control.reconcile import reconcile
from tensora.control.replay import MAX_CYCLES_PER_MOMENT, PlannedWorkload, Replayed
from tensora.control.spec import WorkloadSpec
from tensora.drivers.simulated import SimulatedDriver
from tensora.placement.admission import decide
from tensora.placement.capacity import Node
from tensora.placement.kinds import WorkloadState
from tensora.units import format_duration
from tests.support.clock import FakeClock

CATALOG = default_catalog()
GIB = 2**30


def reference_replay(nodes: list[Node], workloads: list[PlannedWorkload], at: float) -> Replayed:
    """Every moment, every workload scanned; every cycle, the controller's steps over every row."""
    clock = FakeClock(0.0)
    driver = SimulatedDriver(nodes, clock)
    ledger = MemoryLedger()
    moments = {0.0, at} | {pw.submitted_at for pw in workloads} | {
        pw.stop_at for pw in workloads if pw.stop_at is not None}
    moments = {m for m in moments if m <= at}
    done: set[float] = set()
    models = {pw.spec.name: pw.spec.model for pw in workloads}
    offers: dict[str, str] = {}
    while moments - done:
        now = min(moments - done)
        done.add(now)
        clock.set(now)
        for pw in workloads:
            w = ledger.workloads.get(pw.spec.name)
            if w is None and pw.submitted_at <= now:
                w = ledger.workloads[pw.spec.name] = replay._submitted(pw)
            if w is not None and pw.stop_at is not None and pw.stop_at <= now and w.state not in replay._STOPPED:
                replay._stop(ledger, driver, w, now, f"stopped at {format_duration(pw.stop_at)}")
        for _ in range(MAX_CYCLES_PER_MOMENT):
            observed = {s.id: s for s in driver.observe()}
            replicas = ledger.active()
            held = {r.workload_id for r in replicas}
            asked = [w for w in ledger.workloads.values() if w.id in held or w.state is WorkloadState.STOPPING]
            rec = reconcile(ledger, asked, replicas, observed, now)
            replay._effects(driver, models, rec.start, rec.stop)
            snap = snapshot.take(driver.nodes(), ledger.active(),
                                 [w for w in ledger.workloads.values() if w.state in snapshot.LIVE], CATALOG)
            applied = apply(ledger, decide(snap.queue, snap.capacity, snap.running, now), snap.workloads, now,
                            snap.gone)
            replay._effects(driver, models, applied.start, [])
            offers = applied.offers
            moments.update(m for m in [*applied.later, *rec.drains_end] if m <= at)
            if not (rec.transitions or rec.start or rec.stop or applied.start):
                break
    return Replayed(ledger, offers)


@dataclass(frozen=True)
class World:
    nodes: list[Node]
    workloads: list[PlannedWorkload]
    at: float


NODES = [
    Node("l40s-1", "local", 32, 256 * GIB, {"L40S": 1}),
    Node("l40s-2", "local", 32, 256 * GIB, {"L40S": 2}),
    Node("a100-1", "local", 32, 256 * GIB, {"A100-80GB": 1}),
    Node("cpu-1", "local", 64, 256 * GIB),
]
CLASSES = ["l40s-48gb", "a100-80gb", "cpu-16c-64g"]


@st.composite
def worlds(draw: st.DrawFn) -> World:
    nodes = NODES[: draw(st.integers(1, len(NODES)))] + NODES[3:]
    out = []
    for i in range(draw(st.integers(1, 12))):
        kind = draw(st.sampled_from(["notebook", "endpoint", "vm"]))
        cls = draw(st.sampled_from(CLASSES))
        other = next(c for c in CLASSES[:2] if c != cls)  # a fallback often, so that moves back happen
        fallback = draw(st.sampled_from([[], ["cpu"], ["cpu"], [other, "cpu"], [other]]))
        body: dict[str, object] = {"kind": kind, "name": f"w{i}", "owner": draw(st.sampled_from("abc")),
                                   "gpu_class": cls, "fallback": fallback,
                                   "fallback_after": draw(st.sampled_from([0, 60, 300]))}
        if kind == "endpoint":
            body["model_params"] = draw(st.sampled_from(["1B", "8B", "70B"]))
        submitted = 60.0 * draw(st.integers(0, 20))
        stop = draw(st.one_of(st.none(), st.integers(0, 12)))
        out.append(PlannedWorkload(WorkloadSpec.model_validate(body), submitted,
                                   None if stop is None else submitted + 60.0 * stop))
    return World(nodes, out, 60.0 * draw(st.integers(0, 45)) + draw(st.sampled_from([0.0, 3.0, 5.0])))


def notebook(name: str, fallback: list[str], submitted: float, stop: float | None) -> PlannedWorkload:
    spec = WorkloadSpec.model_validate({"kind": "notebook", "name": name, "gpu_class": "l40s-48gb",
                                        "fallback": fallback})
    return PlannedWorkload(spec, submitted, stop)


OFFER_WITHDRAWN = World([NODES[0], NODES[3]], [notebook("holds", [], 0, 120), notebook("on-cpu", ["cpu"], 60, 180)],
                        180.0)
"""The L40S frees at 2m: the notebook on CPU is offered a restart; it stops at 3m, and the offer goes with it
although nothing else is decided then."""


@settings(max_examples=60, deadline=None)
@example(OFFER_WITHDRAWN)
@given(worlds())
def test_the_replay_on_step_reports_what_the_replay_from_scratch_reports(world: World) -> None:
    got = fleet.replay(world.nodes, world.workloads, CATALOG, world.at)
    want = reference_replay(world.nodes, world.workloads, world.at)
    assert fleet.report(world.workloads, got) == fleet.report(world.workloads, want)
    assert got.offers == want.offers
    assert got.ledger.workloads == want.ledger.workloads
    assert got.ledger.replicas == want.ledger.replicas
    assert got.ledger.restart_reasons == want.ledger.restart_reasons
    by_workload = sorted(got.ledger.events, key=lambda e: e.workload_id)  # stable: each one's order kept
    assert by_workload == sorted(want.ledger.events, key=lambda e: e.workload_id)
