"""Benchmark of one admission cycle: ``tensora.placement.admission.decide`` over a large queue and fleet.

What it measures (wall time via ``time.perf_counter``, best of N runs per size):

* one ``decide(queue, capacity, running=[], now=...)`` cycle over 100,000 queued workloads
  and 10,000 nodes (target <= 2 s), and decisions per second for it (target >= 50,000/s);
* the same at 10k / 30k / 100k queued (nodes = queued / 10), with time / (n log n)
  normalised to the 10k case, so the growth can be judged (~1.0 means ~ n log n);
* as a peer, a trivial direct baseline (sort the queue by ``queued_since`` and do one dict
  lookup per workload), and the ratio of ``decide`` to it: the cost of admission relative
  to the least possible work.

The fleet is mixed (L40S / A100-80GB / H100 / H200 nodes with 1-8 GPUs, and CPU-only nodes),
in one region "local", some nodes partly used. The queue mixes kinds, requested classes,
fallback lists and timers, a few hundred owners, and endpoints of 1e9-70e9 parameters.
Everything is drawn from a seeded ``random.Random``, so runs are repeatable.

Run:  python bench/admission.py            (full run)
      python bench/admission.py --quick    (smaller, < 30 s, for a smoke test)
      taskset -c 0 python bench/admission.py   (pinned to one core)

It always exits 0 (a benchmark, not a test), but asserts that a cycle yields at least one
Place and one Wait, so a broken ``decide`` is noticed.
"""

from __future__ import annotations

import argparse
import gc
import math
import random
import time
import tracemalloc
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from tensora import native
from tensora.config.catalog import default_catalog
from tensora.placement.admission import Place, Queued, Wait, decide
from tensora.placement.admission_state import AdmissionState, ReplicaEnded, Submitted, step
from tensora.placement.capacity import Capacity, Node, Placed
from tensora.placement.catalog import Catalog
from tensora.placement.kinds import WorkloadKind

GIB = 2**30
REGION = "local"
NOW = 100_000.0
# GPU model -> (its 1-GPU class, host vCPU per GPU, host GiB per GPU) for node sizing
GPU_NODES = {
    "L40S": ("l40s-48gb", 8, 64),
    "A100-80GB": ("a100-80gb", 12, 120),
    "H100": ("h100-80gb", 16, 200),
    "H200": ("h200-141gb", 16, 240),
}
CPU_CLASSES = ["cpu-1c-4g", "cpu-2c-8g", "cpu-4c-16g", "cpu-8c-32g", "cpu-16c-64g", "cpu-32c-128g"]
FALLBACKS: list[tuple[str, ...]] = [
    ("a100-80gb", "cpu"), ("cpu",), ("h100-80gb", "a100-80gb"), ("l40s-48gb", "cpu"), ("h200-141gb",),
]


def build_fleet(n_nodes: int, rng: random.Random, catalog: Catalog) -> Capacity:
    """``n_nodes`` nodes, ~60% GPU nodes; ~40% of nodes have some classes already placed."""
    return Capacity(*fleet_parts(n_nodes, rng), catalog)


def fleet_parts(n_nodes: int, rng: random.Random) -> tuple[list[Node], list[Placed]]:
    """The nodes and placed replicas of :func:`build_fleet`."""
    nodes: list[Node] = []
    placed: list[Placed] = []
    models = list(GPU_NODES)
    for i in range(n_nodes):
        name = f"node-{i:06d}"
        if rng.random() < 0.6:
            model = rng.choice(models)
            cls, cpu_per, gib_per = GPU_NODES[model]
            count = rng.choice((1, 2, 4, 8))
            nodes.append(Node(name, REGION, cpu=cpu_per * count + 8, memory=(gib_per * count + 32) * GIB,
                              gpus={model: count}))
            if rng.random() < 0.4:
                placed.extend(Placed(name, cls, f"run-{i}-{k}") for k in range(rng.randint(1, count)))
        else:
            cpu = rng.choice((32, 64, 128))
            nodes.append(Node(name, REGION, cpu=cpu, memory=cpu * 4 * GIB))
            if rng.random() < 0.4:
                placed.extend(Placed(name, rng.choice(CPU_CLASSES), f"run-{i}-{k}") for k in range(rng.randint(1, 4)))
    return nodes, placed


def build_queue(n: int, rng: random.Random) -> list[Queued]:
    """``n`` queued workloads of mixed kinds and classes; ~half accept a fallback list."""
    kinds = list(WorkloadKind)
    gpu_classes = [v[0] for v in GPU_NODES.values()]
    owners = [f"owner-{k:03d}" for k in range(300)]
    out: list[Queued] = []
    for i in range(n):
        kind = rng.choice(kinds)
        gpu_class = rng.choice(gpu_classes) if rng.random() < 0.75 else rng.choice(CPU_CLASSES)
        fallback = rng.choice(FALLBACKS) if rng.random() < 0.5 else ()
        params = bytes_ = None
        if kind is WorkloadKind.ENDPOINT:
            params = int(rng.uniform(1e9, 70e9))
            bytes_ = 2 * params
        out.append(Queued(
            id=f"w-{i:07d}", kind=kind, gpu_class=gpu_class, owner=rng.choice(owners), region=REGION,
            fallback=fallback, fallback_after_s=rng.choice((0.0, 60.0, 300.0, 900.0, 3600.0)),
            queued_since=rng.uniform(0.0, NOW), model_params=params, model_bytes=bytes_,
        ))
    return out


