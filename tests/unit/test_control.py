"""The controller's units on their own: the kinds and SlotRef, the event sentences, the snapshot,
the two ledgers against each other, and reconcile + apply stepping a move back on a simulated fleet."""

from __future__ import annotations

import typing
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tensora.api.schemas import WorkloadOut
from tensora.config.quotas import Quotas
from tensora.control import snapshot
from tensora.control.apply import apply
from tensora.control.events import (
    AllStopped,
    Drained,
    EventType,
    Happened,
    Moved,
    MoveFailed,
    Ready,
    ReplicaFailed,
    ReplicaPlaced,
    Then,
    Where,
    event_type,
    render,
)
from tensora.control.housekeeping import due
from tensora.control.ledger import Ledger, MemoryLedger
from tensora.control.reconcile import reconcile
from tensora.control.store_ledger import StoreLedger
from tensora.drivers.base import ReplicaSpec
from tensora.drivers.simulated import SimulatedDriver
from tensora.placement.admission import decide
from tensora.placement.kinds import ReplicaRole, ReplicaState, SlotRef, WorkloadKind, WorkloadState
from tensora.store import workloads as workloads_repo
from tensora.store.db import Database
from tensora.store.rows import WORKLOAD_COLUMNS, HeldReplica, ReplicaRow, WorkloadRow
from tests.support.builders import CATALOG
from tests.support.clock import FakeClock
from tests.support.stack import T0, fleet

L40S, CPU = Where("l40s-48gb", "gpu-l40s-1"), Where("cpu-16c-64g", "cpu-1")

# -- kinds ------------------------------------------------------------------------------------


def test_the_states_are_the_api_s_words() -> None:
    """StrEnum: a member is the text the store holds and the API's schema lists."""
    api_states = typing.get_args(WorkloadOut.model_fields["state"].annotation)
    assert list(WorkloadState) == list(api_states)
    assert WorkloadState("queued") is WorkloadState.QUEUED and f"{ReplicaRole.DRAINING}" == "draining"


@given(st.text(min_size=1).filter(lambda s: "\n" not in s), st.integers(min_value=0, max_value=10**6))
def test_a_slot_ref_reads_back_what_it_writes(wid: str, slot: int) -> None:
    ref = SlotRef(wid, slot)
    assert str(ref) == f"{wid}/{slot}" and SlotRef.parse(str(ref)) == ref


@pytest.mark.parametrize("text", ["wl_1", "wl_1/", "/0", "wl_1/x", "wl_1/-1", ""])
def test_a_slot_ref_refuses_text_without_a_slot(text: str) -> None:
    with pytest.raises(ValueError, match="not a replica slot"):
        SlotRef.parse(text)


# -- events -----------------------------------------------------------------------------------

SENTENCES: list[tuple[str, Happened, EventType, str]] = [
    ("ready", Ready(L40S), EventType.TRANSITION, "running on l40s-48gb at gpu-l40s-1"),
    ("all stopped", AllStopped(), EventType.TRANSITION, "stopped: all replicas stopped"),
    ("drained", Drained(CPU), EventType.DRAINED, "drained: stopping the cpu-16c-64g replica at cpu-1"),
    ("move failed", MoveFailed("l40s-48gb", "image pull failed", "cpu-16c-64g"), EventType.MOVE_FAILED,
     "move back to l40s-48gb failed (image pull failed); staying on cpu-16c-64g"),
    ("notebook's replica failed", ReplicaFailed(L40S, "oom", Then.FAIL), EventType.TRANSITION,
     "failed: replica on l40s-48gb at gpu-l40s-1: oom"),
    ("one of several failed", ReplicaFailed(L40S, "oom", Then.REPLACE), EventType.REPLICA_FAILED,
     "replica on l40s-48gb at gpu-l40s-1 failed (oom); replacing it"),
    ("the only one failed", ReplicaFailed(CPU, "stopped by itself", Then.REQUEUE), EventType.TRANSITION,
     "queued: its only replica (cpu-16c-64g at cpu-1) failed: stopped by itself"),
    ("moved", Moved(L40S, ("cpu-16c-64g",), 5.0), EventType.MOVED,
     "moved back to l40s-48gb: replica ready at gpu-l40s-1, traffic shifted, draining the cpu-16c-64g replica "
     "(5 s for requests in flight)"),
    ("moved, two old of one class, a fractional drain", Moved(L40S, ("cpu-16c-64g", "cpu-16c-64g"), 2.5),
     EventType.MOVED, "moved back to l40s-48gb: replica ready at gpu-l40s-1, traffic shifted, draining the "
                      "cpu-16c-64g replica (2.5 s for requests in flight)"),
    ("moved, nothing to drain", Moved(L40S, (), 5.0), EventType.MOVED,
     "moved back to l40s-48gb: replica ready at gpu-l40s-1, traffic shifted, draining the nothing replica "
     "(5 s for requests in flight)"),
    ("a further replica placed", ReplicaPlaced(2, "placed on l40s-48gb"), EventType.REPLICA_PLACED,
     "replica 2: placed on l40s-48gb"),
]


