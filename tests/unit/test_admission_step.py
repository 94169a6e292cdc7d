"""The admission state kept across cycles decides what ``decide`` decides, cycle by cycle.

A world (nodes, replicas, running records, queue, quotas) lives here as plain collections; random
histories change it (submissions, stops, replicas ending, moves finishing, nodes joining, leaving and
cordoned, quota changes, time passing). After each batch, ``decide`` runs from scratch on the world and
``step`` takes the same batch as events: every Place and Promote must be the same (attempts, reason,
order), and every wait and restart offer that stands in the state must be decide's.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field, replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tensora.placement import admission_state
from tensora.placement.admission import (
    Decision,
    OwnerQuotas,
    Place,
    Policy,
    Promote,
    Queued,
    RestartAvailable,
    Running,
    Wait,
    decide,
)
from tensora.placement.admission_state import (
    AdmissionState,
    Event,
    NodeAdded,
    NodeRemoved,
    OwnerHeld,
    Prio,
    QuotaChanged,
    ReplicaEnded,
    ReplicaPlaced,
    Started,
    Stopped,
    Submitted,
    running_from,
    step,
)
from tensora.placement.capacity import Capacity, Node, Placed
from tensora.placement.kinds import WorkloadKind
from tensora.placement.quotas import RunningQuotas as Quotas
from tests.support.builders import CATALOG, GI, cpu_node, ep, gpu_node, w

CLASSES = ["l40s-48gb", "a100-80gb", "cpu-4c-16g", "cpu-16c-64g", "cpu-32c-128g"]
ENTRIES = ["a100-80gb", "l40s-48gb", "cpu", "cpu-4c-16g"]
REGIONS = ["local", "east"]
POLICY = Policy(starvation_after_s=120)


@dataclass
class World:
    """What the store would hold, and how ``decide`` sees it."""

    nodes: dict[str, Node] = field(default_factory=dict)
    placed: list[Placed] = field(default_factory=list)
    running: dict[str, Running] = field(default_factory=dict)
    queue: dict[str, Queued] = field(default_factory=dict)
    default: Quotas | None = None
    by_owner: dict[str, Quotas] = field(default_factory=dict)
    policy: Policy = POLICY

    def apply(self, e: Event) -> None:
        match e:
            case Submitted(q):
                self.running.pop(q.id, None)
                self.queue[q.id] = q
            case Started(r):
                self.queue.pop(r.id, None)
                self.running[r.id] = r
            case Stopped(id):
                self.queue.pop(id, None)
                self.running.pop(id, None)
                self.placed = [p for p in self.placed if p.workload != id]
            case ReplicaPlaced(p):
                self.placed.append(p)
            case ReplicaEnded(p):
                if p in self.placed:
                    self.placed.remove(p)
            case NodeAdded(n):
                self.nodes[n.name] = n
            case NodeRemoved(name):
                self.nodes.pop(name, None)
            case QuotaChanged(None, q):
                self.default = q
            case QuotaChanged(str(owner), q):
                if q is None:
                    self.by_owner.pop(owner, None)
                else:
                    self.by_owner[owner] = q

    def decide(self, now: float) -> list[Decision]:
        return decide(list(self.queue.values()), Capacity(list(self.nodes.values()), self.placed, CATALOG),
                      list(self.running.values()), now, self.policy, OwnerQuotas(self.default, self.by_owner))

    def assume(self, decisions: list[Decision]) -> None:
        """What the controller does with the decisions (and what the state assumes)."""
        for d in decisions:
            if isinstance(d, Place):
                self.apply(Started(running_from(d)))
                self.placed.append(Placed(d.node, d.cls, d.workload.id))
            elif isinstance(d, Promote):
                self.running[d.workload.id] = replace(d.workload, moving=True)
                self.placed.append(Placed(d.node, d.to_class, d.workload.id))


def _key(d: Decision) -> tuple[str, str]:
    return ("queued" if isinstance(d, Place | Wait) else "running", d.workload.id)


def _settled(d: Decision) -> Decision:
    return replace(d, now=0.0) if isinstance(d, Wait) else d


def check_cycle(world: World, state: AdmissionState, events: list[Event], now: float) -> list[Decision]:
    """One cycle on both sides; what decide said is assumed by the world (the state assumes it itself)."""
    for e in events:
        world.apply(e)
    want = world.decide(now)
    state, got = step(state, events, now)
    got_keys = {_key(d) for d in got}
    assert got == [d for d in want if _key(d) in got_keys]  # the same decisions, in decide's order
    assert not [d for d in want if isinstance(d, Place | Promote) and _key(d) not in got_keys]
    standing = {_key(d): _settled(d) for d in state.decisions()}
    assert standing == {_key(d): _settled(d) for d in want if isinstance(d, Wait | RestartAvailable)}
    for region in REGIONS:  # the queue depth: every wait that stands, by class asked and kind
        waits = Counter((d.workload.gpu_class, str(d.workload.kind)) for d in want
                        if isinstance(d, Wait) and d.workload.region == region)
        assert state.queue_depth(region) == dict(waits)
    world.assume(want)
    return got


# -- random histories -------------------------------------------------------------------------

node_st = st.builds(
    lambda i, region, cpu, mem, l40s, a100, cordoned, pods: Node(
        f"n{i}", region, cpu, mem * GI, {k: v for k, v in (("L40S", l40s), ("A100-80GB", a100)) if v},
        schedulable=not cordoned, pods=pods),
    st.integers(0, 9), st.sampled_from(REGIONS), st.sampled_from([4, 16, 32, 64]),
    st.sampled_from([16, 64, 128, 256]), st.integers(0, 2), st.integers(0, 1), st.booleans(),
    st.none() | st.integers(0, 3),
)
quota_st = st.none() | st.builds(lambda g, c: Quotas(running_gpus=g, running_cpu=c),
                                 st.sampled_from([0, 1, 2]), st.sampled_from([0, 4, 16, 64]))


def queued_st(id: str, now: float) -> st.SearchStrategy[Queued]:
    @st.composite
    def build(draw: st.DrawFn) -> Queued:
        cls = draw(st.sampled_from(CLASSES))
        fallback = tuple(e for e in draw(st.lists(st.sampled_from(ENTRIES), max_size=3, unique=True)) if e != cls)
        kind = draw(st.sampled_from(list(WorkloadKind)))
        params = draw(st.sampled_from([None, 1e9, 8e9, 70e9])) if kind == WorkloadKind.ENDPOINT else None
        since = now - draw(st.sampled_from([0, 0, 30, 200, 700]))
        return Queued(id, kind, cls, draw(st.sampled_from("abc")), draw(st.sampled_from(REGIONS)), fallback,
                      draw(st.sampled_from([0, 60, 600])), since,
                      int(params) if params else None, int(params) * 2 if params else None,
                      draw(st.sampled_from([0.0, 0.0, 0.0, now + 30, now + 200])))  # backing off, for a while
    return build()


def events_st(draw: st.DrawFn, world: World, now: float, serial: list[int]) -> list[Event]:
    out: list[Event] = []
    for _ in range(draw(st.integers(0, 4))):
        what = draw(st.sampled_from(["submit", "submit", "stop", "end", "moved", "node", "unnode", "quota", "run"]))
        ids = sorted({*world.queue, *world.running})
        if what == "submit":
            serial[0] += 1
            out.append(Submitted(draw(queued_st(f"w{serial[0]}", now))))
        elif what == "stop" and ids:
            out.append(Stopped(draw(st.sampled_from(ids))))
        elif what == "end" and world.placed:
            out.append(ReplicaEnded(draw(st.sampled_from(world.placed))))
        elif what == "moved":
            moving = sorted(r.id for r in world.running.values() if r.moving)
            if moving:
                r = world.running[draw(st.sampled_from(moving))]
                new = [p for p in world.placed if p.workload == r.id and p.cls != r.placed_class]
                out.append(ReplicaEnded(Placed(r.node, r.placed_class, r.id)))
                if new:
                    out.append(Started(replace(r, placed_class=new[-1].cls, node=new[-1].node, moving=False)))
        elif what == "node":
            out.append(NodeAdded(draw(node_st)))
        elif what == "unnode" and world.nodes:
            out.append(NodeRemoved(draw(st.sampled_from(sorted(world.nodes)))))
        elif what == "run" and world.nodes:  # placed by someone else, on a fallback class: may move back
            serial[0] += 1
            node = world.nodes[draw(st.sampled_from(sorted(world.nodes)))]
            placed = draw(st.sampled_from(["cpu-4c-16g", "a100-80gb"]))
            r = Running(f"w{serial[0]}", draw(st.sampled_from(list(WorkloadKind))), "l40s-48gb", placed, node.name,
                        draw(st.sampled_from("abc")), node.region, ("a100-80gb", "cpu"))
            out += [Started(r), ReplicaPlaced(Placed(node.name, placed, r.id))]
        elif what == "quota":
            out.append(QuotaChanged(draw(st.sampled_from([None, "a", "b"])), draw(quota_st)))
    return out


@dataclass(frozen=True)
class Shape:
    """How big a random history runs: up to ``nodes`` nodes, ``queued`` first submissions, ``rounds`` cycles of
    ``batches`` batches of events each, a default quota drawn from ``quotas``."""

    nodes: int = 5
    queued: int = 12
    rounds: int = 12
    batches: int = 1
    quotas: tuple[Quotas | None, ...] = (None,)


def check_history(data: st.DataObject, shape: Shape) -> None:
    """A random history of ``shape``, drawn a cycle at a time (each cycle's events depend on the world the cycles
    before left), each cycle checked as it comes."""
    world = World(policy=data.draw(st.sampled_from([POLICY, Policy(starvation_after_s=120, owner_fairness=False)])))
    drawn = data.draw(st.lists(node_st, max_size=shape.nodes, unique_by=lambda n: n.name))
    world.nodes = {n.name: n for n in drawn}
    world.default = data.draw(st.sampled_from(shape.quotas))
    state = AdmissionState(drawn, [], CATALOG, world.policy, OwnerQuotas(world.default))
    now, serial = 1000.0, [0]
    first = [Submitted(data.draw(queued_st(f"w{i}", now))) for i in range(data.draw(st.integers(0, shape.queued)))]
    serial[0] = len(first)
    check_cycle(world, state, list(first), now)
    for _ in range(data.draw(st.integers(1, shape.rounds))):
        now += data.draw(st.sampled_from([0, 1, 30, 60, 120, 600]))
        # a copy of the world answers what the events may name; check_cycle applies them to the real one
        probe = World(dict(world.nodes), list(world.placed), dict(world.running), dict(world.queue))
        events = [e for _ in range(shape.batches) for e in events_st(data.draw, probe, now, serial)]
        check_cycle(world, state, events, now)


@pytest.fixture
def heads_of_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """A cycle decides one workload of each list's head first (``_FIRST_PREFIX``), widening it where it must."""
    monkeypatch.setattr(admission_state, "_FIRST_PREFIX", 1)


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_step_decides_what_decide_decides(data: st.DataObject) -> None:
    check_history(data, Shape())


