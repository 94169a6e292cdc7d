"""Invariants of decide, over random fleets and queues (hypothesis)."""

from __future__ import annotations

import random
import re
from unittest.mock import patch

from hypothesis import given, settings
from hypothesis import strategies as st

from tensora.placement import admission
from tensora.placement.admission import OwnerQuotas, Place, Promote, Queued, Wait, decide
from tensora.placement.capacity import Capacity, Node, Placed
from tensora.placement.kinds import WorkloadKind
from tensora.placement.quotas import RunningQuotas as Quotas
from tensora.units import parse_duration
from tests.support.builders import CATALOG, GI
from tests.support.strategies import nodes_st, queue_st


def _check_no_overcommit(nodes: list[Node], decisions: list) -> None:
    used: dict[str, list[float]] = {n.name: [0, 0] for n in nodes}
    gpus: dict[tuple[str, str], int] = {}
    for d in decisions:
        if isinstance(d, Place | Promote):
            cls = CATALOG[d.cls if isinstance(d, Place) else d.to_class]
            used[d.node][0] += cls.cpu
            used[d.node][1] += cls.memory
            if cls.gpu_model:
                gpus[(d.node, cls.gpu_model)] = gpus.get((d.node, cls.gpu_model), 0) + cls.gpu_count
    for n in nodes:
        assert used[n.name][0] <= n.cpu and used[n.name][1] <= n.memory
    for (node, model), count in gpus.items():
        assert count <= next(n for n in nodes if n.name == node).gpus.get(model, 0)


pods_nodes_st = st.lists(
    st.builds(lambda i, cpu, pods, l40s: Node(f"n{i}", "local", cpu, 256 * GI, {"L40S": l40s} if l40s else {},
                                              pods=pods),
              st.integers(0, 10_000), st.sampled_from([16, 64]), st.none() | st.integers(0, 3), st.integers(0, 2)),
    max_size=4, unique_by=lambda n: n.name,
)


@settings(max_examples=150, deadline=None)
@given(nodes=pods_nodes_st, queue=queue_st(), now=st.integers(0, 2000))
def test_pods_never_overcommitted(nodes: list[Node], queue: list[Queued], now: int) -> None:
    """Placed replicas on a node never outnumber its pods, across cycles with what the first placed kept."""
    cap = Capacity(nodes, [], CATALOG)
    first = decide(queue, cap, [], now)
    placed = [Placed(d.node, d.cls, d.workload.id) for d in first if isinstance(d, Place)]
    waiting = [d.workload for d in first if isinstance(d, Wait)]
    second = decide(waiting, Capacity(nodes, placed, CATALOG), [], now + 3600)
    count: dict[str, int] = {}
    for d in [*first, *second]:
        if isinstance(d, Place | Promote):
            count[d.node] = count.get(d.node, 0) + 1
    for n in nodes:
        assert n.pods is None or count.get(n.name, 0) <= n.pods


@settings(max_examples=150, deadline=None)
@given(nodes=nodes_st, queue=queue_st(), now=st.integers(0, 2000))
def test_invariants(nodes: list[Node], queue: list[Queued], now: int) -> None:
    decisions = decide(queue, Capacity(nodes, [], CATALOG), [], now)
    assert len([d for d in decisions if isinstance(d, Place | Wait)]) == len(queue)
    _check_no_overcommit(nodes, decisions)
    waiting_requested = {d.workload.gpu_class for d in decisions if isinstance(d, Wait)}
    for d in decisions:
        if not isinstance(d, Place):
            continue
        wl = d.workload
        assert d.cls in CATALOG  # always a concrete class, never the word "cpu"
        if d.fallback:
            # never before the timer
            assert now >= wl.queued_since + wl.fallback_after_s
            # primary requesters first: no fallback onto a class its requesters still wait for
            assert d.cls not in waiting_requested
            # fallback order kept: every entry before the chosen one was tried and did not fit
            chosen = d.attempts[-1]
            assert chosen.cls == d.cls
            index = wl.fallback.index(chosen.entry)
            tried_entries = {a.entry for a in d.attempts[1:-1]}
            assert set(wl.fallback[:index]) <= tried_entries
            # over-limit endpoints never on CPU
            if wl.kind == WorkloadKind.ENDPOINT and wl.model_params and wl.model_params > 8.5e9:
                assert not CATALOG[d.cls].is_cpu