@pytest.mark.parametrize(("happened", "type_", "sentence"), [c[1:] for c in SENTENCES], ids=[c[0] for c in SENTENCES])
def test_event_sentences(happened: Happened, type_: EventType, sentence: str) -> None:
    assert (event_type(happened), render(happened)) == (type_, sentence)


@pytest.mark.parametrize(("cycle", "every", "expected"), [
    pytest.param(1, 30, True, id="the first cycle"), pytest.param(2, 30, False, id="the second"),
    pytest.param(31, 30, True, id="one period on"), pytest.param(7, 1, True, id="every cycle"),
    pytest.param(15, 15, False, id="just before a period"), pytest.param(16, 15, True, id="a period on"),
])
def test_housekeeping_is_due_on_the_first_cycle_and_every_period_after(cycle: int, every: int, expected: bool) -> None:
    assert due(cycle, every) is expected


# -- snapshot ---------------------------------------------------------------------------------

def wrow(wid: str, state: WorkloadState = WorkloadState.QUEUED, **kw: Any) -> WorkloadRow:
    base = WorkloadRow(wid, "alice", WorkloadKind.ENDPOINT, "local", "l40s-48gb", "l40s-48gb", None, ("cpu",), 0.0,
                       "policy", state, "", None, False, 1, None, None, T0, T0, queued_since=T0)
    return base._replace(**kw)


def rrow(rid: str, wid: str, cls: str, node: str, slot: int = 0, state: ReplicaState = ReplicaState.RUNNING,
         role: ReplicaRole = ReplicaRole.PRIMARY) -> ReplicaRow:
    return ReplicaRow(rid, wid, slot, cls, node, "local", state, role, T0, T0)


def test_snapshot_queues_slots_without_a_primary_and_runs_those_with_one() -> None:
    rows = [wrow("q"), wrow("req", placement="requested"), wrow("gone", deleted_at=T0),
            wrow("r", WorkloadState.RUNNING, replicas=3, placed_class="cpu-16c-64g"),
            wrow("m", WorkloadState.RUNNING, placed_class="cpu-16c-64g")]
    replicas = [rrow("r0", "r", "cpu-16c-64g", "cpu-1"),
                rrow("r1", "r", "cpu-16c-64g", "cpu-1", slot=1, state=ReplicaState.STOPPING),  # slot 1: queued again
                rrow("m0", "m", "cpu-16c-64g", "cpu-1"),
                rrow("m0c", "m", "l40s-48gb", "gpu-l40s-1", state=ReplicaState.STARTING, role=ReplicaRole.CANDIDATE)]
    snap = snapshot.take(fleet(), replicas, rows, CATALOG, region="local")
    assert {q.id: q.fallback for q in snap.queue} == {"q/0": ("cpu",), "req/0": (), "r/1": ("cpu",), "r/2": ("cpu",)}
    assert {r.id: r.moving for r in snap.running} == {"r/0": False, "m/0": True}
    assert set(snap.workloads) == {"q", "req", "gone", "r", "m"}
    free = {c.cls: c.fits for c in snap.capacity.summary("local")}
    assert free["l40s-48gb"] == 0 and free["a100-80gb"] == 1  # the candidate holds the L40S


def test_quotas_count_the_larger_replica_of_a_slot_and_ignore_a_bad_override() -> None:
    held = [HeldReplica("alice", "w", 0, "cpu-16c-64g"), HeldReplica("alice", "w", 0, "l40s-48gb"),
            HeldReplica("alice", "v", 0, "l40s-48gb"), HeldReplica("bob", "x", 0, "no-such-class")]
    q = snapshot.owner_quotas(Quotas(), {"alice": {"running_gpus": 3}, "bob": {"running_gpus": "many"}}, held,
                              CATALOG)
    assert q.by_owner["alice"].running_gpus == 3 and "bob" not in q.by_owner
    assert q.held["alice"][0] == 2 and "bob" not in q.held


# -- the two ledgers --------------------------------------------------------------------------

@pytest.fixture
def sqlite(tmp_path: Any) -> Iterator[Database]:
    db = Database(str(tmp_path / "t.db"))
    db.migrate()
    yield db
    db.dispose()


