"""The controller on a fake clock, against the real store (SQLite and PostgreSQL):
the ADR's example and its event sentences, move back, restart on GPU, failover and crashes."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import pytest

from tensora.clock import SystemClock
from tensora.control import snapshot, workloads
from tensora.control.controller import Controller
from tensora.control.spec import parse_spec
from tensora.drivers.simulated import SimulatedDriver
from tensora.placement.capacity import Node
from tensora.store import events as events_repo
from tensora.store import leases as leases_repo
from tensora.store import nodes as nodes_repo
from tensora.store import usage as usage_repo
from tensora.store import workloads as workloads_repo
from tensora.store.db import Database
from tensora.store.rows import WORKLOAD_COLUMNS
from tensora.store.tables import O
from tests.support.clock import FakeClock
from tests.support.controller import CATALOG, events, get, make, replicas, segments, submit, view
from tests.support.doubles import Crash, CrashingDriver, FlakyRelease
from tests.support.stack import GI, T0, fleet


def test_adr_example_l40s_then_a100_then_cpu_after_10m_and_back(db: Database) -> None:
    clock = FakeClock(T0)
    c, _ = make(db, clock, start_delay_s=30)
    l40s_user = submit(db, clock, owner="carol", kind="notebook", name="holds-l40s", gpu_class="l40s-48gb")
    a100_user = submit(db, clock, owner="dave", kind="notebook", name="holds-a100", gpu_class="a100-80gb")
    c.run_once()
    ep = submit(db, clock, owner="alice", kind="endpoint", name="chat", gpu_class="l40s-48gb",
                fallback=["a100-80gb", "cpu"], fallback_after="10m", model_params="7B")
    c.run_once()
    w = get(db, ep)
    assert w.state == "queued"
    assert w.reason == ("waiting for l40s-48gb (0 GPU free, 1 needed); fallback to a100-80gb, cpu from 08:10:00")

    clock.advance(599)
    c.run_once()
    assert get(db, ep).state == "queued"

    clock.advance(1)
    report = c.run_once()
    assert report.placed == 1
    w = get(db, ep)
    assert (w.state, w.placed_class, w.requested_class) == ("starting", "cpu-16c-64g", "l40s-48gb")
    placed_reason = ("placed on cpu-16c-64g: l40s-48gb unavailable for 10m; "
                     "also tried a100-80gb (0 GPU free, 1 needed)")
    assert w.reason == placed_reason

    clock.advance(30)
    c.run_once()
    v = view(db, ep)
    assert v["state"] == "running"
    assert v["conditions"][0]["type"] == "degraded" and v["conditions"][0]["reason"] == "cpu_fallback"
    assert "10-50x slower" in v["warning"]

    # the L40S frees: the endpoint moves back by itself (start, ready, shift, stop)
    with db.write() as conn:
        workloads.stop(conn, get(db, l40s_user), clock.now())
    c.run_once()
    c.run_once()
    v = view(db, ep)
    assert v["state"] == "running" and [x["type"] for x in v["conditions"]] == ["degraded", "moving"]
    assert sorted((r.cls, r.role) for r in replicas(db, ep)) == [("cpu-16c-64g", "primary"),
                                                                     ("l40s-48gb", "candidate")]
    clock.advance(30)
    c.run_once()
    v = view(db, ep)
    assert (v["state"], v["placed_class"], v["conditions"]) == ("running", "l40s-48gb", [])
    # the old replica is out of the routes but keeps serving what is in flight for drain_s, then stops
    assert sorted((r["class"], r["role"], r["state"]) for r in v["replicas"]) == [
        ("cpu-16c-64g", "draining", "running"), ("l40s-48gb", "primary", "running")]
    clock.advance(4.9)
    c.run_once()
    assert ("cpu-16c-64g", "draining", "running") in [(r["class"], r["role"], r["state"]) for r in view(db, ep)[
        "replicas"]]
    clock.advance(0.1)
    c.run_once()
    c.run_once()
    assert [(r["class"], r["role"]) for r in view(db, ep)["replicas"]] == [("l40s-48gb", "primary")]

    assert events(db, ep) == [
        "created: queued for l40s-48gb; fallback to a100-80gb, cpu after 600s",
        placed_reason,
        "running on cpu-16c-64g at cpu-1",
        "moving back to l40s-48gb from cpu-16c-64g: l40s-48gb has capacity again",
        "moved back to l40s-48gb: replica ready at gpu-l40s-1, traffic shifted, draining the cpu-16c-64g replica "
        "(5 s for requests in flight)",
        "drained: stopping the cpu-16c-64g replica at cpu-1",
    ]
    # usage by placed_class: the move split the endpoint's time in two segments
    mine = [(s.placed_class, s.started_at - T0, None if s.ended_at is None else s.ended_at - T0)
            for s in segments(db) if s.workload_id == ep]
    assert mine == [("cpu-16c-64g", 600.0, 665.0), ("l40s-48gb", 630.0, None)]
    assert get(db, a100_user).state == "running"


def test_freed_gpu_goes_to_its_requester_before_a_move_back(db: Database) -> None:
    clock = FakeClock(T0)
    c, _ = make(db, clock)
    holder = submit(db, clock, owner="carol", kind="notebook", name="holds", gpu_class="l40s-48gb")
    c.run_once()
    ep = submit(db, clock, kind="endpoint", name="chat", gpu_class="l40s-48gb", fallback=["cpu"],
                fallback_after=0, model_params="1B")
    c.run_once()
    c.run_once()
    assert get(db, ep).placed_class == "cpu-16c-64g"
    waiter = submit(db, clock, owner="bob", kind="notebook", name="wants-l40s", gpu_class="l40s-48gb")
    c.run_once()
    with db.write() as conn:
        workloads.stop(conn, get(db, holder), clock.now())
    c.run_once()
    c.run_once()
    assert get(db, waiter).placed_class == "l40s-48gb"
    assert get(db, ep).placed_class == "cpu-16c-64g"
    assert [r.role for r in replicas(db, ep)] == ["primary"]


def test_notebook_on_cpu_is_offered_restart_on_gpu_and_never_moves_by_itself(db: Database) -> None:
    clock = FakeClock(T0)
    c, _ = make(db, clock)
    holder = submit(db, clock, owner="carol", kind="notebook", name="holds", gpu_class="l40s-48gb")
    c.run_once()
    nb = submit(db, clock, kind="notebook", name="nb", gpu_class="l40s-48gb", fallback=["cpu"], fallback_after=0)
    c.run_once()
    c.run_once()
    cpu_replica = replicas(db, nb)[0]
    assert (get(db, nb).state, cpu_replica.cls) == ("running", "cpu-16c-64g")
    with db.write() as conn:
        workloads.stop(conn, get(db, holder), clock.now())
    c.run_once()
    c.run_once()
    w = get(db, nb)
    assert w.restart_available and w.placed_class == "cpu-16c-64g"
    assert [r.id for r in replicas(db, nb)] == [cpu_replica.id]
    assert events(db, nb)[-1] == "l40s-48gb has capacity again: restart on it to leave cpu-16c-64g"

    with db.write() as conn:
        workloads.restart(conn, get(db, nb), clock.now(), "requested")
    c.run_once()
    c.run_once()
    w = get(db, nb)
    assert (w.state, w.placed_class, w.restart_available) == ("running", "l40s-48gb", False)
    assert [r.cls for r in replicas(db, nb)] == ["l40s-48gb"]
    assert [s.placed_class for s in segments(db) if s.workload_id == nb] == ["cpu-16c-64g", "l40s-48gb"]


@dataclass
class Sentence:
    body: dict[str, Any]
    late_s: float  # how long after the fallback timer the cycle runs
    want: str
    tick_s: float = 2.0
    hold: list[str] = field(default_factory=lambda: ["l40s-48gb"])


SENTENCES = {
    "fallback_after 0, the cycle 0.6s after submission -> says the policy (was: 'for 1s')": Sentence(
        {"fallback": ["cpu"], "fallback_after": 0}, 0.6,
        "placed on cpu-16c-64g: l40s-48gb unavailable (fallback after 0s)"),
    "fallback_after 10m, the timer noticed a tick late -> the ADR's 'for 10m'": Sentence(
        {"fallback": ["cpu"], "fallback_after": "10m"}, 1.9,
        "placed on cpu-16c-64g: l40s-48gb unavailable for 10m"),
    "a slow tick widens the slack: 25s late on a 30s tick is still 10m": Sentence(
        {"fallback": ["cpu"], "fallback_after": "10m"}, 25, "placed on cpu-16c-64g: l40s-48gb unavailable for 10m",
        tick_s=30),
    "the GPU class tried before CPU is named": Sentence(
        {"fallback": ["a100-80gb", "cpu"], "fallback_after": "90s"}, 0.3,
        "placed on cpu-16c-64g: l40s-48gb unavailable for 1m30s; also tried a100-80gb (0 GPU free, 1 needed)",
        hold=["l40s-48gb", "a100-80gb"]),
}


@pytest.mark.parametrize("case", SENTENCES.values(), ids=SENTENCES.keys())
def test_the_placement_sentence_states_the_policy_not_the_loops_latency(db: Database, case: Sentence) -> None:
    clock = FakeClock(T0)
    c = Controller(db, SimulatedDriver(fleet(), clock), CATALOG, clock=clock, holder="a", tick_s=case.tick_s)
    for i, cls in enumerate(case.hold):
        submit(db, clock, owner="carol", kind="notebook", name=f"holds-{i}", gpu_class=cls)
    c.run_once()
    nb = submit(db, clock, kind="notebook", name="nb", gpu_class="l40s-48gb", **case.body)
    clock.advance(get(db, nb).fallback_after_s + case.late_s)
    c.run_once()
    w = get(db, nb)
    assert (w.state, w.reason) == ("starting", case.want)
    assert events(db, nb)[-1] == case.want  # the event says the same sentence


def test_a_stopped_workload_says_it_stopped_and_a_restart_brings_the_placement_back(db: Database) -> None:
    clock = FakeClock(T0)
    c, _ = make(db, clock)
    submit(db, clock, owner="carol", kind="notebook", name="holds", gpu_class="l40s-48gb")
    c.run_once()
    nb = submit(db, clock, kind="notebook", name="nb", gpu_class="l40s-48gb", fallback=["cpu"], fallback_after=0)
    c.run_once()
    c.run_once()
    placed = "placed on cpu-16c-64g: l40s-48gb unavailable (fallback after 0s)"
    assert (get(db, nb).state, get(db, nb).reason) == ("running", placed)

    with db.write() as conn:
        workloads.stop(conn, get(db, nb), clock.now())
    assert (get(db, nb).state, get(db, nb).reason) == ("stopping", "stopped by its owner")
    c.run_once()
    c.run_once()
    assert (get(db, nb).state, get(db, nb).reason) == ("stopped", "stopped by its owner")
    assert view(db, nb)["conditions"] == []  # not degraded while stopped

    clock.advance(60)
    with db.write() as conn:
        workloads.restart(conn, get(db, nb), clock.now(), "policy")
    assert (get(db, nb).state, get(db, nb).reason) == ("queued", "queued for l40s-48gb")
    c.run_once()
    assert (get(db, nb).state, get(db, nb).reason) == ("starting", placed)
    assert [e for e in events(db, nb) if e.startswith(("stopping", "stopped", "queued:", "placed"))] == [
        placed, "stopping: stop requested by its owner", "stopped: all replicas stopped",
        "queued: restart requested with its placement policy", placed]


INSTALLING = "installing runtime tensora-transformers: unpacking 48 packages into the environment (step 3 of 3)"


def test_an_install_step_is_the_reason_while_it_lasts_and_the_placement_comes_back(db: Database) -> None:
    clock = FakeClock(T0)
    c, driver = make(db, clock, start_delay_s=30)
    submit(db, clock, owner="carol", kind="notebook", name="holds", gpu_class="l40s-48gb")
    c.run_once()
    ep = submit(db, clock, kind="endpoint", name="ep", gpu_class="l40s-48gb", fallback=["cpu"], fallback_after=0,
                model_params="1B", replicas=2)
    c.run_once()
    placed = view(db, ep)["reason"]
    assert placed.startswith("placed on cpu-") and placed.endswith("l40s-48gb unavailable (fallback after 0s)")
    first, second = sorted(replicas(db, ep), key=lambda r: r.slot)
    driver.wait_on(first.id, INSTALLING)
    c.run_once()
    assert (view(db, ep)["state"], view(db, ep)["reason"]) == ("starting", INSTALLING)
    clock.advance(30)  # installed; both replicas run
    c.run_once()
    assert (view(db, ep)["state"], view(db, ep)["reason"]) == ("running", placed)

    # a replica placed again while the other serves on: its install is its own, the workload's reason stays
    driver.fail(second.id, "XID 79")
    c.run_once()
    clock.advance(10)
    c.run_once()
    backing_off = "failed 1 time: XID 79; next try at 08:00:40"
    assert (view(db, ep)["state"], view(db, ep)["reason"]) == ("running", backing_off)
    again = next(r for r in replicas(db, ep) if r.slot == 1 and r.state == "starting")
    driver.wait_on(again.id, INSTALLING)
    c.run_once()
    assert (view(db, ep)["state"], view(db, ep)["reason"]) == ("running", backing_off)


def test_failed_replica_fails_a_notebook_and_requeues_an_endpoint(db: Database) -> None:
    clock = FakeClock(T0)
    c, driver = make(db, clock)
    nb = submit(db, clock, kind="notebook", name="nb", gpu_class="cpu-2c-8g")
    ep = submit(db, clock, kind="endpoint", name="ep", gpu_class="cpu-2c-8g", model_params="1B")
    c.run_once()
    c.run_once()
    driver.fail(replicas(db, nb)[0].id, "OOM killed")
    driver.fail(replicas(db, ep)[0].id, "XID 79")
    c.run_once()
    assert get(db, nb).state == "failed"
    assert events(db, nb)[-1] == "failed: replica on cpu-2c-8g at cpu-1: OOM killed"
    # the endpoint went back to the queue, and waits out its first back-off (10 s) before it is placed again
    assert events(db, ep)[-1] == "queued: its only replica (cpu-2c-8g at cpu-1) failed: XID 79"
    assert get(db, ep).reason == "failed 1 time: XID 79; next try at 08:00:10"
    clock.advance(10)
    c.run_once()
    assert get(db, ep).state == "starting"
    with db.read() as conn:  # placed again, identically: the first placement's event counts it
        assert [(e.reason, e.count) for e in events_repo.list_events(conn, ep) if e.reason.startswith("placed")] == [
            ("placed on cpu-2c-8g", 2)]
    c.run_once()
    assert get(db, ep).state == "running"
    assert len(replicas(db, ep, active_only=False)) == 2


def test_stop_and_delete_release_capacity_and_close_usage(db: Database) -> None:
    clock = FakeClock(T0)
    c, driver = make(db, clock)
    a = submit(db, clock, kind="notebook", name="a", gpu_class="a100-80gb")
    b = submit(db, clock, kind="notebook", name="b", gpu_class="a100-80gb")
    c.run_once()
    if get(db, a).state == "queued":  # same owner, same moment: the id breaks the tie
        a, b = b, a
    assert get(db, b).state == "queued"
    clock.advance(120)
    with db.write() as conn:
        workloads.delete(conn, get(db, a), clock.now())
    c.run_once()  # asks the driver to stop a's replica
    c.run_once()  # sees it stopped: a is stopped, the A100 is free, b is placed
    assert get(db, a).state == "stopped" and get(db, a).deleted_at is not None
    assert (get(db, b).state, get(db, b).placed_class) == ("starting", "a100-80gb")
    seg = [s for s in segments(db) if s.workload_id == a]
    assert [(s.started_at - T0, s.ended_at - T0) for s in seg] == [(0.0, 120.0)]
    assert all(s.state.value == "stopped" for s in driver.observe() if s.workload_id == a)


def test_a_deleted_workloads_storage_is_given_back_once_its_replicas_are_gone(db: Database) -> None:
    clock = FakeClock(T0)
    sim = FlakyRelease(fleet(), clock)
    c, _ = make(db, clock, sim)
    c.release_every = 1
    gone = submit(db, clock, kind="notebook", name="gone", gpu_class="cpu-1c-4g")
    kept = submit(db, clock, kind="notebook", name="kept", gpu_class="cpu-1c-4g")
    c.run_once()
    with db.write() as conn:
        workloads.stop(conn, get(db, kept), clock.now())  # stopped, not deleted: its home stays
        workloads.delete(conn, get(db, gone), clock.now())
    assert c.run_once().released == [] and sim.calls == []  # its replica is still stopping
    assert c.run_once().released == [] and sim.calls == [gone]  # gone now: given back, but that failed
    assert get(db, gone).released_at is None
    assert c.run_once().released == [gone]  # redone
    c.run_once()
    c.run_once()
    assert sim.calls == [gone, gone] and sim.released == [gone]  # once done, never asked again
    assert get(db, gone).released_at is not None and get(db, kept).released_at is None


def test_storage_is_given_back_round_robin_across_owners(db: Database) -> None:
    """One owner's churn cannot hold back another's: each round takes every owner's oldest first."""
    clock = FakeClock(T0)
    mallory = [submit(db, clock, "mallory", kind="notebook", name=f"m{i}", gpu_class="cpu-1c-4g") for i in range(60)]
    bob = [submit(db, clock, "bob", kind="notebook", name=f"b{i}", gpu_class="cpu-1c-4g") for i in range(3)]
    with db.write() as conn:
        for wid in mallory:  # mallory's deletes come first, and there are more than a round takes
            clock.advance(1)
            workloads.delete(conn, get(db, wid), clock.now())
        for wid in bob:
            clock.advance(1)
            workloads.delete(conn, get(db, wid), clock.now())
    with db.read() as conn:
        first = workloads_repo.unreleased(conn, "local", limit=8)
        assert workloads_repo.unreleased(conn, "local", limit=50)[:6] == [mallory[0], bob[0], mallory[1], bob[1],
                                                                 mallory[2], bob[2]]
    assert first == [mallory[0], bob[0], mallory[1], bob[1], mallory[2], bob[2], mallory[3], mallory[4]]
    c, _ = make(db, clock)
    c.release_every = 1
    released = c.run_once().released
    assert set(bob) <= set(released) and len(released) == 50  # bob's three in the first round