@pytest.mark.usefixtures("heads_of_one")
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_step_deciding_one_head_at_a_time_still_decides_what_decide_decides(data: st.DataObject) -> None:
    """Longer queues, more nodes, an owner quota for all or none, two batches of events a cycle, and each
    list's head one long: almost every cycle needs the checks to widen what it decides."""
    check_history(data, Shape(nodes=8, queued=40, rounds=20, batches=2,
                              quotas=(None, Quotas(running_gpus=1, running_cpu=16))))


# -- named cases ----------------------------------------------------------------------------------


def test_a_cycle_with_nothing_new_decides_nothing() -> None:
    world = World(nodes={"g1": gpu_node("g1")})
    state = AdmissionState(world.nodes.values(), [], CATALOG, POLICY)
    first = check_cycle(world, state, [Submitted(w("a", since=0)), Submitted(w("b", since=1))], 10)
    assert [type(d) for d in first] == [Place, Wait]
    assert check_cycle(world, state, [], 11) == []  # a's place was decided with: b's wait stands
    assert [d.reason for d in state.decisions()] == ["waiting for l40s-48gb (0 GPU free, 1 needed); "
                                                     "no fallback accepted"]


@pytest.mark.parametrize(("event", "wakes"), [
    (ReplicaEnded(Placed("g1", "l40s-48gb", "a")), True),
    (ReplicaEnded(Placed("g1", "l40s-48gb", "nobody")), False),  # not held: frees nothing
    (NodeAdded(gpu_node("g2")), True),
    (NodeAdded(Node("e1", "east", 8, 32 * GI)), False),  # another region
    (Submitted(w("c", region="east")), False),
    (QuotaChanged("zed", Quotas(running_gpus=0)), False),  # an owner with nothing waiting
    (QuotaChanged("b", Quotas(running_gpus=0)), True),
], ids=["replica ended", "unknown replica", "node added", "node elsewhere", "submitted elsewhere",
        "quota of a stranger", "quota of the waiter"])
