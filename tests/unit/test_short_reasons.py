"""Reasons name the resource that is short, with its numbers, and a class the region has none of is not
"busy": the pure rendering from attempts, and the figures capacity puts into them."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from tensora.placement.admission import decide
from tensora.placement.capacity import Node, Placed
from tensora.placement.decisions import Attempt, Outcome, Place, Queued, Wait, none_in_region_warning
from tensora.placement.kinds import WorkloadKind
from tests.support.builders import GI, cap, cpu_node, gpu_node, w


@dataclass(frozen=True)
class RenderCase:
    head: Attempt
    want: str
    fallback: tuple[str, ...] = ()
    rest: tuple[Attempt, ...] = ()


def _wait(case: RenderCase) -> Wait:
    q = Queued("a", WorkloadKind.NOTEBOOK, case.head.cls, fallback=case.fallback)
    return Wait(q, (case.head, *case.rest), None, 0)


RENDER = {
    "memory short": RenderCase(
        Attempt("cpu-2c-8g", Outcome.NO_CAPACITY, 1.5 * GI, 8 * GI, "memory"),
        "waiting for cpu-2c-8g (1.5Gi memory free, 8Gi needed); no fallback accepted"),
    "vCPU short": RenderCase(
        Attempt("cpu-4c-16g", Outcome.NO_CAPACITY, 2, 4, "vCPU"),
        "waiting for cpu-4c-16g (2 vCPU free, 4 needed); no fallback accepted"),
    "GPU short": RenderCase(
        Attempt("l40s-48gb", Outcome.NO_CAPACITY, 0, 1, "GPU"),
        "waiting for l40s-48gb (0 GPU free, 1 needed); no fallback accepted"),
    "pods short": RenderCase(
        Attempt("cpu-2c-8g", Outcome.NO_CAPACITY, 0, 1, "pods"),
        "waiting for cpu-2c-8g (0 pods free, 1 needed); no fallback accepted"),
    "enough in the region, spread over nodes": RenderCase(
        Attempt("cpu-2c-8g", Outcome.NO_CAPACITY, 4, 2, "vCPU"),
        "waiting for cpu-2c-8g (no single node has room; 4 vCPU free, 2 needed); no fallback accepted"),
    "none in region, no fallback": RenderCase(
        Attempt("l40s-48gb", Outcome.NONE_IN_REGION, 0, 1, "GPU"),
        "this region has no l40s-48gb (0 of 0); it waits until one is added, or add a fallback"),
    "none in region, a fallback tried and full": RenderCase(
        Attempt("l40s-48gb", Outcome.NONE_IN_REGION, 0, 1, "GPU"),
        "this region has no l40s-48gb (0 of 0); it waits until one is added; "
        "fallback tried: cpu-2c-8g (1.5Gi memory free, 8Gi needed)",
        fallback=("cpu-2c-8g",), rest=(Attempt("cpu-2c-8g", Outcome.NO_CAPACITY, 1.5 * GI, 8 * GI, "memory"),)),
    "none in region as a fallback tried": RenderCase(
        Attempt("l40s-48gb", Outcome.NO_CAPACITY, 0, 1, "GPU"),
        "waiting for l40s-48gb (0 GPU free, 1 needed); fallback tried: a100-80gb (this region has none)",
        fallback=("a100-80gb",), rest=(Attempt("a100-80gb", Outcome.NONE_IN_REGION, 0, 1, "GPU"),)),
}


@pytest.mark.parametrize("case", RENDER.values(), ids=RENDER.keys())
def test_rendered_from_attempts(case: RenderCase) -> None:
    assert _wait(case).reason == case.want


@dataclass
class DecideCase:
    queue: list[Queued]
    nodes: list[Node]
    want: str
    placed: list[Placed] = field(default_factory=list)


# A 4-vCPU, 21.5 GiB machine (the local profile): 20 GiB of it taken by one workload, 4 vCPUs still free.
LAPTOP = Node("local", "local", 8, int(21.5 * GI))
TAKEN = [Placed("local", "cpu-4c-16g"), Placed("local", "cpu-1c-4g")]  # 5 vCPUs, 20 GiB

DECIDED = {
    "memory short (the user's report): says memory, not vCPUs": DecideCase(
        [w("a", "cpu-2c-8g")], [LAPTOP], placed=TAKEN,
        want="waiting for cpu-2c-8g (1.5Gi memory free, 8Gi needed); no fallback accepted"),
    "memory short as a fallback tried": DecideCase(
        [w("a", "cpu-4c-16g", fallback=("cpu-2c-8g",))], [LAPTOP], placed=TAKEN,
        want="waiting for cpu-4c-16g (3 vCPU free, 4 needed); fallback tried: cpu-2c-8g "
             "(1.5Gi memory free, 8Gi needed)"),
    "vCPU short, memory plenty": DecideCase(
        [w("a", "cpu-4c-16g")], [cpu_node("c1", cpu=4, mem_gi=64)], placed=[Placed("c1", "cpu-1c-4g")],
        want="waiting for cpu-4c-16g (3 vCPU free, 4 needed); no fallback accepted"),
    "GPU short": DecideCase(
        [w("a")], [gpu_node("g1")], placed=[Placed("g1", "l40s-48gb")],
        want="waiting for l40s-48gb (0 GPU free, 1 needed); no fallback accepted"),
    "a GPU free but its node's host memory taken -> memory": DecideCase(
        [w("a")], [gpu_node("g1", count=2, cpu=32, mem_gi=100)], placed=[Placed("g1", "l40s-48gb")],
        want="waiting for l40s-48gb (36Gi memory free, 64Gi needed); no fallback accepted"),
    "pods full, vCPUs and memory plenty": DecideCase(
        [w("a", "cpu-2c-8g")], [Node("c1", "local", 64, 256 * GI, pods=2)],
        placed=[Placed("c1", "cpu-1c-4g"), Placed("c1", "cpu-1c-4g")],
        want="waiting for cpu-2c-8g (0 pods free, 1 needed); no fallback accepted"),
    "a GPU free but its node's pods all taken -> pods": DecideCase(
        [w("a")], [Node("g1", "local", 64, 512 * GI, {"L40S": 2}, pods=1)], placed=[Placed("g1", "l40s-48gb")],
        want="waiting for l40s-48gb (0 pods free, 1 needed); no fallback accepted"),
    "pods free only where vCPUs are not -> spread": DecideCase(
        [w("a", "cpu-2c-8g")], [Node("c1", "local", 64, 256 * GI, pods=1), cpu_node("c2", cpu=1)],
        placed=[Placed("c1", "cpu-1c-4g")],
        want="waiting for cpu-2c-8g (no single node has room; 64 vCPU free, 2 needed); no fallback accepted"),
    "none in region (a machine with no GPU)": DecideCase(
        [w("a")], [cpu_node("c1")],
        want="this region has no l40s-48gb (0 of 0); it waits until one is added, or add a fallback"),
    "none in region, CPU fallback later": DecideCase(
        [w("a", fallback=("cpu",), after=600)], [cpu_node("c1")],
        want="this region has no l40s-48gb (0 of 0); it waits until one is added; fallback to cpu from 00:10:00"),
    "a node of the model too small for the class -> not 'none in region'": DecideCase(
        [w("a", "a100-80gb")], [gpu_node("g1", model="A100-80GB", cpu=2, mem_gi=8)],
        want="waiting for a100-80gb: no node here is big enough for it (a bigger node must join); "
             "no fallback accepted"),
}


@pytest.mark.parametrize("case", DECIDED.values(), ids=DECIDED.keys())
def test_decided_reason(case: DecideCase) -> None:
    [d] = decide(case.queue, cap(case.nodes, case.placed), [], 0)
    assert d.reason == case.want


WARNINGS = {
    "no fallback": ((), "this region has no l40s-48gb (0 of 0); it waits until one is added, or add a fallback"),
    "a fallback": (("cpu",), "this region has no l40s-48gb (0 of 0); it waits until one is added, or runs on its "
                             "fallback (cpu) meanwhile"),
}


@pytest.mark.parametrize(("fallback", "want"), WARNINGS.values(), ids=WARNINGS.keys())
def test_create_warning(fallback: tuple[str, ...], want: str) -> None:
    assert none_in_region_warning("l40s-48gb", fallback) == want


def test_a_node_with_free_vcpus_but_no_free_pods_is_passed_over() -> None:
    full = Node("a-full", "local", 64, 256 * GI, pods=1)
    [d] = decide([w("x", "cpu-2c-8g")], cap([full, cpu_node("b-room")], [Placed("a-full", "cpu-1c-4g")]), [], 0)
    assert isinstance(d, Place) and d.node == "b-room"


def test_pods_are_counted_per_replica_within_a_cycle() -> None:
    queue = [w(f"x{i}", "cpu-1c-4g", since=i) for i in range(3)]
    decisions = decide(queue, cap([Node("a", "local", 64, 256 * GI, pods=2), cpu_node("b")]), [], 10)
    assert [d.node for d in decisions if isinstance(d, Place)] == ["a", "a", "b"]


def test_the_catalog_figure_counts_pods() -> None:
    summary = {c.cls: c.fits for c in cap([Node("c1", "local", 64, 256 * GI, pods=3)],
                                          [Placed("c1", "cpu-1c-4g")]).summary("local")}
    assert summary["cpu-1c-4g"] == 2 and summary["cpu-2c-8g"] == 2


def test_a_cordoned_node_of_the_model_is_busy_not_absent() -> None:
    cordoned = Node("g1", "local", 32, 256 * GI, {"L40S": 1}, schedulable=False)
    [d] = decide([w("a")], cap([cordoned, cpu_node("c1")]), [], 0)
    assert d.reason == "waiting for l40s-48gb (0 GPU free, 1 needed); no fallback accepted"