def test_only_the_lease_holder_acts_and_a_standby_takes_over_after_expiry(db: Database) -> None:
    clock = FakeClock(T0)
    sim = SimulatedDriver(fleet(), clock)
    a, _ = make(db, clock, sim, holder="a")
    b, _ = make(db, clock, sim, holder="b")
    assert a.run_once().leader
    first = submit(db, clock, kind="notebook", name="one", gpu_class="cpu-1c-4g")
    assert not b.run_once().leader
    assert get(db, first).state == "queued"  # b wrote nothing
    assert a.run_once().placed == 1
    # a dies without releasing the lease; b waits until it expires
    second = submit(db, clock, kind="notebook", name="two", gpu_class="cpu-1c-4g")
    clock.advance(14)
    assert not b.run_once().leader
    clock.advance(2)
    assert b.run_once().placed == 1
    assert get(db, second).state == "starting"
    # a comes back: it is not the leader any more, and even a stale belief in it cannot write (the fence)
    assert not a.run_once().leader
    third = submit(db, clock, kind="notebook", name="three", gpu_class="cpu-1c-4g")
    a._lead = lambda now: True  # type: ignore[method-assign]
    assert not a.run_once().leader
    assert get(db, third).state == "queued"
    assert b.run_once().placed == 1


@pytest.mark.parametrize("crash_at", ["after the commit, before the driver call", "inside the transaction"])
def test_a_crash_mid_cycle_loses_nothing_and_places_nothing_twice(db: Database, crash_at: str,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    clock = FakeClock(T0)
    sim = SimulatedDriver(fleet(), clock)
    if crash_at == "inside the transaction":
        real = usage_repo.open_segment
        calls = {"n": 0}

        def dying(*args: Any) -> None:
            calls["n"] += 1
            if calls["n"] == 2:
                raise Crash("killed while writing the second placement")
            real(*args)

        monkeypatch.setattr(usage_repo, "open_segment", dying)
        a, _ = make(db, clock, sim, holder="a")
    else:
        a, _ = make(db, clock, CrashingDriver(sim), holder="a")
    ids = [submit(db, clock, kind="notebook", name=f"w{i}", gpu_class="cpu-1c-4g") for i in range(3)]
    with pytest.raises(Crash):
        a.run_once()
    monkeypatch.undo()
    clock.advance(16)  # the dead leader's lease runs out
    b, _ = make(db, clock, sim, holder="b")
    b.run_once()
    b.run_once()
    for wid in ids:
        assert get(db, wid).state == "running"
        assert len(replicas(db, wid, active_only=False)) == 1
        assert len([s for s in sim.observe() if s.workload_id == wid]) == 1
    assert sum(1 for w in ids for e in events(db, w) if e.startswith("placed on")) == 3


def test_two_controllers_racing_for_real_never_place_a_workload_twice(db: Database) -> None:
    clock = SystemClock()
    sim = SimulatedDriver(fleet(), clock)
    controllers = [Controller(db, sim, CATALOG, clock=clock, holder=h, lease_ttl_s=0.2) for h in "ab"]
    ids = [submit(db, clock, kind="notebook", name=f"w{i}", gpu_class="cpu-1c-4g")  # type: ignore[arg-type]
           for i in range(20)]
    errors: list[BaseException] = []

    def spin(c: Controller) -> None:
        try:
            for _ in range(25):
                c.run_once()
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=spin, args=(c,)) for c in controllers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors
    for wid in ids:
        assert len(replicas(db, wid, active_only=False)) == 1, wid
    assert len(sim.observe()) == len(ids)