def best_of(runs: int, fn: Callable[[], Any]) -> tuple[float, Any]:
    """The fastest of ``runs`` calls of ``fn``, and the result of the last call."""
    best, result = math.inf, None
    for _ in range(runs):
        t0 = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - t0)
    return best, result


def baseline(queue: list[Queued], catalog: Catalog) -> int:
    """The least possible work: sort by queued_since, one dict lookup per workload."""
    found = 0
    for w in sorted(queue, key=lambda w: w.queued_since):
        if catalog.get(w.gpu_class) is not None:
            found += 1
    return found


# -- the state kept across cycles (tensora.admission_state) ------------------------------------


@dataclass
class StepFigures:
    queued: int
    nodes: int
    first_s: float  # state built and the first full cycle decided
    first_decisions: int
    settle_s: list[float]  # the cycles after it, each re-deciding what its places changed, until none
    idle_ms: float  # a cycle with no event at the fixed point
    event_ms: float  # a GPU freed -> its decisions (the median of several, after one to warm up)
    event_decisions: int
    event_settle_s: float  # the cycle after the event's place
    memory_mib: float | None = None


def settle(state: AdmissionState, now: float) -> tuple[float, list[float]]:
    """Run cycles with no event until one decides nothing (the places of each change the world)."""
    times = []
    while True:
        now += 0.001
        t0 = time.perf_counter()
        state, got = step(state, [], now)
        times.append(time.perf_counter() - t0)
        if not got:
            return now, times[:-1]


