"""The controller's admission state, fed the store's changes (SQLite and PostgreSQL).

Every cycle here is checked against the full-snapshot path: a full snapshot of the store and ``decide`` from
scratch, asked the same question at the same moment (after reconcile, before apply). Placements and
moves must be the same, in the same order, and every wait and restart offer that stands in the kept
state must be decide's. An idle cycle reads a watermark and no workload row; a restart and a lost
lease rebuild the state once; a PostgreSQL transaction that commits after a later one is not missed.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import event, text

from tensora.config.catalog import default_catalog
from tensora.control import workloads
from tensora.control.controller import Controller
from tensora.control.spec import parse_spec
from tensora.control.tracker import AdmissionTracker, Cycle, from_scratch
from tensora.drivers.simulated import SimulatedDriver
from tensora.placement.admission import Decision, Place, Promote, RestartAvailable, Wait
from tensora.placement.admission_state import Event
from tensora.store import owners as owners_repo
from tensora.store import workloads as workloads_repo
from tensora.store.db import Database
from tensora.store.rows import WorkloadRecord
from tests.support.clock import FakeClock
from tests.support.stack import T0, fleet

CATALOG = default_catalog()



@dataclass
class Checked:
    """A controller whose every admission step is compared with ``decide`` on a full snapshot."""

    c: Controller
    driver: SimulatedDriver
    compare: bool = True
    """False: no full snapshot is read (to count what the controller alone reads)."""
    steps: int = 0
    rebuilds: int = 0
    last: Cycle | None = None

    def cycle(self, advance: float = 2.0) -> Cycle:
        self.c.clock.advance(advance)  # type: ignore[attr-defined]  # a FakeClock
        before = self.steps
        assert self.c.run_once().leader
        assert self.steps == before + 1 and self.last is not None
        return self.last


def checked(db: Database, clock: FakeClock, driver: SimulatedDriver | None = None, holder: str = "a",
            lease_ttl_s: float = 15) -> Checked:
    sim = driver or SimulatedDriver(fleet(), clock)
    c = Controller(db, sim, CATALOG, clock=clock, holder=holder, lease_ttl_s=lease_ttl_s)
    out = Checked(c, sim)
    tracker: AdmissionTracker = c.tracker
    real_step, real_read = tracker.step, tracker.read

    def read(conn: Any, nodes: Any) -> Any:
        fed = real_read(conn, nodes)
        out.rebuilds += fed.rebuilt
        return fed

    def step(events: list[Event], now: float) -> Cycle:
        got = _compared(events, now) if out.compare else real_step(events, now)
        out.steps += 1
        out.last = got
        return got

    def _compared(events: list[Event], now: float) -> Cycle:
        with db.read() as conn:  # the full-snapshot path, on the store as this cycle's step sees it
            _, want = from_scratch(conn, sim.nodes(), CATALOG, c.region, c.policy, c.owner_defaults.quotas, now)
        got = real_step(events, now)
        assert _moves(got.decisions) == _moves(want)
        assert tracker.admission is not None
        standing = {_key(d): _settled(d) for d in tracker.admission.decisions()}
        assert standing == {_key(d): _settled(d) for d in want if isinstance(d, Wait | RestartAvailable)}
        assert got.waiting == sum(1 for d in want if isinstance(d, Wait))
        return got

    tracker.read, tracker.step = read, step  # type: ignore[method-assign]
    return out


def _moves(ds: list[Decision]) -> list[Decision]:
    return [d for d in ds if isinstance(d, Place | Promote)]


def _key(d: Decision) -> tuple[str, str]:
    return (type(d).__name__, d.workload.id)


def _settled(d: Decision) -> Decision:
    return replace(d, now=0.0) if isinstance(d, Wait) else d


def submit(db: Database, clock: FakeClock, owner: str = "alice", **body: Any) -> str:
    with db.write() as conn:
        checked_spec = workloads.validate(parse_spec(body), CATALOG, owner, None)
        return str(workloads.create(conn, checked_spec, clock.now()).id)


def get(db: Database, wid: str) -> WorkloadRecord:
    with db.read() as conn:
        w = workloads_repo.get_workload(conn, wid, include_deleted=True)
        assert w is not None
        return w


def set_quotas(db: Database, owner: str, quotas: dict[str, Any] | None, at: float) -> None:
    with db.write() as conn:  # as PUT /v1/owners/{owner} does
        owners_repo.owner_for_update(conn, owner, at)
        owners_repo.write_owner(conn, owner, {"quotas": quotas, "updated_at": at})


@dataclass
class World:
    db: Database
    clock: FakeClock
    run: Checked
    ids: dict[str, str]


def world(db: Database) -> World:
    """The ADR's fleet, full: an L40S notebook, an A100 notebook, an endpoint on CPU (it wants an L40S), and a
    queue behind them."""
    clock = FakeClock(T0)
    run = checked(db, clock)
    ids = {"l40s": submit(db, clock, kind="notebook", name="holds-l40s", gpu_class="l40s-48gb"),
           "a100": submit(db, clock, owner="bob", kind="notebook", name="holds-a100", gpu_class="a100-80gb")}
    run.cycle()
    run.cycle()
    ids["ep"] = submit(db, clock, owner="carol", kind="endpoint", name="ep", gpu_class="l40s-48gb",
                       fallback=["cpu"], fallback_after="0", model_params="1B")
    ids["wait-l40s"] = submit(db, clock, kind="notebook", name="wait-l40s", gpu_class="l40s-48gb")
    ids["wait-a100"] = submit(db, clock, owner="bob", kind="notebook", name="wait-a100", gpu_class="a100-80gb",
                              fallback=["l40s-48gb"], fallback_after="10m")
    for _ in range(3):
        run.cycle()
    assert get(db, ids["ep"]).state == "running"
    return World(db, clock, run, ids)


def _stop(w: World, name: str) -> None:
    with w.db.write() as conn:
        workloads.stop(conn, get(w.db, w.ids[name]), w.clock.now())


def _fail_primary(w: World, name: str) -> None:
    with w.db.read() as conn:
        r = workloads_repo.replicas_of(conn, [w.ids[name]])[0]
    w.run.driver.fail(r.id, "OOM killed")


def _cordon_and_free(w: World, node: str, holder: str) -> None:
    """The node is cordoned as its holder stops: the GPU it frees is for nobody."""
    w.run.driver.set_schedulable(node, False)
    _stop(w, holder)


CASES: dict[str, tuple[Callable[[World], None], Callable[[World], bool]]] = {
    "a create -> it waits in the state": (
        lambda w: w.ids.__setitem__("new", submit(w.db, w.clock, kind="notebook", name="new", gpu_class="a100-80gb")),
        lambda w: get(w.db, w.ids["new"]).reason.startswith("waiting for a100-80gb")),
    "a stop -> its GPU goes to the queue": (
        lambda w: _stop(w, "l40s"),
        lambda w: get(w.db, w.ids["wait-l40s"]).state in ("starting", "running")),
    "a replica failing -> its slot is queued again": (
        lambda w: _fail_primary(w, "a100"),
        lambda w: get(w.db, w.ids["a100"]).state == "failed"),
    "a node cordoned -> nothing placed on it": (
        lambda w: _cordon_and_free(w, "gpu-a100-1", "a100"),
        lambda w: get(w.db, w.ids["wait-a100"]).state == "queued"),
    "a quota changed -> the owner's waits say it": (
        lambda w: set_quotas(w.db, "alice", {"running_gpus": 0}, w.clock.now()),
        lambda w: "owner quota" in get(w.db, w.ids["wait-l40s"]).reason),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_a_change_reaches_the_state_and_it_decides_as_a_full_snapshot_would(
        db: Database, case: tuple[Callable[[World], None], Callable[[World], bool]]) -> None:
    change, then = case
    w = world(db)
    assert not w.run.cycle().decided  # settled: nothing new, nothing re-decided
    change(w)
    assert w.run.cycle().decided  # the change reached the state
    for _ in range(3):
        w.run.cycle()
    assert then(w)
    assert w.run.rebuilds == 1  # once, on the first cycle


def test_a_quota_taken_back_returns_the_owner_to_the_defaults(db: Database) -> None:
    w = world(db)
    set_quotas(db, "alice", {"running_gpus": 0}, w.clock.now())
    w.run.cycle()
    set_quotas(db, "alice", None, w.clock.now())
    assert w.run.cycle().decided
    assert "owner quota" not in get(db, w.ids["wait-l40s"]).reason


def test_an_idle_cycle_reads_a_watermark_and_no_workload_row(db: Database) -> None:
    """200 queued: the cycle's statements name no queued workload (the reconcile step reads the workloads that
    hold replicas, by id), and it decides nothing."""
    w = world(db)
    for i in range(200):
        submit(db, w.clock, owner=f"o{i % 7}", kind="notebook", name=f"q{i}", gpu_class="l40s-48gb")
    w.run.cycle()
    w.run.cycle()
    statements: list[tuple[str, Any]] = []

    def seen(conn: Any, cursor: Any, statement: str, params: Any, context: Any, many: bool) -> None:
        statements.append((" ".join(statement.split()), params))

    w.run.compare = False
    event.listen(db.engine, "before_cursor_execute", seen)
    try:
        got = w.run.cycle()
    finally:
        event.remove(db.engine, "before_cursor_execute", seen)
        w.run.compare = True
    assert (got.decisions, got.to_apply, got.decided) == ([], [], False)
    assert got.waiting == 202  # the ones queued before, and the 200
    reads = [s for s, _ in statements if s.startswith("SELECT") and "FROM workloads" in s]
    probe = [s for s in reads if "EXISTS" in s and "rev >=" in s]
    holders = [s for s in reads if "workloads.id IN" in s and "workloads.state IN" in s]  # reconcile's, by id
    deleted = [s for s in reads if "workloads.deleted_at IS NOT NULL" in s]  # housekeeping's, now and then
    assert len(probe) == 1 and len(holders) == 1
    assert sorted(reads) == sorted(probe + holders + deleted), reads
    assert len(statements) < 20
    assert not w.run.cycle().decided  # and it agrees with a full snapshot still


def test_a_new_controller_rebuilds_once_and_decides_the_same(db: Database) -> None:
    w = world(db)
    w.run.c.stop(release=True)
    again = checked(db, w.clock, w.run.driver, holder="b")
    for _ in range(3):
        again.cycle()
    assert again.rebuilds == 1
    submit(db, w.clock, kind="notebook", name="after", gpu_class="cpu-2c-8g")
    assert again.cycle().decided
    assert again.rebuilds == 1


def test_a_lost_lease_drops_the_state_and_leading_again_rebuilds_it(db: Database) -> None:
    w = world(db)
    other = checked(db, w.clock, w.run.driver, holder="b")
    w.clock.advance(16)  # a's lease expires; b takes it
    assert other.c.run_once().leader
    assert not w.run.c.run_once().leader
    assert w.run.c.tracker.admission is None
    mine = submit(db, w.clock, kind="notebook", name="meanwhile", gpu_class="cpu-2c-8g")
    other.c.stop(release=True)
    w.run.cycle()
    assert w.run.rebuilds == 2
    assert get(db, mine).state in ("starting", "running")


def test_a_lease_that_lapsed_unseen_is_taken_again_with_a_rebuilt_state(db: Database) -> None:
    """Paused past its lease (another could have led meanwhile, and written what no stamp shows, such as a
    wait's reason), a controller that takes the lease again rebuilds rather than trust what it kept."""
    w = world(db)
    w.run.cycle(advance=16)
    assert w.run.rebuilds == 2
    w.run.cycle()
    assert w.run.rebuilds == 2


def test_a_failed_cycle_drops_the_state(db: Database, monkeypatch: pytest.MonkeyPatch) -> None:
    w = world(db)

    def broken(*_: Any) -> None:
        raise RuntimeError("the store went away mid-cycle")

    monkeypatch.setattr(w.run.c, "_specs", broken)
    submit(db, w.clock, kind="notebook", name="x", gpu_class="cpu-2c-8g")  # a start: _specs is asked
    with pytest.raises(RuntimeError):
        w.run.c.run_once()
    assert w.run.c.tracker.admission is None
    monkeypatch.undo()
    w.run.cycle()
    assert w.run.rebuilds == 2


def test_postgresql_a_transaction_that_commits_after_a_later_one_is_not_missed(db: Database) -> None:
    """Transaction ids are taken in start order: A (older id) writes, B (newer) writes and commits, a cycle
    runs, then A commits. A has the lower ``rev`` but was invisible to the cycle that saw B; the next cycle
    must still see it."""
    if db.is_sqlite:
        pytest.skip("SQLite's writers take turns: a later writer cannot commit first")
    w = world(db)
    late = db.engine.connect()
    txn = late.begin()
    try:
        spec = workloads.validate(parse_spec({"kind": "notebook", "name": "late", "gpu_class": "cpu-2c-8g"}),
                                  CATALOG, "alice", None)
        a = workloads.create(late, spec, w.clock.now()).id
        done = threading.Event()

        def later() -> None:
            # another owner's: one owner's creates take turns (its names), two owners' do not
            submit(db, w.clock, owner="bob", kind="notebook", name="early", gpu_class="cpu-2c-8g")
            done.set()

        threading.Thread(target=later).start()
        assert done.wait(10)  # B did not wait for A: no lock between them
        w.run.cycle()  # sees B, not A
        txn.commit()
    finally:
        late.close()
    with db.read() as conn:
        revs = dict(conn.execute(text("SELECT name, rev FROM workloads WHERE name IN ('late', 'early')")).all())
    assert revs["late"] < revs["early"]
    w.run.cycle()  # from_scratch sees A: the kept state must too (its wait, or its placement)
    w.run.cycle()
    assert get(db, a).state in ("starting", "running")


# -- random histories ---------------------------------------------------------------------------

ACTIONS = ["create", "create", "endpoint", "stop", "restart", "delete", "fail", "cordon", "uncordon", "quota",
           "time", "idle"]


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(history=st.lists(st.tuples(st.sampled_from(ACTIONS), st.integers(0, 1000)), min_size=1, max_size=14))
def test_random_histories_decide_as_a_full_snapshot_would(request: pytest.FixtureRequest, backend: str,
                                                          tmp_path_factory: pytest.TempPathFactory,
                                                          history: list[tuple[str, int]]) -> None:
    """Creates, stops, restarts, deletes, failures, cordons, quotas and time, in any order: after each, a
    cycle; every cycle's step is compared with ``decide`` on a full snapshot (``checked``). A fresh store each."""
    url = (str(tmp_path_factory.mktemp("history") / "t.db") if backend == "sqlite"
           else request.getfixturevalue("pg").new_database())
    database = Database(url)
    database.migrate()
    try:
        _history(database, history)
    finally:
        database.dispose()


def _history(db: Database, history: list[tuple[str, int]]) -> None:
    clock = FakeClock(T0)
    # a lease longer than any step of time: timers come due in the kept state, not in a rebuild
    run = checked(db, clock, SimulatedDriver(fleet(), clock, start_delay_s=4), lease_ttl_s=3600)
    classes = ["l40s-48gb", "a100-80gb", "cpu-4c-16g"]
    fallbacks: list[list[str]] = [[], ["cpu"], ["a100-80gb", "cpu"], ["l40s-48gb"]]
    made: list[str] = []
    for n, (what, r) in enumerate(history):
        owner = "abc"[r % 3]
        with db.read() as conn:
            live = [w for w in workloads_repo.workloads_in(conn, "local", ["queued", "starting", "running"])
                    if w.deleted_at is None]
            held = workloads_repo.active_replicas(conn, "local")
        if what in ("create", "endpoint"):
            body: dict[str, Any] = {"kind": "notebook" if what == "create" else "endpoint", "name": f"w{n}",
                                    "gpu_class": classes[r % 3], "fallback": fallbacks[r % 4],
                                    "fallback_after": ["0", "60s", "10m"][r % 3]}
            if what == "endpoint":
                body.update(model_params="1B", replicas=1 + r % 2)
            if classes[r % 3] in body["fallback"]:
                body["fallback"] = []
            made.append(submit(db, clock, owner=owner, **body))
        elif what in ("stop", "restart", "delete") and live:
            w = get(db, live[r % len(live)].id)
            with db.write() as conn:
                if what == "stop":
                    workloads.stop(conn, w, clock.now())
                elif what == "delete":
                    workloads.delete(conn, w, clock.now())
                elif w.state != "stopping":
                    workloads.restart(conn, w, clock.now(), "requested" if r % 2 else "policy")
        elif what == "fail" and held:
            replica = held[r % len(held)]
            if replica.id in {s.id for s in run.driver.observe()}:
                run.driver.fail(replica.id, "OOM killed")
        elif what in ("cordon", "uncordon"):
            run.driver.set_schedulable(fleet()[r % 3].name, what == "uncordon")
        elif what == "quota":
            set_quotas(db, owner, None if r % 3 == 0 else {"running_gpus": r % 2, "running_cpu": 8 * (r % 3)},
                       clock.now())
        run.cycle(advance=float(r % 700) if what == "time" else 2.0)
    run.cycle()
    assert run.rebuilds == 1