def test_a_new_workload_is_placed_at_once_not_at_the_next_tick(db: Database) -> None:
    import time

    clock = FakeClock(T0)
    c = Controller(db, SimulatedDriver(fleet(), clock), CATALOG, clock=clock, holder="a", tick_s=3600)
    c.start()
    try:
        deadline = time.monotonic() + 10
        while not c.is_leader():  # the first cycle, at start
            assert time.monotonic() < deadline
            time.sleep(0.01)
        wid = submit(db, clock, kind="notebook", name="now", gpu_class="cpu-1c-4g")
        c.wake()
        while get(db, wid).state == "queued":
            assert time.monotonic() < deadline, "not placed until the next tick (an hour away)"
            time.sleep(0.01)
        assert get(db, wid).placed_class == "cpu-1c-4g"
    finally:
        c.stop()
    with db.read() as conn:
        assert leases_repo.lease_holder(conn, "controller/local", clock.now()) is None  # released on a clean stop


# -- a cycle reads no queue's specs; owners' running quotas -------------------------------

def _endpoint(db: Database, clock: FakeClock, name: str, owner: str, model_path: str) -> str:
    """An endpoint whose row's spec holds ``model_path`` (what the API resolves an owner's model to)."""
    spec = parse_spec({"kind": "endpoint", "name": name, "gpu_class": "l40s-48gb", "model_params": "1B",
                       "spec": {"ttft_deadline_s": 5}})
    with db.write() as conn:
        return str(workloads.create(conn, workloads.Checked(spec, owner, model_path), clock.now()).id)