def test_only_what_could_change_a_wait_re_decides_it(event: Event, wakes: bool) -> None:
    world = World(nodes={"g1": gpu_node("g1")})
    state = AdmissionState(world.nodes.values(), [], CATALOG, POLICY)
    check_cycle(world, state, [Submitted(w("a", since=0)), Submitted(w("b", since=1))], 10)
    check_cycle(world, state, [], 11)
    got = check_cycle(world, state, [event], 12)
    assert ("b" in {d.workload.id for d in got}) is wakes


def test_a_timer_coming_due_re_decides_with_no_event() -> None:
    world = World(nodes={"g1": gpu_node("g1"), "c1": Node("c1", "local", 16, 64 * GI)})
    state = AdmissionState(world.nodes.values(), [], CATALOG, POLICY)
    check_cycle(world, state, [Submitted(w("a", since=0)), Submitted(w("b", fallback=("cpu",), after=600))], 10)
    assert check_cycle(world, state, [], 11) == check_cycle(world, state, [], 119) == []
    assert [type(d) for d in check_cycle(world, state, [], 120)] == [Wait]  # b starves: it holds a node
    assert check_cycle(world, state, [], 599) == []
    got = check_cycle(world, state, [], 600)
    assert [(type(d), d.workload.id) for d in got] == [(Place, "b")]
    assert got[0].reason == "placed on cpu-16c-64g: l40s-48gb unavailable for 10m"


