"""Running quotas in admission: named cases, and the invariants over random queues and quotas (hypothesis)."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tensora.placement.admission import Outcome, OwnerQuotas, Place, Policy, Queued, Running, Wait, decide, share
from tensora.placement.capacity import Capacity, Node, Placed
from tensora.placement.kinds import WorkloadKind
from tensora.placement.quotas import RunningQuotas as Quotas
from tests.support.builders import CATALOG, cap, cpu_node, ep, gpu_node, outcomes, w
from tests.support.strategies import nodes_st, queue_st


def q(gpus: int = 2, cpu: float = 32) -> Quotas:
    return Quotas(running_gpus=gpus, running_cpu=cpu)


def on(id: str, owner: str, placed: str, node: str, cls: str = "l40s-48gb", *,
       kind: WorkloadKind = WorkloadKind.ENDPOINT, fallback: tuple[str, ...] = ("cpu",)) -> Running:
    return Running(id, kind, cls, placed, node, owner, "local", fallback)


@dataclass
class Case:
    queue: list[Queued]
    nodes: list[Node]
    quotas: OwnerQuotas
    want: dict[str, str]  # workload id -> placed class, or "wait"
    placed: list[Placed] = field(default_factory=list)
    running: list[Running] = field(default_factory=list)
    now: float = 0
    policy: Policy = field(default_factory=Policy)
    moves: dict[str, str] = field(default_factory=dict)  # running id -> Promote/RestartAvailable target
    reasons: dict[str, str] = field(default_factory=dict)  # id -> the whole reason


TWO_L40S = gpu_node("g1", count=2, cpu=64)
AT_GPU_QUOTA = OwnerQuotas(q(), held={"a": (2, 0)})

CASES = {
    "at the GPU quota, the fleet has room -> waits, saying the quota": Case(
        [w("a1", owner="a")], [TWO_L40S], AT_GPU_QUOTA, {"a1": "wait"},
        reasons={"a1": "waiting for l40s-48gb (owner quota: 2 of 2 GPUs in use); no fallback accepted"}),
    "under the GPU quota -> placed": Case(
        [w("a1", owner="a")], [TWO_L40S], OwnerQuotas(q(), held={"a": (1, 0)}), {"a1": "l40s-48gb"}),
    "no quotas given -> no limit": Case(
        [w("a1", owner="a")], [TWO_L40S], OwnerQuotas(None, held={"a": (99, 999)}), {"a1": "l40s-48gb"}),
    "this cycle's placements count: quota 1, two queued -> one placed, one waits": Case(
        [w("a1", owner="a", since=0), w("a2", owner="a", since=1)], [TWO_L40S], OwnerQuotas(q(gpus=1)),
        {"a1": "l40s-48gb", "a2": "wait"},
        reasons={"a2": "waiting for l40s-48gb (owner quota: 1 of 1 GPU in use); no fallback accepted"}),
    "what running replicas hold counts when held is not given": Case(
        [w("a1", owner="a")], [TWO_L40S], OwnerQuotas(q(gpus=1)), {"a1": "wait"},
        placed=[Placed("g1", "l40s-48gb")], running=[on("r", "a", "l40s-48gb", "g1")]),
    "an owner's own quota over the default": Case(
        [w("a1", owner="a"), w("b1", owner="b")], [TWO_L40S], OwnerQuotas(q(gpus=0), {"a": q(gpus=1)}),
        {"a1": "l40s-48gb", "b1": "wait"}, reasons={"b1": "waiting for l40s-48gb (owner quota: no GPUs allowed); "
                                                         "no fallback accepted"}),
    "a quota-blocked owner first in line never blocks another owner behind it": Case(
        [w("a1", owner="a", since=0), w("b1", owner="b", since=1)], [gpu_node("g1")], AT_GPU_QUOTA,
        {"a1": "wait", "b1": "l40s-48gb"}, policy=Policy(owner_fairness=False)),
    "a quota-blocked starving head holds no node against another owner": Case(
        [w("a1", "cpu-32c-128g", owner="a", since=0), w("b1", "cpu-4c-16g", owner="b", since=500)],
        [cpu_node("c1", cpu=32, mem_gi=128)], OwnerQuotas(q(cpu=16)), {"a1": "wait", "b1": "cpu-4c-16g"},
        now=10_000, policy=Policy(owner_fairness=False),
        reasons={"a1": "waiting for cpu-32c-128g (owner quota: 0 of 16 vCPUs in use, 32 needed); "
                       "no fallback accepted"}),
    "a quota-blocked requester does not hold its class against another's fallback": Case(
        [w("a1", "a100-80gb", owner="a"), w("b1", owner="b", fallback=("a100-80gb",))],
        [gpu_node("g1"), gpu_node("x1", "A100-80GB")], AT_GPU_QUOTA, {"a1": "wait", "b1": "a100-80gb"},
        placed=[Placed("g1", "l40s-48gb")]),
    "over the GPU quota, a CPU fallback within running_cpu is taken, saying why": Case(
        [w("a1", owner="a", fallback=("cpu",))], [TWO_L40S, cpu_node("c1")], AT_GPU_QUOTA, {"a1": "cpu-16c-64g"},
        reasons={"a1": "placed on cpu-16c-64g: l40s-48gb (owner quota: 2 of 2 GPUs in use)"}),
    "over the GPU quota, the fallback timer still runs -> waits for it": Case(
        [w("a1", owner="a", fallback=("cpu",), after=600)], [TWO_L40S, cpu_node("c1")], AT_GPU_QUOTA,
        {"a1": "wait"}, reasons={"a1": "waiting for l40s-48gb (owner quota: 2 of 2 GPUs in use); "
                                       "fallback to cpu from 00:10:00"}),
    "the CPU quota with some left: says what is needed": Case(
        [w("a1", "cpu-4c-16g", owner="a")], [cpu_node("c1")], OwnerQuotas(q(), held={"a": (0, 30)}),
        {"a1": "wait"},
        reasons={"a1": "waiting for cpu-4c-16g (owner quota: 30 of 32 vCPUs in use, 4 needed); "
                       "no fallback accepted"}),
    "cpu picks a smaller class that fits the CPU quota": Case(
        [w("a1", owner="a", fallback=("cpu",))], [TWO_L40S, cpu_node("c1")],
        OwnerQuotas(q(), held={"a": (2, 28)}), {"a1": "cpu-4c-16g"},
        reasons={"a1": "placed on cpu-4c-16g: l40s-48gb (owner quota: 2 of 2 GPUs in use); also tried "
                       "cpu-8c-32g (owner quota: 28 of 32 vCPUs in use, 8 needed) and 2 larger CPU classes"}),
    "every CPU class over the quota -> one phrase for them": Case(
        [w("a1", owner="a", fallback=("cpu",))], [TWO_L40S, cpu_node("c1")],
        OwnerQuotas(q(), held={"a": (2, 32)}), {"a1": "wait"},
        reasons={"a1": "waiting for l40s-48gb (owner quota: 2 of 2 GPUs in use); fallback tried: cpu-1c-4g "
                       "(owner quota: 32 of 32 vCPUs in use) and 5 larger CPU classes"}),
    "a GPU class's host vCPUs do not count against running_cpu": Case(
        [w("a1", owner="a")], [TWO_L40S], OwnerQuotas(q(), held={"a": (0, 32)}), {"a1": "l40s-48gb"}),
    "an endpoint's replicas count one by one": Case(
        [ep("e/0", owner="a", params=1e9), ep("e/1", owner="a", params=1e9)], [TWO_L40S],
        OwnerQuotas(q(gpus=1)), {"e/0": "l40s-48gb", "e/1": "wait"}),
    "a move back within the GPU quota is made (it replaces a CPU replica)": Case(
        [], [TWO_L40S, cpu_node("c1")], OwnerQuotas(q(gpus=1)), {}, placed=[Placed("c1", "cpu-16c-64g")],
        running=[on("e", "a", "cpu-16c-64g", "c1")], moves={"e": "l40s-48gb"}),
    "a move back that would pass the GPU quota is not made": Case(
        [], [TWO_L40S, cpu_node("c1")], OwnerQuotas(q(gpus=1)), {},
        placed=[Placed("c1", "cpu-16c-64g"), Placed("g1", "l40s-48gb")],
        running=[on("e", "a", "cpu-16c-64g", "c1"), on("x", "a", "l40s-48gb", "g1")]),
    "a move back between GPU classes adds no GPU, at the quota too": Case(
        [], [gpu_node("g1"), gpu_node("x1", "A100-80GB")], OwnerQuotas(q(gpus=1)), {},
        placed=[Placed("x1", "a100-80gb")], running=[on("e", "a", "a100-80gb", "x1", fallback=("a100-80gb",))],
        moves={"e": "l40s-48gb"}),
    "no restart on GPU offered to a notebook whose owner is at the GPU quota": Case(
        [], [TWO_L40S, cpu_node("c1")], OwnerQuotas(q(gpus=1)), {},
        placed=[Placed("c1", "cpu-16c-64g"), Placed("g1", "l40s-48gb")],
        running=[on("n", "a", "cpu-16c-64g", "c1", kind=WorkloadKind.NOTEBOOK), on("x", "a", "l40s-48gb", "g1")]),
    "a restart on GPU offered within the quota": Case(
        [], [TWO_L40S, cpu_node("c1")], OwnerQuotas(q(gpus=1)), {}, placed=[Placed("c1", "cpu-16c-64g")],
        running=[on("n", "a", "cpu-16c-64g", "c1", kind=WorkloadKind.NOTEBOOK)], moves={"n": "restart:l40s-48gb"}),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_decide_with_quotas(case: Case) -> None:
    decisions = decide(case.queue, cap(case.nodes, case.placed), case.running, case.now, case.policy, case.quotas)
    got, moves = outcomes(decisions)
    assert got == case.want
    assert moves == case.moves
    by_id = {d.workload.id: d for d in decisions}
    for wid, text in case.reasons.items():
        assert by_id[wid].reason == text


# -- invariants --------------------------------------------------------------------------

quotas_st = st.builds(Quotas, running_gpus=st.integers(0, 3), running_cpu=st.sampled_from([0, 4, 16, 32, 64]))


@st.composite
def owner_quotas_st(draw: st.DrawFn) -> OwnerQuotas:
    """Quotas for some of the owners a-c, a default for the rest, and what each holds now (within its quota)."""
    default = draw(quotas_st)
    by_owner = draw(st.dictionaries(st.sampled_from("abc"), quotas_st, max_size=3))
    held = {}
    for owner in "abc":
        mine = by_owner.get(owner, default)
        held[owner] = (draw(st.integers(0, mine.running_gpus)), draw(st.floats(0, mine.running_cpu)))
    return OwnerQuotas(default, by_owner, held)


def _placed_totals(quotas: OwnerQuotas, decisions: list) -> dict[str, list[float]]:
    assert quotas.held is not None
    total = {o: list(h) for o, h in quotas.held.items()}
    for d in decisions:
        if isinstance(d, Place):
            for i, n in enumerate(share(CATALOG[d.cls])):
                total[d.workload.owner][i] += n
    return total


@settings(max_examples=200, deadline=None)
@given(nodes=nodes_st, queue=queue_st(), now=st.integers(0, 2000), quotas=owner_quotas_st(),
       fair=st.booleans())
def test_no_owner_passes_its_quota_and_none_waits_for_another_at_its_quota(
        nodes: list[Node], queue: list[Queued], now: int, quotas: OwnerQuotas, fair: bool) -> None:
    policy = Policy(owner_fairness=fair)
    decisions = decide(queue, Capacity(nodes, [], CATALOG), [], now, policy, quotas)
    for owner, (gpus, cpu) in _placed_totals(quotas, decisions).items():
        mine = quotas.by_owner.get(owner, quotas.default)
        assert mine is not None
        assert gpus <= mine.running_gpus and cpu <= mine.running_cpu + 1e-9
    # Take away what only a quota kept waiting: every other decision is the same. Under owner fairness,
    # whole owners (a rank counts its owner's queued workloads); in FIFO order, each such workload.
    quota_waits = {d.workload.id: d.workload.owner for d in decisions
                   if isinstance(d, Wait) and d.attempts[0].outcome is Outcome.OWNER_QUOTA}
    if fair:
        placed_owners = {d.workload.owner for d in decisions if not isinstance(d, Wait)
                         or d.attempts[0].outcome is not Outcome.OWNER_QUOTA}
        gone = {x.id for x in queue if x.owner in set(quota_waits.values()) - placed_owners}
    else:
        gone = set(quota_waits)
    without = decide([x for x in queue if x.id not in gone], Capacity(nodes, [], CATALOG), [], now, policy, quotas)
    assert [d for d in decisions if d.workload.id not in gone] == without


def test_the_property_bites() -> None:
    """The invariant above is not vacuous: with these quotas a quota wait happens and the other owner runs."""
    queue = [w("a1", owner="a", since=0), w("b1", owner="b", since=1)]
    decisions = decide(queue, cap([gpu_node("g1")]), [], 0, Policy(owner_fairness=False), AT_GPU_QUOTA)
    assert [type(d).__name__ for d in decisions] == ["Wait", "Place"]
    unlimited = decide(queue, cap([gpu_node("g1")]), [], 0, Policy(owner_fairness=False))
    assert [type(d).__name__ for d in unlimited] == ["Place", "Wait"]