def test_a_cycle_reads_the_spec_only_of_what_it_starts(db: Database, monkeypatch: pytest.MonkeyPatch) -> None:
    clock = FakeClock(T0)
    c, sim = make(db, clock)
    ids = [_endpoint(db, clock, f"e{i}", f"owner{i}", f"/models/m{i}") for i in range(3)]  # one L40S for three
    read: list[set[str]] = []
    real = workloads_repo.workload_specs

    def spy(conn: Any, wids: Any) -> dict[str, dict[str, Any]]:
        read.append(set(wids))
        return real(conn, wids)

    monkeypatch.setattr(workloads_repo, "workload_specs", spy)
    c.run_once()
    c.run_once()
    assert read == [{ids[0]}]  # the placed one, once; never the two still queued (nor anything, starting nothing)
    with db.read() as conn:  # what the snapshot reads: rows that cannot hold a spec
        rows = workloads_repo.workloads_in(conn, "local", snapshot.LIVE)
    assert {w.id for w in rows} == set(ids) and "spec" not in WORKLOAD_COLUMNS
    assert [(s.workload_id, s.model) for s in sim.specs()] == [(ids[0], "/models/m0")]


def test_a_start_redone_after_a_crash_reads_its_spec(db: Database) -> None:
    clock = FakeClock(T0)
    sim = SimulatedDriver(fleet(), clock)
    a, _ = make(db, clock, CrashingDriver(sim), holder="a")
    wid = _endpoint(db, clock, "e", "alice", "/models/m")
    with pytest.raises(Crash):
        a.run_once()
    assert sim.specs() == []
    clock.advance(16)
    b, _ = make(db, clock, sim, holder="b")
    b.run_once()  # reconcile: recorded starting, unknown to the driver -> started now, with its spec
    assert [(s.workload_id, s.model) for s in sim.specs()] == [(wid, "/models/m")]