def test_a_quota_spans_regions_so_a_place_in_one_re_decides_the_other() -> None:
    """Owner a may run 1 GPU. Its older workload waits in local, its newer one in east (no GPU there).
    A GPU freed in local places the older one: east's wait now names a's quota, not east's capacity."""
    world = World(nodes={"g1": gpu_node("g1")}, default=Quotas(running_gpus=1))
    state = AdmissionState(world.nodes.values(), [], CATALOG, POLICY, OwnerQuotas(Quotas(running_gpus=1)))
    check_cycle(world, state, [Submitted(w("x", since=0)), Submitted(w("old", owner="a", since=1)),
                               Submitted(w("new", owner="a", since=2, region="east"))], 10)
    check_cycle(world, state, [], 11)
    got = check_cycle(world, state, [Stopped("x")], 12)
    assert {d.workload.id: d.reason for d in got} == {
        "old": "placed on l40s-48gb",
        "new": "waiting for l40s-48gb (owner quota: 1 of 1 GPU in use); no fallback accepted",
    }


def _figures(c: Capacity) -> dict[str, object]:
    """Everything a cycle reads from a Capacity, by node name (indices differ after deltas)."""
    live = sorted(c.index, key=lambda name: name)
    at = [c.index[name] for name in live]
    return {
        "nodes": [c.nodes[i] for i in at],
        "free": [(c.free_cpu[i], c.free_mem[i], {m: g for m, g in c.free_gpus[i].items() if g}, c.free_pods[i])
                 for i in at],
        "reserved": [(c.reserved_cpu[i], c.reserved_mem[i]) for i in at],
        "region": {k: v for k, v in c._region_gpus.items() if v} | {k: v for k, v in c._region_cpu.items() if v},
        "pods": {k: v for k, v in c._region_pods.items() if v},
        "candidates": {(r, cls.name): [c.nodes[i].name for i in c.candidates(r, cls)]
                       for r in REGIONS for cls in CATALOG.values()},
        "unhostable": {(r, cls.name): c.unhostable(r, cls) for r in REGIONS for cls in CATALOG.values()},
        "no room": _no_room(c),
    }


def _no_room(c: Capacity) -> dict[tuple[str, str], bool]:
    """Where no node fits a class, read as a cycle reads it (its own cursors, then the end of the cycle)."""
    out = {(r, cls.name): c.no_room(r, cls) for r in REGIONS for cls in CATALOG.values()}
    c.commit()
    return out


@settings(max_examples=150, deadline=None)
@given(nodes=st.lists(node_st, max_size=6, unique_by=lambda n: n.name), data=st.data())
def test_capacity_by_deltas_is_capacity_rebuilt(nodes: list[Node], data: st.DataObject) -> None:
    """Replicas placed and ended, nodes added, removed and replaced, in any order: the figures are a rebuild's."""
    now = {n.name: n for n in nodes}
    placed: list[Placed] = []
    cap = Capacity(nodes, [], CATALOG)
    for _ in range(data.draw(st.integers(1, 25))):
        what = data.draw(st.sampled_from(["place", "place", "end", "node", "unnode"]))
        if what == "place" and now:
            p = Placed(data.draw(st.sampled_from(sorted(now))), data.draw(st.sampled_from(CLASSES)))
            placed.append(p)
            cap.change(cap.index[p.node], CATALOG[p.cls], 1)
        elif what == "end" and placed:
            p = placed.pop(data.draw(st.integers(0, len(placed) - 1)))
            if p.node in cap.index:
                cap.change(cap.index[p.node], CATALOG[p.cls], -1)
        elif what == "node":
            node = data.draw(node_st)
            if node.name in now:
                cap.remove_node(node.name)
            now[node.name] = node
            cap.add_node(node, [CATALOG[p.cls] for p in placed if p.node == node.name])
        elif what == "unnode" and now:
            name = data.draw(st.sampled_from(sorted(now)))
            del now[name]
            cap.remove_node(name)
        assert _figures(cap) == _figures(Capacity(list(now.values()), placed, CATALOG))