@settings(max_examples=60, deadline=None)
@given(nodes=nodes_st, queue=queue_st(), now=st.integers(0, 2000), seed=st.integers(0, 2**32))
def test_deterministic_whatever_the_input_order(nodes: list[Node], queue: list[Queued], now: int, seed: int) -> None:
    first = decide(queue, Capacity(nodes, [], CATALOG), [], now)
    shuffled_q, shuffled_n = list(queue), list(nodes)
    random.Random(seed).shuffle(shuffled_q)
    random.Random(seed).shuffle(shuffled_n)
    second = decide(shuffled_q, Capacity(shuffled_n, [], CATALOG), [], now)
    assert first == second


ROOM = re.compile(r"([\w.-]+) \((?:no single node has room; )?(?:[\d.]+ (?:GPU|vCPU)|[\d.]+(?:[KMGT]i|B) memory) free, "
                  r"[\d.]+(?:[KMGT]i|B)? needed\)")
UNAVAILABLE = re.compile(r"unavailable (?:for ([0-9dhms]+)|\(fallback after 0s\))")


@settings(max_examples=150, deadline=None)
@given(nodes=nodes_st, queue=queue_st(), now=st.integers(0, 2000))
def test_reasons_read_right(nodes: list[Node], queue: list[Queued], now: int) -> None:
    """Every "N free, M needed" names a concrete class (never the word cpu), and a fallback
    placement states a wait no shorter than its policy and no longer than what passed."""
    for d in decide(queue, Capacity(nodes, [], CATALOG), [], now):
        for cls in ROOM.findall(d.reason):
            assert cls in CATALOG, d.reason
        if isinstance(d, Place) and d.fallback:
            match = UNAVAILABLE.search(d.reason)
            assert match, d.reason
            stated = parse_duration(match.group(1)) if match.group(1) else 0.0
            assert d.workload.fallback_after_s <= stated <= now - d.workload.queued_since, d.reason



@st.composite
def alike_queue_st(draw: st.DrawFn) -> list[Queued]:
    """Workloads past their fallback timers, drawn from few classes, lists, kinds and models: many alike."""
    out = []
    for i in range(draw(st.integers(0, 30))):
        cls = draw(st.sampled_from(["l40s-48gb", "a100-80gb"]))
        fallback = tuple(e for e in draw(st.sampled_from([("a100-80gb", "cpu"), ("cpu",), ("l40s-48gb", "cpu-4c-16g")]))
                         if e != cls)
        kind = draw(st.sampled_from(list(WorkloadKind)))
        params = draw(st.sampled_from([None, 1e9, 70e9])) if kind == WorkloadKind.ENDPOINT else None
        owner, since = draw(st.sampled_from("ab")), draw(st.integers(0, 9))
        out.append(Queued(f"w{i}", kind, cls, owner, "local", fallback, 0, since,
                          int(params) if params else None, int(params) * 2 if params else None))
    return out


@settings(max_examples=300, deadline=None)
@given(nodes=nodes_st, queue=alike_queue_st(), quota=st.sampled_from([None, (1, 4), (1, 8), (2, 16)]))
def test_a_list_tried_in_vain_is_known_for_the_alike_after_it(nodes: list[Node], queue: list[Queued],
                                                              quota: tuple[int, float] | None) -> None:
    """The second pass keeps each fallback list tried without a fit for the workloads alike after it
    (``admission._alike``): the decisions and reasons are those of trying each workload's list, quotas or not."""
    quotas = OwnerQuotas(Quotas(running_gpus=quota[0], running_cpu=quota[1])) if quota else None
    cap = Capacity(nodes, [], CATALOG)
    kept = decide(queue, cap, [], 100, quotas=quotas)
    with patch.object(admission, "REMEMBER_IN_VAIN", False):  # every list is tried
        each = decide(queue, cap, [], 100, quotas=quotas)
    assert kept == each
    assert [d.reason for d in kept] == [d.reason for d in each]
