"""Table tests of the pure placement decision: one named case per rule."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from tensora.placement.admission import Outcome, Place, Policy, Queued, Running, Wait, decide
from tensora.placement.capacity import Node, Placed
from tensora.placement.kinds import WorkloadKind
from tests.support.builders import cap, cores_node, cpu_node, ep, gpu_node, outcomes, running, w


@dataclass
class Case:
    queue: list[Queued]
    nodes: list[Node]
    want: dict[str, str]  # workload id -> placed class, or "wait"
    placed: list[Placed] = field(default_factory=list)
    running: list[Running] = field(default_factory=list)
    now: float = 0
    policy: Policy = field(default_factory=Policy)
    moves: dict[str, str] = field(default_factory=dict)  # running id -> Promote/RestartAvailable target
    reasons: dict[str, str] = field(default_factory=dict)  # id -> substring of the reason


FULL_L40S = [Placed("g1", "l40s-48gb")]

CASES = {
    "requested class free -> placed on it": Case(
        [w("a")], [gpu_node("g1")], {"a": "l40s-48gb"}, reasons={"a": "placed on l40s-48gb"}),
    "requested class full, no fallback -> waits": Case(
        [w("a")], [gpu_node("g1")], {"a": "wait"}, placed=FULL_L40S, now=10_000,
        reasons={"a": "waiting for l40s-48gb (0 GPU free, 1 needed); no fallback accepted"}),
    "timer not elapsed -> waits": Case(
        [w("a", fallback=("cpu",), after=600)], [gpu_node("g1"), cpu_node("c1")], {"a": "wait"},
        placed=FULL_L40S, now=599, reasons={"a": "fallback to cpu from 00:10:00"}),
    "timer elapsed -> falls back to cpu with the reason": Case(
        [w("a", fallback=("cpu",), after=600)], [gpu_node("g1"), cpu_node("c1")], {"a": "cpu-16c-64g"},
        placed=FULL_L40S, now=600, reasons={"a": "placed on cpu-16c-64g: l40s-48gb unavailable for 10m"}),
    "fallback_after 0 -> falls back at once": Case(
        [w("a", fallback=("cpu",))], [gpu_node("g1"), cpu_node("c1")], {"a": "cpu-16c-64g"}, placed=FULL_L40S),
    "fallback order kept: first listed class with room wins": Case(
        [w("a", fallback=("a100-80gb", "cpu"))], [gpu_node("g1"), gpu_node("a1", "A100-80GB"), cpu_node("c1")],
        {"a": "a100-80gb"}, placed=FULL_L40S),
    "fallback skips a full class to the next": Case(
        [w("a", fallback=("a100-80gb", "cpu"))], [gpu_node("g1"), gpu_node("a1", "A100-80GB"), cpu_node("c1")],
        {"a": "cpu-16c-64g"}, placed=[*FULL_L40S, Placed("a1", "a100-80gb")],
        reasons={"a": "also tried a100-80gb (0 GPU free, 1 needed)"}),
    "explicit cpu class in the list": Case(
        [w("a", fallback=("cpu-4c-16g",))], [gpu_node("g1"), cpu_node("c1")], {"a": "cpu-4c-16g"},
        placed=FULL_L40S),
    "cpu picks a smaller class when the matching one has no room": Case(
        [w("a", fallback=("cpu",))], [gpu_node("g1", cpu=16, mem_gi=128), cpu_node("c1", cpu=4, mem_gi=16)],
        {"a": "cpu-4c-16g"},
        placed=[*FULL_L40S, Placed("g1", "cpu-8c-32g")],
        reasons={"a": "placed on cpu-4c-16g: l40s-48gb unavailable (fallback after 0s); "
                      "also tried cpu-8c-32g (4 vCPU free, 8 needed)"}),
    "cpu skips the classes no node can ever host (the GPU node's host share is kept)": Case(
        [w("a", fallback=("cpu",))], [gpu_node("g1", cpu=8, mem_gi=64), cpu_node("c1", cpu=4, mem_gi=16)],
        {"a": "cpu-4c-16g"},
        placed=FULL_L40S, reasons={"a": "placed on cpu-4c-16g: l40s-48gb unavailable (fallback after 0s)"}),
    "endpoint over the CPU limit skips cpu and says why": Case(
        [ep("a", fallback=("cpu",), params=70e9)], [gpu_node("g1"), cpu_node("c1", mem_gi=1024)], {"a": "wait"},
        placed=FULL_L40S, reasons={"a": "model too large: 70.0B params > 8.5B CPU limit"}),
    "endpoint over the limit still takes a GPU fallback": Case(
        [ep("a", fallback=("cpu", "a100-80gb"), params=70e9)], [gpu_node("g1"), gpu_node("a1", "A100-80GB")],
        {"a": "a100-80gb"}, placed=FULL_L40S),
    "endpoint under the limit goes to a CPU class with memory for its model": Case(
        [ep("a", fallback=("cpu",), params=8e9)], [gpu_node("g1"), cpu_node("c1")], {"a": "cpu-16c-64g"},
        placed=FULL_L40S),
    "endpoint model too big for a listed CPU class's memory": Case(
        [ep("a", fallback=("cpu-1c-4g",), params=7e9)], [gpu_node("g1"), cpu_node("c1")], {"a": "wait"},
        placed=FULL_L40S, reasons={"a": "too small for the model"}),
    "custom CPU limit from the policy": Case(
        [ep("a", fallback=("cpu",), params=3e9)], [gpu_node("g1"), cpu_node("c1")], {"a": "wait"},
        placed=FULL_L40S, policy=Policy(cpu_param_limit=1e9)),
    "FIFO among equals: the older gets the GPU": Case(
        [w("b", since=5, owner="o"), w("a", since=1, owner="o")], [gpu_node("g1")], {"a": "l40s-48gb", "b": "wait"}),
    "requesters first: a fallback never takes a requested class from its requesters": Case(
        [w("old", fallback=("a100-80gb",), since=0), w("new", "a100-80gb", since=100)],
        [gpu_node("g1"), gpu_node("a1", "A100-80GB")], {"old": "wait", "new": "a100-80gb"},
        placed=FULL_L40S, now=200),
    "requesters first: a waiting requester holds the class against fallbacks": Case(
        [w("r1", "a100-80gb", since=0), w("r2", "a100-80gb", since=1), w("f", fallback=("a100-80gb",), since=0)],
        [gpu_node("g1"), gpu_node("a1", "A100-80GB")], {"r1": "a100-80gb", "r2": "wait", "f": "wait"},
        placed=FULL_L40S, policy=Policy(owner_fairness=False), reasons={"f": "a100-80gb held for its requesters"}),
    "a workload that does not fit does not block smaller ones": Case(
        [w("big", "cpu-32c-128g", since=0), w("small", "cpu-4c-16g", since=1)], [cpu_node("c1", cpu=8, mem_gi=64)],
        {"big": "wait", "small": "cpu-4c-16g"}),
    "a starving head holds its node against later, smaller workloads": Case(
        [w("big", "cpu-32c-128g", since=0), w("small", "cpu-4c-16g", since=500)],
        [cpu_node("c1", cpu=32, mem_gi=128)], {"big": "wait", "small": "wait"},
        placed=[Placed("c1", "cpu-4c-16g")], now=600),
    "cpu classes use idle CPU of GPU nodes but leave the GPU's reserve": Case(
        [w("c", "cpu-16c-64g"), w("g", "l40s-48gb", since=1)], [gpu_node("g1", cpu=24, mem_gi=128)],
        {"c": "cpu-16c-64g", "g": "l40s-48gb"}),
    "reserve: no CPU class may take what the free GPU needs": Case(
        [w("c", "cpu-32c-128g")], [gpu_node("g1", cpu=36, mem_gi=256)], {"c": "wait"}),
    "GPU class only where its model is": Case(
        [w("h", "h100-80gb")], [gpu_node("g1"), cpu_node("c1")], {"h": "wait"}),
    "region respected": Case(
        [w("a", region="eu")], [gpu_node("g1")], {"a": "wait"}),
    "unknown requested class waits with a reason": Case(
        [w("a", "b200-192gb")], [gpu_node("g1")], {"a": "wait"}, reasons={"a": "not in the catalog"}),
    "unschedulable node is not used": Case(
        [w("a")], [Node("g1", "local", 32, 256 * 2**30, {"L40S": 1}, schedulable=False)], {"a": "wait"}),
    "owner fairness: a second owner goes before the first owner's second workload": Case(
        [w("a1", owner="a", since=0), w("a2", owner="a", since=1), w("b1", owner="b", since=2)],
        [gpu_node("g1", count=2, cpu=64)], {"a1": "l40s-48gb", "b1": "l40s-48gb", "a2": "wait"}),
    "owner fairness off: plain FIFO": Case(
        [w("a1", owner="a", since=0), w("a2", owner="a", since=1), w("b1", owner="b", since=2)],
        [gpu_node("g1", count=2, cpu=64)], {"a1": "l40s-48gb", "a2": "l40s-48gb", "b1": "wait"},
        policy=Policy(owner_fairness=False)),
    "endpoint on cpu is promoted when its class frees": Case(
        [], [gpu_node("g1"), cpu_node("c1")], {}, placed=[Placed("c1", "cpu-16c-64g")],
        running=[running("e", "cpu-16c-64g", "c1")], moves={"e": "l40s-48gb"}),
    "no promote while a requester of the class waits (it gets the GPU)": Case(
        [w("q")], [gpu_node("g1"), cpu_node("c1")], {"q": "l40s-48gb"}, placed=[Placed("c1", "cpu-16c-64g")],
        running=[running("e", "cpu-16c-64g", "c1")], moves={}),
    "endpoint promoted to an earlier entry when the requested class is still full": Case(
        [], [gpu_node("g1"), gpu_node("a1", "A100-80GB"), cpu_node("c1")], {},
        placed=[*FULL_L40S, Placed("c1", "cpu-16c-64g")],
        running=[running("e", "cpu-16c-64g", "c1", fallback=("a100-80gb", "cpu"))], moves={"e": "a100-80gb"}),
    "no promote while a move is under way": Case(
        [], [gpu_node("g1"), cpu_node("c1")], {}, placed=[Placed("c1", "cpu-16c-64g")],
        running=[running("e", "cpu-16c-64g", "c1", moving=True)], moves={}),
    "notebook on cpu is offered a restart, never moved": Case(
        [], [gpu_node("g1"), cpu_node("c1")], {}, placed=[Placed("c1", "cpu-16c-64g")],
        running=[running("n", "cpu-16c-64g", "c1", kind=WorkloadKind.NOTEBOOK)], moves={"n": "restart:l40s-48gb"}),
    "vm on a100 fallback is offered a restart on l40s": Case(
        [], [gpu_node("g1"), gpu_node("a1", "A100-80GB")], {}, placed=[Placed("a1", "a100-80gb")],
        running=[running("v", "a100-80gb", "a1", fallback=("a100-80gb",), kind=WorkloadKind.VM)],
        moves={"v": "restart:l40s-48gb"}),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_decide(case: Case) -> None:
    capacity = cap(case.nodes, case.placed)
    decisions = decide(case.queue, capacity, case.running, case.now, case.policy)
    got, moves = outcomes(decisions)
    assert got == case.want
    assert moves == case.moves
    by_id = {d.workload.id: d for d in decisions}
    for wid, text in case.reasons.items():
        assert text in by_id[wid].reason


def test_decide_leaves_the_callers_capacity_alone() -> None:
    capacity = cap([gpu_node("g1")])
    decide([w("a")], capacity, [], 0)
    again = decide([w("b")], capacity, [], 0)
    assert isinstance(again[0], Place)


def test_wait_records_eligibility_and_attempts() -> None:
    d = decide([w("a", fallback=("a100-80gb", "cpu"), after=600, since=100)], cap([gpu_node("g1")], FULL_L40S),
               [], 200)[0]
    assert isinstance(d, Wait)
    assert d.fallback_eligible_at == 700
    assert [(a.cls, a.outcome) for a in d.attempts] == [
        ("l40s-48gb", Outcome.NO_CAPACITY), ("a100-80gb", Outcome.NOT_ELIGIBLE_YET), ("cpu", Outcome.NOT_ELIGIBLE_YET)]
    assert (d.attempts[0].free, d.attempts[0].need) == (0, 1)


def test_starving_head_gets_in_once_capacity_frees() -> None:
    nodes = [cpu_node("c1", cpu=32, mem_gi=128)]
    queue = [w("big", "cpu-32c-128g", since=0), w("small", "cpu-4c-16g", since=50)]
    # Cycle 1: an earlier small workload runs on c1; the starving head holds c1, so the new small one waits too.
    first = decide(queue, cap(nodes, [Placed("c1", "cpu-4c-16g")]), [], 600)
    assert [type(x).__name__ for x in first] == ["Wait", "Wait"]
    # Cycle 2: that workload stopped; c1 was not refilled meanwhile, so the head fits before the small one.
    second = decide(queue, cap(nodes), [], 610)
    assert [(type(x).__name__, x.workload.id) for x in second] == [("Place", "big"), ("Wait", "small")]
    # Without the hold (head not yet starving), the small one would have taken c1 in cycle 1.
    unheld = decide(queue, cap(nodes, [Placed("c1", "cpu-4c-16g")]), [], 100)
    assert [type(x).__name__ for x in unheld] == ["Wait", "Place"]


@dataclass
class ReasonCase:
    queue: list[Queued]
    nodes: list[Node]
    now: float
    want: str  # the whole sentence of workload "a"
    placed: list[Placed] = field(default_factory=lambda: list(FULL_L40S))
    policy: Policy = field(default_factory=Policy)


SOLD_OUT = gpu_node("g1", cpu=8, mem_gi=64)  # one L40S and just the host share it needs, taken by FULL_L40S

REASONS = {
    "fallback_after 0, placed a moment after submission -> says the policy, not 1s": ReasonCase(
        [w("a", fallback=("cpu",))], [SOLD_OUT, cpu_node("c1")], now=0.6,
        want="placed on cpu-16c-64g: l40s-48gb unavailable (fallback after 0s)"),
    "fallback_after 0, the cycle came 1.4s later -> still the policy": ReasonCase(
        [w("a", fallback=("cpu",))], [SOLD_OUT, cpu_node("c1")], now=1.4,
        want="placed on cpu-16c-64g: l40s-48gb unavailable (fallback after 0s)"),
    "fallback_after 10m, placed as the timer runs out -> the ADR's sentence": ReasonCase(
        [w("a", fallback=("cpu",), after=600)], [SOLD_OUT, cpu_node("c1")], now=600,
        want="placed on cpu-16c-64g: l40s-48gb unavailable for 10m"),
    "fallback_after 10m, the timer noticed a tick late -> still 10m": ReasonCase(
        [w("a", fallback=("cpu",), after=600)], [SOLD_OUT, cpu_node("c1")], now=602.7,
        want="placed on cpu-16c-64g: l40s-48gb unavailable for 10m"),
    "fallback classes were full too -> the real wait, rounded down": ReasonCase(
        [w("a", fallback=("cpu",), after=600)], [SOLD_OUT, cpu_node("c1")], now=2460.9,
        want="placed on cpu-16c-64g: l40s-48gb unavailable for 41m"),
    "slack from the policy: beyond it the real wait shows": ReasonCase(
        [w("a", fallback=("cpu",), after=600)], [SOLD_OUT, cpu_node("c1")], now=602.7,
        policy=Policy(timer_slack_s=1), want="placed on cpu-16c-64g: l40s-48gb unavailable for 10m2s"),
    "the user's report (a 1-core node): only the CPU class it can ever host is tried": ReasonCase(
        [w("a", fallback=("cpu",))], [SOLD_OUT, cpu_node("c1", cpu=1, mem_gi=4)], now=0.6,
        want="placed on cpu-1c-4g: l40s-48gb unavailable (fallback after 0s)"),
    "CPU classes full, not too big -> the concrete class named and the others counted": ReasonCase(
        [w("a", fallback=("cpu",))], [SOLD_OUT, cpu_node("c1", cpu=64, mem_gi=256)], now=0.6,
        placed=[*FULL_L40S, *(Placed("c1", c) for c in ("cpu-32c-128g", "cpu-16c-64g", "cpu-8c-32g", "cpu-4c-16g",
                                                          "cpu-2c-8g"))],
        want="placed on cpu-2c-8g: l40s-48gb unavailable (fallback after 0s); "
             "also tried cpu-4c-16g (2 vCPU free, 4 needed) and 3 larger CPU classes"),
    "one CPU class full before the fit -> named alone": ReasonCase(
        [w("a", "cpu-32c-128g", fallback=("cpu",))], [cpu_node("c1", cpu=32, mem_gi=128)], now=0,
        placed=[Placed("c1", "cpu-16c-64g"), Placed("c1", "cpu-4c-16g")],
        want="placed on cpu-8c-32g: cpu-32c-128g unavailable (fallback after 0s); "
             "also tried cpu-16c-64g (12 vCPU free, 16 needed)"),
    "free vCPUs split over nodes -> the nearest miss says no single node has room": ReasonCase(
        [w("a", fallback=("cpu",))], [SOLD_OUT, cpu_node("c1", cpu=2, mem_gi=8), cpu_node("c2", cpu=2, mem_gi=8)],
        placed=[*FULL_L40S, Placed("c1", "cpu-1c-4g"), Placed("c2", "cpu-1c-4g")],
        now=0, want="placed on cpu-1c-4g: l40s-48gb unavailable (fallback after 0s); also tried cpu-2c-8g "
                    "(no single node has room; 2 vCPU free, 2 needed)"),
    "a GPU class and CPU classes tried, in list order": ReasonCase(
        [w("a", fallback=("a100-80gb", "cpu"), after=600)], [SOLD_OUT, cpu_node("c1", cpu=2, mem_gi=8)], now=600,
        placed=[*FULL_L40S, Placed("c1", "cpu-1c-4g")],
        want="placed on cpu-1c-4g: l40s-48gb unavailable for 10m; also tried a100-80gb (this region has none), "
             "cpu-2c-8g (1 vCPU free, 2 needed)"),
    "nothing fits, no node can host a CPU class -> the wait says so in one phrase": ReasonCase(
        [w("a", fallback=("cpu",))], [SOLD_OUT], now=0,
        want="waiting for l40s-48gb (0 GPU free, 1 needed); fallback tried: cpu (no node here is big enough for it)"),
    "nothing fits, CPU classes full -> the wait names the nearest CPU class": ReasonCase(
        [w("a", fallback=("cpu",))], [SOLD_OUT, cpu_node("c1", cpu=64, mem_gi=256)], now=0,
        placed=[*FULL_L40S, Placed("c1", "cpu-32c-128g"), Placed("c1", "cpu-32c-128g")],
        want="waiting for l40s-48gb (0 GPU free, 1 needed); fallback tried: cpu-1c-4g (0 vCPU free, 1 needed) "
             "and 5 larger CPU classes"),
    "a 2-core node: cpu means the classes it can ever host, not the 4-core ones it never will": ReasonCase(
        [w("a", fallback=("cpu",))], [cores_node("c1", cpu=8, cores=2, mem_gi=20)], now=0, placed=[],
        want="placed on cpu-2c-8g: l40s-48gb unavailable (fallback after 0s)"),
    "an explicit class no node can ever host -> said so, not 'no single node has room'": ReasonCase(
        [w("a", fallback=("cpu-4c-16g", "cpu-1c-4g"))], [cores_node("c1", cpu=8, cores=2, mem_gi=20)],
        now=0, placed=[], want="placed on cpu-1c-4g: l40s-48gb unavailable (fallback after 0s); "
                    "also tried cpu-4c-16g (no node here is big enough for it)"),
    "asking for a class no node can ever host -> the wait says a bigger node must join": ReasonCase(
        [w("a", "cpu-4c-16g")], [cores_node("c1", cpu=8, cores=2, mem_gi=20)], now=0, placed=[],
        want="waiting for cpu-4c-16g: no node here is big enough for it (a bigger node must join); "
             "no fallback accepted"),
    "requested class free -> just where": ReasonCase(
        [w("a", fallback=("cpu",))], [SOLD_OUT], now=0, placed=[], want="placed on l40s-48gb"),
}


@pytest.mark.parametrize("case", REASONS.values(), ids=REASONS.keys())
def test_reason(case: ReasonCase) -> None:
    [d] = decide(case.queue, cap(case.nodes, case.placed), [], case.now, case.policy)
    assert d.reason == case.want