def test_a_move_back_is_assumed_then_finished_by_events() -> None:
    """An endpoint on CPU moves back when its GPU frees; a notebook there is offered a restart, which stands."""
    world = World(nodes={"g1": gpu_node("g1"), "c1": Node("c1", "local", 64, 256 * GI)},
                  placed=[Placed("g1", "l40s-48gb", "x")])
    state = AdmissionState(world.nodes.values(), world.placed, CATALOG, POLICY)
    ep = Running("ep", WorkloadKind.ENDPOINT, "l40s-48gb", "cpu-4c-16g", "c1", "o", "local", ("cpu",))
    nb = Running("nb", WorkloadKind.NOTEBOOK, "a100-80gb", "cpu-4c-16g", "c1", "p", "local", ("cpu",))
    start = [Started(ep), Started(nb), ReplicaPlaced(Placed("c1", "cpu-4c-16g", "ep")),
             ReplicaPlaced(Placed("c1", "cpu-4c-16g", "nb"))]
    assert check_cycle(world, state, start, 10) == []  # nothing free to move to, nothing queued
    got = check_cycle(world, state, [Stopped("x")], 11)
    assert [(type(d), d.workload.id) for d in got] == [(Promote, "ep")]
    assert state.running["ep"].moving
    check_cycle(world, state, [], 12)
    done = [ReplicaEnded(Placed("c1", "cpu-4c-16g", "ep")),
            Started(replace(ep, placed_class="l40s-48gb", node="g1"))]
    check_cycle(world, state, done, 13)
    assert check_cycle(world, state, [], 14) == []
    world.nodes["a1"] = Node("a1", "local", 32, 256 * GI, {"A100-80GB": 1})
    got = check_cycle(world, state, [NodeAdded(world.nodes["a1"])], 15)
    assert [(type(d), d.workload.id) for d in got] == [(RestartAvailable, "nb")]
    assert check_cycle(world, state, [], 16) == []  # a restart offer takes nothing: it stands
    assert [d.reason for d in state.decisions()] == [
        "a100-80gb has capacity again: restart on it to leave cpu-4c-16g"]


def _east(id: str, cls: str, owner: str, since: float) -> Submitted:
    return Submitted(w(id, cls, owner=owner, since=since, region="east"))


def _running(owner: str, n: int) -> Started:
    """The ``n``-th workload ``owner`` runs elsewhere (its turns come later)."""
    return Started(Running(f"{owner}-run{n}", WorkloadKind.VM, "l40s-48gb", "l40s-48gb", "g9", owner))


TURNS = {
    # a's oldest east workload X starves and holds the only east node from Z; a's newer local one is placed:
    # X's turn falls behind b's Y, which does not starve, so nothing is held and Z fits (a cycle later)
    "a place elsewhere": ([_east("X", "cpu-32c-128g", "a", 0), Submitted(w("W", owner="a", since=5))],
                          [Stopped("x")]),
    # a submits an older workload elsewhere: X's turn falls behind Y's
    "a submission elsewhere": ([_east("X", "cpu-32c-128g", "a", 0)], [Submitted(w("V", owner="a", since=-10))]),
    # b's Y was behind b's older local U; U stops: Y's turn comes before d's X, which starves (d runs two,
    # and so does c, Z's owner)
    "a stop elsewhere": ([_running("b", 1), _running("d", 1), _running("d", 2), _running("c", 1), _running("c", 2),
                          _east("X", "cpu-32c-128g", "d", 0), Submitted(w("U", owner="b", since=400))],
                         [Stopped("U")]),
    # a starts running a workload elsewhere: X's turn falls behind Y's
    "a run started elsewhere": ([_east("X", "cpu-32c-128g", "a", 0)], [_running("a", 1)]),
    # b stops one it ran elsewhere: Y's turn comes before d's X
    "a run stopped elsewhere": ([_running("b", 1), _running("d", 1), _running("c", 1),
                                 _east("X", "cpu-32c-128g", "d", 0)], [Stopped("b-run1")]),
}