def _quotas(db: Database, owner: str, quotas: dict[str, Any]) -> None:
    with db.write() as conn:  # what PUT /v1/owners/{owner} stores: a partial dict over the defaults
        conn.execute(O.insert().values(owner=owner, trusted=False, updated_at=T0, quotas=quotas))


def test_owners_running_quotas_come_from_the_store_and_starting_replicas_count(db: Database) -> None:
    clock = FakeClock(T0)
    nodes = [Node("g1", "local", 64, 512 * GI, {"L40S": 4})]
    c, _ = make(db, clock, SimulatedDriver(nodes, clock, start_delay_s=60))
    _quotas(db, "alice", {"running_gpus": 1})
    first = submit(db, clock, kind="notebook", name="a1", gpu_class="l40s-48gb")
    c.run_once()
    assert get(db, first).state == "starting"
    second = submit(db, clock, owner="alice", kind="notebook", name="a2", gpu_class="l40s-48gb")
    bobs = [submit(db, clock, owner="bob", kind="notebook", name=f"b{i}", gpu_class="l40s-48gb") for i in range(3)]
    clock.advance(2)
    c.run_once()  # alice's first is still starting: it holds her one GPU all the same
    w = get(db, second)
    assert w.state == "queued"
    assert w.reason == "waiting for l40s-48gb (owner quota: 1 of 1 GPU in use); no fallback accepted"
    # bob has the server's default (2 GPUs): two of his start, the third waits; alice never held him up
    assert [get(db, b).state for b in bobs] == ["starting", "starting", "queued"]
    assert get(db, bobs[2]).reason.startswith("waiting for l40s-48gb (owner quota: 2 of 2 GPUs in use)")
    c.stop(release=False)
    with db.write() as conn:  # alice stops her first: her quota frees once its replica is gone, not before
        workloads.stop(conn, get(db, first), clock.now())
    clock.advance(2)
    c.run_once()
    assert (replicas(db, first)[0].state, get(db, second).state) == ("stopping", "queued")
    c.run_once()
    assert (replicas(db, first), get(db, second).state) == ([], "starting")


