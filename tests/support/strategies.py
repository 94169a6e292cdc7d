"""Hypothesis strategies of admission's inputs, shared by its property tests: fleets of nodes and queues of
workloads (their classes, fallback lists, kinds, models, owners and timers drawn at random). They generate only:
each test states its own checks."""

from __future__ import annotations

from hypothesis import strategies as st

from tensora.placement.admission import Queued
from tensora.placement.capacity import Node
from tensora.placement.kinds import WorkloadKind
from tests.support.builders import GI

CLASSES = ["l40s-48gb", "a100-80gb", "cpu-4c-16g", "cpu-16c-64g", "cpu-32c-128g"]
ENTRIES = ["a100-80gb", "l40s-48gb", "cpu", "cpu-4c-16g"]

nodes_st = st.lists(
    st.builds(
        lambda i, cpu, mem, l40s, a100: Node(f"n{i}", "local", cpu, mem * GI,
                                             {k: v for k, v in (("L40S", l40s), ("A100-80GB", a100)) if v}),
        st.integers(0, 10_000), st.sampled_from([4, 16, 32, 64]), st.sampled_from([16, 64, 128, 256]),
        st.integers(0, 2), st.integers(0, 1),
    ),
    max_size=6, unique_by=lambda n: n.name,
)


@st.composite
def queue_st(draw: st.DrawFn) -> list[Queued]:
    n = draw(st.integers(0, 25))
    out = []
    for i in range(n):
        cls = draw(st.sampled_from(CLASSES))
        fallback = tuple(e for e in draw(st.lists(st.sampled_from(ENTRIES), max_size=3, unique=True)) if e != cls)
        kind = draw(st.sampled_from(list(WorkloadKind)))
        params = draw(st.sampled_from([None, 1e9, 8e9, 70e9])) if kind == WorkloadKind.ENDPOINT else None
        out.append(Queued(f"w{i}", kind, cls, draw(st.sampled_from("abc")), "local", fallback,
                          draw(st.sampled_from([0, 60, 600])), draw(st.integers(0, 1000)),
                          int(params) if params else None, int(params) * 2 if params else None))
    return out