@pytest.mark.parametrize(("first", "then"), TURNS.values(), ids=TURNS.keys())
def test_a_turn_changed_in_one_region_re_decides_the_other(first: list[Event], then: list[Event]) -> None:
    """Owner turns count every region: a change there can move a hold here (a starving queue head's)."""
    world = World(nodes={"g1": gpu_node("g1"), "c1": Node("c1", "east", 32, 128 * GI)},
                  placed=[Placed("g1", "l40s-48gb", "x"), Placed("c1", "cpu-16c-64g", "f")])
    state = AdmissionState(world.nodes.values(), world.placed, CATALOG, POLICY)
    queue = [*first, _east("Y", "cpu-32c-128g", "b", 500), _east("Z", "cpu-4c-16g", "c", 550)]
    check_cycle(world, state, queue, 600)
    assert check_cycle(world, state, [], 601) == []  # Z waits: X holds c1
    check_cycle(world, state, then, 602)
    check_cycle(world, state, [], 603)
    assert "Z" in state.running


def test_an_owners_held_figure_from_the_store_is_its_quota_use() -> None:
    """A starting replica holds quota but is no running record: the store's count (``OwnerHeld``) is what the
    state checks the quota against, as ``decide`` does with ``OwnerQuotas.held``; its own places add to it."""
    nodes = {"g1": gpu_node("g1"), "g2": gpu_node("g2")}
    quotas = OwnerQuotas(Quotas(running_gpus=1))
    state = AdmissionState(nodes.values(), [], CATALOG, POLICY, quotas)
    state, got = step(state, [Submitted(w("a1", owner="a", since=1)), OwnerHeld("a", 1.0, 0.0)], 10)
    want = decide([w("a1", owner="a", since=1)], Capacity(nodes.values(), [], CATALOG), [], 10, POLICY,
                  replace(quotas, held={"a": (1.0, 0.0)}))
    assert got == want
    assert got[0].reason == "waiting for l40s-48gb (owner quota: 1 of 1 GPU in use); no fallback accepted"
    state, got = step(state, [OwnerHeld("a", 0.0, 0.0)], 11)  # the starting replica was stopped
    assert [(type(d), d.workload.id) for d in got] == [(Place, "a1")]
    state, got = step(state, [Submitted(w("a2", owner="a", since=2))], 12)  # a1's place counts
    assert got[0].reason == "waiting for l40s-48gb (owner quota: 1 of 1 GPU in use); no fallback accepted"


def _a_long_queue_settled() -> tuple[World, AdmissionState]:
    """200 ask for 4 L40S GPUs (two thirds would take a CPU class after a minute), decided until a cycle
    decides nothing: the GPUs taken, and the CPU the listers took."""
    world = World(nodes={f"g{i}": gpu_node(f"g{i}") for i in range(4)})
    state = AdmissionState(world.nodes.values(), [], CATALOG, POLICY)
    queue = [Submitted(w(f"q{i:03d}", owner=f"o{i % 7}", since=i, fallback=("cpu",) if i % 3 else (), after=60))
             for i in range(200)]
    check_cycle(world, state, queue, 100)
    while check_cycle(world, state, [], 101):
        pass
    return world, state


def test_a_freed_gpu_decides_the_heads_of_a_long_queue_not_the_queue() -> None:
    """A long queue settled. One GPU freed: a few lists' heads are decided (one of them placed), the rest stand,
    as decide says from scratch."""
    world, state = _a_long_queue_settled()
    placed = world.placed[0]
    got = check_cycle(world, state, [ReplicaEnded(placed)], 102)
    assert [type(d) for d in got].count(Place) == 1
    assert len(world.queue) > 150
    assert len(got) < 20  # the heads, not the queue
    assert len(list(state.decisions())) == len(world.queue)  # the rest stand (check_cycle: as decide says)


def test_a_submission_where_every_class_is_full_decides_it_and_the_first_requester() -> None:
    """A long queue settled: L40S and the CPU the listers took are full. One more submitted: only it and the L40S
    list's first (who may hold a node when it starves) are decided; no lister's head is, since the cycle began
    with no room in any class they list."""
    world, state = _a_long_queue_settled()
    got = check_cycle(world, state, [Submitted(w("new", owner="o0", since=102, fallback=("cpu",), after=0))], 102)
    first = min(state.reqs["local"]["l40s-48gb"])[2]
    assert first != "new"  # its owner runs some: its turn comes late
    assert sorted(d.workload.id for d in got) == ["new", first]
    assert all(type(d) is Wait for d in got)


def test_a_submission_to_a_full_class_where_no_first_requester_starves_decides_only_it() -> None:
    """A long queue settled, none of it starving yet. One more submitted for a class with no node: it is
    decided alone. The L40S list's first is not (no L40S requester is decided, and it may not hold a node
    before it starves), nor any lister's head (every class they list had no room when the cycle began)."""
    world, state = _a_long_queue_settled()
    assert 102 - min(q.queued_since for q in world.queue.values()) < POLICY.starvation_after_s
    got = check_cycle(world, state, [Submitted(w("new", "a100-80gb", owner="o0", since=102))], 102)
    assert [(d.workload.id, type(d)) for d in got] == [("new", Wait)]