def _store_row(w: WorkloadRow) -> dict[str, Any]:
    return {**{k: getattr(w, k) for k in WORKLOAD_COLUMNS}, "fallback": list(w.fallback), "name": w.id,
            "spec": {}, "model": None, "restart_reason": ""}


def _ledger_script(ledger: Ledger) -> list[bool]:
    """The conditional writes reconcile and apply rely on, in one order."""
    return [
        ledger.update_workload("a", {"state": WorkloadState.STARTING}, expect_state=WorkloadState.RUNNING),
        ledger.update_workload("a", {"state": WorkloadState.STARTING}, expect_state=WorkloadState.QUEUED),
        ledger.update_workload("a", {"updated_at": T0 + 1}, expect_state=WorkloadState.STARTING, live_only=True),
        ledger.update_workload("gone", {"updated_at": T0 + 1}, expect_state=WorkloadState.QUEUED, live_only=True),
        ledger.update_workload("gone", {"reason": "x"}, expect_state=WorkloadState.QUEUED),
        ledger.update_workload("nobody", {"reason": "x"}),
    ]


def test_the_memory_ledger_writes_as_the_store_does(sqlite: Database) -> None:
    """The plan's ledger is a double of the store's: the same script gives the same answers and rows."""
    rows = [wrow("a"), wrow("gone", deleted_at=T0)]
    memory = MemoryLedger({w.id: w for w in rows})
    with sqlite.write() as conn:
        for w in rows:
            workloads_repo.insert_workload(conn, _store_row(w))
        stored = _ledger_script(StoreLedger(conn))
        waits = [("a", "waiting", None), ("gone", "waiting", T0)]
        StoreLedger(conn).set_wait_reasons(waits)
        read = {w.id: w for w in workloads_repo.workloads_by_id_or_state(conn, ["a", "gone"], "local", ())}
    assert _ledger_script(memory) == stored == [False, True, True, False, True, False]
    memory.set_wait_reasons(waits)
    assert read == memory.workloads


# -- reconcile + apply: a move back, step by step ------------------------------------------------

def test_a_move_back_goes_candidate_then_primary_while_the_old_replica_drains() -> None:
    """An endpoint on CPU; the L40S frees: apply records a candidate (starting), reconcile makes it the
    primary once ready and drains the CPU replica, which stops after drain_s."""
    clock = FakeClock(T0)
    driver = SimulatedDriver(fleet(), clock, start_delay_s=30)
    ep = wrow("ep", WorkloadState.RUNNING, placed_class="cpu-16c-64g")
    old = rrow("old", "ep", "cpu-16c-64g", "cpu-1")
    ledger = MemoryLedger({"ep": ep}, {"old": old})
    driver.start(ReplicaSpec("old", "ep", WorkloadKind.ENDPOINT, "cpu-16c-64g", "cpu-1"))
    clock.advance(30)

    def cycle() -> None:
        now = clock.now()
        done = reconcile(ledger, list(ledger.workloads.values()), ledger.active(),
                         {s.id: s for s in driver.observe()}, now, drain_s=5.0)
        for rid in done.stop:
            driver.stop(rid)
        snap = snapshot.take(driver.nodes(), ledger.active(), list(ledger.workloads.values()), CATALOG)
        applied = apply(ledger, decide(snap.queue, snap.capacity, snap.running, now), snap.workloads, now)
        for w, r in applied.start:
            driver.start(ReplicaSpec(r.id, w.id, w.kind, r.cls, r.node))

    def roles() -> dict[str, tuple[ReplicaRole, ReplicaState]]:
        return {r.cls: (r.role, r.state) for r in ledger.replicas.values()}

    cycle()  # the L40S is free: a candidate starts there, the CPU replica still serves
    assert roles() == {"cpu-16c-64g": (ReplicaRole.PRIMARY, ReplicaState.RUNNING),
                       "l40s-48gb": (ReplicaRole.CANDIDATE, ReplicaState.STARTING)}
    cycle()  # not ready yet: no second candidate (admission sees the move under way)
    assert len(ledger.replicas) == 2
    clock.advance(30)
    cycle()  # ready: it is the primary, the CPU replica drains
    assert roles() == {"cpu-16c-64g": (ReplicaRole.DRAINING, ReplicaState.RUNNING),
                       "l40s-48gb": (ReplicaRole.PRIMARY, ReplicaState.RUNNING)}
    assert ledger.workloads["ep"].placed_class == "l40s-48gb"
    clock.advance(5)
    cycle()  # drained: stopped
    cycle()
    assert roles()["cpu-16c-64g"] == (ReplicaRole.DRAINING, ReplicaState.STOPPED)
    assert [e.type for e in ledger.events] == [EventType.MOVING, EventType.MOVED, EventType.DRAINED]
