"""Benchmark of one admission cycle: ``tensora.admission.decide`` over a large queue and fleet.

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
import math
import random
import time
from collections.abc import Callable
from typing import Any

from tensora.admission import Place, Queued, Wait, decide
from tensora.capacity import Capacity, Node, Placed
from tensora.catalog import Catalog, default_catalog
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
    return Capacity(nodes, placed, catalog)


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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="smaller sizes and fewer runs (< 30 s)")
    args = parser.parse_args()
    sizes = [10_000, 30_000] if args.quick else [10_000, 30_000, 100_000]
    runs = 1 if args.quick else 3
    catalog = default_catalog()

    print(f"admission benchmark ({'quick' if args.quick else 'full'}): best of {runs} run(s) per size")
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
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