def test_an_endpoint_too_large_for_cpu_is_no_lister_of_the_word_cpu() -> None:
    """The word ``cpu`` never places an endpoint over the CPU parameter limit, whatever is free: it is left
    out of that word's listers (it would head the list, decided again each cycle, as would the ones after
    it), and its decisions are still decide's, before and after the CPU frees up."""
    world = World(nodes={"g": gpu_node("g"), "c": cpu_node("c", cpu=16, mem_gi=64)})
    state = AdmissionState(world.nodes.values(), [], CATALOG, POLICY)
    names = [("placed", 1e9), ("big", 70e9), *((f"m{i}", 1e9) for i in range(6))]
    first = [Submitted(ep(name, since=since, params=params, fallback=("cpu",), after=0))
             for since, (name, params) in enumerate(names)]
    got = check_cycle(world, state, first, 10)  # the GPU to "placed", the CPU node to three small ones
    assert [type(d) for d in got] == [Place, Wait, Place, Place, Place, Wait, Wait, Wait]
    got = check_cycle(world, state, [Stopped("m0")], 11)  # CPU freed: the next small one takes it
    assert [d.workload.id for d in got if type(d) is Place] == ["m3"]
    assert [p[2] for p in state.listers["local"]["cpu"]] == ["m4", "m5"]
    assert "big" in state.eligible and "big" in {p[2] for p in state.reqs["local"]["l40s-48gb"]}


def test_the_state_holds_what_it_assumed_and_nothing_else() -> None:
    """A caller reading back a placement the state assumed need not tell it again: ``holds`` says so only for
    exactly the running record and replica the state keeps."""
    world = World(nodes={"g1": gpu_node("g1")})
    state = AdmissionState(world.nodes.values(), [], CATALOG, POLICY)
    (place,) = check_cycle(world, state, [Submitted(w("a", since=0))], 10)
    assert type(place) is Place
    running, replica = running_from(place), Placed(place.node, place.cls, "a")
    assert state.holds(["a"], [], [running], [replica])
    assert not state.holds(["a"], [], [running], [])  # its replica is missing
    assert not state.holds(["a"], [], [replace(running, moving=True)], [replica])
    assert not state.holds(["a"], [place.workload], [], [])  # still queued: no
    assert not state.holds(["a", "b"], [], [running], [replica, Placed("g1", "l40s-48gb", "b")])


def test_a_turn_moved_by_a_placement_can_move_the_hold_and_so_place_another() -> None:
    """L40S is full. Old a1 (starving) holds g1, the node L40S frees on first, so l waits for g1's idle CPU. Then
    a2, a1's owner's newer workload, takes g2's A100: its place moves a1's turn behind b1, who does not starve
    yet. The next cycle has no event, but nobody holds g1 any more, and l takes its CPU."""
    world = World(nodes={"g1": gpu_node("g1"), "g2": gpu_node("g2", "A100-80GB", cpu=12)},
                  placed=[Placed("g1", "l40s-48gb", "x")])
    state = AdmissionState(world.nodes.values(), world.placed, CATALOG, POLICY)
    first = check_cycle(world, state, [
        Submitted(w("a1", owner="a", since=0)), Submitted(w("b1", owner="b", since=150)),
        Submitted(w("l", "h100-80gb", owner="l", since=10, fallback=("cpu",)))], 200)
    assert {d.workload.id: type(d) for d in first} == {"a1": Wait, "b1": Wait, "l": Wait}
    got = check_cycle(world, state, [Submitted(w("a2", "a100-80gb", owner="a", since=180))], 201)
    assert [(type(d), d.workload.id) for d in got if type(d) is Place] == [(Place, "a2")]
    got = check_cycle(world, state, [], 202)
    assert [(type(d), d.workload.id) for d in got if type(d) is Place] == [(Place, "l")]


def test_a_wait_shows_what_is_free_after_the_cycle() -> None:
    """The older workload wants 16 vCPUs where 8 are free (a 16-vCPU node runs another's 8); a newer one
    takes 4 of them in the same cycle. The wait says 4 free (what anyone reading it finds), not the 8 there
    were when it was tried."""
    world = World(nodes={"c1": Node("c1", "local", 16, 128 * GI)}, placed=[Placed("c1", "cpu-8c-32g", "x")])
    state = AdmissionState(world.nodes.values(), world.placed, CATALOG, POLICY)
    got = check_cycle(world, state, [Submitted(w("big", "cpu-16c-64g", since=0)),
                                     Submitted(w("small", "cpu-4c-16g", since=1))], 10)
    assert [(type(d), d.workload.id) for d in got] == [(Wait, "big"), (Place, "small")]
    assert got[0].reason == "waiting for cpu-16c-64g (4 vCPU free, 16 needed); no fallback accepted"