def test_a_bad_quotas_row_costs_its_owner_the_override_not_every_owner_the_cycle(db: Database) -> None:
    clock = FakeClock(T0)
    c, _ = make(db, clock)
    _quotas(db, "mallory", {"running_gpus": "lots", "running_cpu": [1]})
    _quotas(db, "alice", {"running_gpus": 0})
    theirs = submit(db, clock, owner="mallory", kind="notebook", name="m", gpu_class="l40s-48gb")
    mine = submit(db, clock, owner="alice", kind="notebook", name="a", gpu_class="a100-80gb")
    assert c.run_once().leader
    assert get(db, theirs).state == "starting"  # the defaults (2 GPUs) apply to mallory
    assert get(db, mine).reason == "waiting for a100-80gb (owner quota: no GPUs allowed); no fallback accepted"


def test_a_node_s_pod_limit_is_stored_and_counted(db: Database) -> None:
    """Its pods go through the nodes table (its labels: no new column) and each replica placed takes one."""
    clock = FakeClock(T0)
    c, _ = make(db, clock, SimulatedDriver([Node("c1", "local", 64, 256 * GI, pods=1)], clock))
    first = submit(db, clock, kind="notebook", name="one", gpu_class="cpu-1c-4g")
    second = submit(db, clock, kind="notebook", name="two", gpu_class="cpu-1c-4g")
    c.run_once()
    with db.read() as conn:
        [row] = nodes_repo.nodes_in(conn, "local")
    assert row.node() == Node("c1", "local", 64, 256 * GI, pods=1)
    assert get(db, first).state == "starting"
    assert get(db, second).reason == "waiting for cpu-1c-4g (0 pods free, 1 needed); no fallback accepted"
    c.stop(release=False)