def step_figures(n: int, n_nodes: int, runs: int, catalog: Catalog, regions: int = 1) -> StepFigures:
    """First cycle, settling, an idle cycle and a freed GPU, on the fleet and queue ``decide`` is measured on
    (``regions`` > 1: the same nodes and queue dealt round-robin into that many regions)."""
    rng = random.Random(20240601 + n)
    nodes, placed = fleet_parts(n_nodes, rng)
    queue = build_queue(n, rng)
    if regions > 1:
        nodes = [replace(node, region=f"r{i % regions}") for i, node in enumerate(nodes)]
        queue = [replace(w, region=f"r{i % regions}") for i, w in enumerate(queue)]
    # the events are the cycle's input, made by the caller (the controller's admission tracker from its rows); a
    # collection the earlier rows' garbage has made due is theirs, not the cycle's: both before the clock starts
    events = [Submitted(w) for w in queue]
    gc.collect()
    t0 = time.perf_counter()
    state, first = step(AdmissionState(nodes, placed, catalog), events, NOW)
    first_s = time.perf_counter() - t0
    now, settle_s = settle(state, NOW)
    idle, got = best_of(max(runs, 5), lambda: step(state, [], now + 0.0005)[1])
    assert got == [], "a cycle with no event decided something"
    # a GPU freed: an L40S replica placed before the queue arrived ends; its waiters may take it. The first is
    # a warm-up (the heaps that find where a queue head holds are built on first use); the median of the rest
    gpu = [p for p in placed if p.cls == "l40s-48gb"]
    events: list[tuple[float, int]] = []
    after = math.inf
    for k, p in enumerate(gpu[: max(runs, 5) + 1]):
        now += 1.0
        t0 = time.perf_counter()
        state, got = step(state, [ReplicaEnded(p)], now)
        secs = time.perf_counter() - t0
        if k:
            events.append((secs, len(got)))
        wanted = any(w.gpu_class == "l40s-48gb" for w in state.queue.values())
        taken = any(isinstance(d, Place) and d.cls == "l40s-48gb" for d in got)
        assert taken or not wanted, "the freed GPU was not taken by a waiter for it"
        now, rest = settle(state, now)
        after = min([after, *rest])
    event, event_n = sorted(events)[len(events) // 2]
    return StepFigures(n, n_nodes, first_s, len(first), settle_s, idle * 1e3, event * 1e3, event_n, after)


def state_memory_mib(n: int, n_nodes: int, catalog: Catalog) -> float:
    """What the state holds after its first full cycle, queue included (tracemalloc, the result list dropped)."""
    rng = random.Random(20240601 + n)
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    nodes, placed = fleet_parts(n_nodes, rng)
    state, first = step(AdmissionState(nodes, placed, catalog), [Submitted(w) for w in build_queue(n, rng)], NOW)
    del first, nodes, placed
    gc.collect()
    held = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    assert state.queue, "nothing left queued"
    return held / 2**20


def step_report(quick: bool, runs: int, catalog: Catalog) -> None:
    n_nodes = 1_000 if quick else 10_000
    sizes = [1_000, 10_000] if quick else [1_000, 10_000, 100_000, 100_000]
    spread = 10  # the last row again, in this many regions: an event re-decides only its own
    print()
    print(f"admission state kept across cycles (tensora.admission_state.step), {n_nodes:,} nodes; the event: "
          f"the median of {max(runs, 5)} GPUs freed one by one")
    print(f"{'queued':>8} {'first s':>8} {'settle s':>16} {'idle ms':>8} {'event ms':>9} {'decisions':>9} "
          f"{'next s':>7} {'MiB':>6}")
    rows = []
    for k, n in enumerate([*sizes, sizes[-1]]):
        in_regions = spread if k == len(sizes) else 1
        f = step_figures(n, n_nodes, runs, catalog, in_regions)
        if k == len(sizes) - 1:
            f.memory_mib = state_memory_mib(n, n_nodes, catalog)
        if in_regions == 1:
            rows.append(f)
        mem = f"{f.memory_mib:.0f}" if f.memory_mib is not None else "-"
        after = f"{f.event_settle_s:.3f}" if f.event_settle_s < math.inf else "-"
        label = f"{n}/{in_regions}r" if in_regions > 1 else f"{n}"
        print(f"{label:>8} {f.first_s:>8.3f} {' + '.join(f'{x:.2f}' for x in f.settle_s) or '-':>16} "
              f"{f.idle_ms:>8.3f} {f.event_ms:>9.1f} {f.event_decisions:>9} {after:>7} {mem:>6}")
    big = max(sizes)
    scale = big / 100_000
    last = [f for f in rows if f.queued == big]
    print()
    print(f"{'target':<48} {'measured':>18} {'verdict':>8}")
    for name, limit, got, unit in [  # an idle cycle and an event cost what changed, not what waits: not scaled
        (f"cycle with no event, {big:,} queued <= 5 ms", 5, [f.idle_ms for f in last], "ms"),
        (f"a GPU freed -> decisions, {big:,} queued <= 5 ms", 5, [f.event_ms for f in last], "ms"),
        (f"first full cycle, {big:,} x {n_nodes:,} <= {scale:g} s", scale, [f.first_s for f in last], "s"),
    ]:
        shown = " / ".join(f"{x:.3f}" for x in got) + f" {unit}"
        print(f"{name:<48} {shown:>18} {'PASS' if max(got) <= limit else 'MISS':>8}")
    mib = last[-1].memory_mib or 0.0
    print(f"{f'state memory, {big:,} queued <= {200 * scale:g} MiB':<48} {f'{mib:.0f} MiB':>18} "
          f"{'PASS' if mib <= 200 * scale else 'MISS':>8}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="smaller sizes and fewer runs (< 30 s)")
    args = parser.parse_args()
    sizes = [10_000, 30_000] if args.quick else [10_000, 30_000, 100_000]
    runs = 1 if args.quick else 3
    catalog = default_catalog()

    print(f"admission benchmark ({'quick' if args.quick else 'full'}): best of {runs} run(s) per size; "
          f"admission {native.why_pure() or 'compiled'} (tensora.native)")
    print(f"{'queued':>8} {'nodes':>6} {'decide s':>9} {'decisions/s':>12} {'t/nlogn':>8} "
          f"{'base s':>8} {'x base':>7} {'place':>7} {'wait':>7}")
    rows: dict[int, tuple[float, float]] = {}
    norm0: float | None = None
    for n in sizes:
        rng = random.Random(20240601 + n)
        capacity = build_fleet(n // 10, rng, catalog)
        queue = build_queue(n, rng)
        secs, decisions = best_of(runs, lambda q=queue, c=capacity: decide(q, c, running=[], now=NOW))
        base, _ = best_of(runs, lambda q=queue: baseline(q, catalog))
        n_place = sum(isinstance(d, Place) for d in decisions)
        n_wait = sum(isinstance(d, Wait) for d in decisions)
        assert n_place >= 1 and n_wait >= 1, f"decide looks broken: {n_place} Place, {n_wait} Wait"
        assert len(decisions) >= n, "decide returned fewer decisions than queued workloads"
        per_nlogn = secs / (n * math.log(n))
        norm0 = norm0 or per_nlogn
        rate = len(decisions) / secs
        rows[n] = (secs, rate)
        print(f"{n:>8} {n // 10:>6} {secs:>9.3f} {rate:>12,.0f} {per_nlogn / norm0:>8.2f} "
              f"{base:>8.4f} {secs / base:>7.1f} {n_place:>7} {n_wait:>7}")

    big = max(sizes)
    secs, rate = rows[big]
    limit = 2.0 * big / 100_000  # 2 s at 100k, scaled down for --quick
    print()
    print(f"{'target':<48} {'measured':>12} {'verdict':>8}")
    print(f"{f'decide, {big:,} queued / {big // 10:,} nodes <= {limit:g} s':<48} "
          f"{f'{secs:.3f} s':>12} {'PASS' if secs <= limit else 'MISS':>8}")
    print(f"{f'decisions/s at {big:,} queued >= 50,000':<48} "
          f"{f'{rate:,.0f}':>12} {'PASS' if rate >= 50_000 else 'MISS':>8}")
    if args.quick:
        print("(quick run: the 100k target is scaled to the largest size measured)")
    step_report(args.quick, runs, catalog)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