# -- a batch taken in bulk is the batch taken one event at a time ------------------------------------------------


def _snapshot(s: AdmissionState) -> dict[str, object]:
    """What a state keeps, in its order where its order is read (queue, standing waits), heaps as sets."""
    return {
        "queue": list(s.queue.items()),
        "by_region": {r: list(q.items()) for r, q in s.by_region.items() if q},
        "owner_keys": {o: k for o, k in s.owner_keys.items() if k},
        "backing": s.backing,
        "running": list(s.running.items()),
        "movers": {r: dict(m) for r, m in s.movers.items() if m},
        "prefers": {k: v for k, v in s.prefers.items() if v},
        "owner_running": +s.owner_running,
        "owner_regions": {o: +c for o, c in s.owner_regions.items() if c},
        "use": s.use,
        "timers": sorted(s.timers + s.later),
        "standing": {r: list(d.items()) for r, d in s.standing.items() if d},
        "offered": {r: ids for r, ids in s.offered.items() if ids},
        "waits": (s.n_waiting, +s.waited, +s.blocked, +s.standing_decisions.queued),
        "replicas": (s.replicas, s.on_node),
        "lists": (s.prio, _nonempty(s.reqs), _nonempty(s.listers), s.eligible, s.unsorted),
        "regions": (s.dirty, s.whole, s.decided, s.must, s.held_last, s.touched, s.turns),
    }


def _nonempty(lists: dict[str, dict[str, list[Prio]]]) -> dict[str, dict[str, list[Prio]]]:
    """A region's lists less the empty ones: a list emptied in place and one rebuilt without it are alike (the
    bulk path rebuilds a region's lists at other cycles than one event at a time does: fewer turns moved)."""
    return {r: kept for r, d in lists.items() if (kept := {k: lst for k, lst in d.items() if lst})}


@st.composite
def _batch(draw: st.DrawFn, world: World, now: float, serial: list[int]) -> list[Event]:
    """Runs of submissions (some naming a workload queued or running, or one submitted earlier in the batch),
    split by other events."""
    subs: list[Event] = []
    for _ in range(draw(st.integers(0, 30))):
        old = sorted({*world.queue, *world.running, *(e.workload.id for e in subs if isinstance(e, Submitted))})
        if old and draw(st.integers(0, 4)) == 0:
            id = draw(st.sampled_from(old))
        else:
            serial[0] += 1
            id = f"w{serial[0]}"
        subs.append(Submitted(draw(queued_st(id, now))))
    other = events_st(draw, World(dict(world.nodes), list(world.placed), dict(world.running), dict(world.queue)),
                      now, serial)
    cut = draw(st.integers(0, len(subs)))
    return [*subs[:cut], *other, *subs[cut:]]


@settings(max_examples=100, deadline=None)
@given(data=st.data(), nodes=st.lists(node_st, max_size=6, unique_by=lambda n: n.name),
       policy=st.sampled_from([POLICY, Policy(starvation_after_s=120, owner_fairness=False)]),
       quota=st.sampled_from([None, Quotas(running_gpus=1, running_cpu=16)]))
def test_a_batch_taken_in_bulk_is_the_batch_taken_one_event_at_a_time(
        data: st.DataObject, nodes: list[Node], policy: Policy, quota: Quotas | None) -> None:
    """``step`` takes runs of submissions in bulk and puts a region decided whole in order without a bisect each;
    ``apply`` then ``cycle`` takes them one at a time. Every cycle's decisions and everything the state keeps
    after it are the same, and the bulk order is the order of ``_prio``."""
    world = World(nodes={n.name: n for n in nodes}, policy=policy, default=quota)
    bulk, each = (AdmissionState(nodes, [], CATALOG, policy, OwnerQuotas(quota)) for _ in range(2))
    now, serial = 1000.0, [0]
    for _ in range(data.draw(st.integers(1, 6))):
        events = data.draw(_batch(world, now, serial))
        bulk, got = step(bulk, events, now)
        for e in events:
            each.apply(e)
        assert got == each.cycle(now)
        assert _snapshot(bulk) == _snapshot(each)
        taking = [w for w in bulk.queue.values() if w.id not in bulk.backing]
        assert bulk._ordered(taking) == sorted(taking, key=bulk._prio)
        for e in events:
            world.apply(e)
        world.assume(got)
        now += data.draw(st.sampled_from([0, 1, 60, 600]))
