"""Benchmark of ``tensora plan``: a whole plan, the process and the replay alone, on generated fleets.

What it measures (wall time, ``time.perf_counter``):

* ``tensora plan`` of 10,000 workloads on 1,000 nodes over 90 minutes, the whole process (a child
  process, imports and YAML included; target <= 2 s), and of 100,000 workloads on 10,000 nodes over
  24 hours (target <= 60 s);
* the replay alone (``tensora.control.fleet.replay``, files already loaded), and the share of it spent
  in admission's ``step`` (cProfile's cumulative time of ``admission_state.step`` over that of the replay,
  on a second, profiled run): the rest is reconcile, apply and telling admission what changed;
* three sizes of the 90-minute plan (1k, 3k, 10k workloads; nodes = workloads / 10), with time per
  workload normalised to the smallest, so the growth can be judged (~1.0 means linear).

The fleet and the workloads are drawn as ``bench/admission.py`` draws them (mixed GPU and CPU nodes in one
region, kinds, classes, fallback lists and timers, a few hundred owners, endpoints of 1e9-70e9
parameters), from a seeded ``random.Random``: submissions spread over the first hour (the first 2/3 of
the span), about a third stopped 5-60 minutes later.

Run:  python bench/plan.py            (full run: 1k, 3k, 10k x 90 min, and 100k x 24 h)
      python bench/plan.py --quick    (200, 600 x 90 min, < 30 s, for a smoke test)
      python bench/plan.py --up-to 10000   (the full run without the 100k x 24 h plan)
      python bench/plan.py --write DIR --workloads N --nodes M --span 90m   (only write the files)

It always exits 0 (a benchmark, not a test), but asserts that the plan places some workloads and leaves
some queued, so a broken replay is noticed.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

from admission import CPU_CLASSES, FALLBACKS, GPU_NODES, fleet_parts
from tensora import native
from tensora.config.catalog import default_catalog
from tensora.control import fleet
from tensora.placement.kinds import WorkloadKind
from tensora.units import format_duration, parse_duration

SEED = 20241204


def nodes_doc(n_nodes: int, rng: random.Random) -> dict[str, object]:
    """``n_nodes`` nodes of ``bench/admission.py``'s fleet (its replicas placed beforehand are left out:
    a plan starts on an empty fleet)."""
    nodes, _ = fleet_parts(n_nodes, rng)
    return {"nodes": [{"name": n.name, "region": n.region,
                       "allocatable": {"cpu": n.cpu, "memory": n.memory, "gpus": dict(n.gpus)}} for n in nodes]}


def workloads_doc(n: int, span_s: float, rng: random.Random) -> dict[str, object]:
    """``n`` workloads submitted over the first 2/3 of ``span_s``; about a third stop 5-60 minutes later."""
    kinds = list(WorkloadKind)
    gpu_classes = [v[0] for v in GPU_NODES.values()]
    owners = [f"owner-{k:03d}" for k in range(300)]
    out = []
    for i in range(n):
        kind = rng.choice(kinds)
        w: dict[str, object] = {
            "kind": kind.value, "name": f"w-{i:07d}", "owner": rng.choice(owners),
            "gpu_class": rng.choice(gpu_classes) if rng.random() < 0.75 else rng.choice(CPU_CLASSES),
        }
        fallback = [c for c in rng.choice(FALLBACKS) if c != w["gpu_class"]] if rng.random() < 0.5 else []
        if fallback:
            w["fallback"] = fallback
            w["fallback_after"] = rng.choice((0, 60, 300, 900, 3600))
        if kind is WorkloadKind.ENDPOINT:
            w["model_params"] = int(rng.uniform(1e9, 70e9))
        submitted = round(rng.uniform(0.0, span_s * 2 / 3))
        w["submitted_at"] = f"{submitted}s"
        if rng.random() < 0.33:
            w["stop_at"] = f"{submitted + round(rng.uniform(300, 3600))}s"
        out.append(w)
    return {"workloads": out}


def write_files(directory: Path, n: int, n_nodes: int, span_s: float, seed: int = SEED) -> tuple[Path, Path]:
    """A ``nodes.yaml`` and a ``workloads.yaml`` in ``directory``, drawn from ``seed`` and the sizes."""
    rng = random.Random(seed + n)
    directory.mkdir(parents=True, exist_ok=True)
    nodes, workloads = directory / "nodes.yaml", directory / "workloads.yaml"
    nodes.write_text(yaml.safe_dump(nodes_doc(n_nodes, rng), default_flow_style=None, width=200))
    workloads.write_text(yaml.safe_dump(workloads_doc(n, span_s, rng), default_flow_style=None, width=200))
    return nodes, workloads


@dataclass
class Figures:
    workloads: int
    nodes: int
    span_s: float
    process_s: float
    replay_s: float
    step_share: float
    """Of the replay, the share in ``admission_state.step`` (cProfile, from source); the rest is reconcile, apply and
    the events around it."""
    placed: int
    queued: int


def plan_process(nodes: Path, workloads: Path, at: str) -> tuple[float, dict[str, int]]:
    """Wall time of the whole ``tensora plan -o json`` process, and its rows counted by state."""
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", "from tensora.cli import main; main()", "plan", "--nodes", str(nodes),
                          "--workloads", str(workloads), "--at", at, "-o", "json"],
                         capture_output=True, text=True, check=False)
    secs = time.perf_counter() - t0
    assert out.returncode == 0, out.stderr
    states: dict[str, int] = {}
    for row in json.loads(out.stdout)["workloads"]:
        states[row["state"]] = states.get(row["state"], 0) + 1
    return secs, states


def replay_times(nodes: Path, workloads: Path, span_s: float) -> tuple[float, float]:
    """The replay alone, and (on a second, profiled run, from source) the share of it spent in admission's
    ``step``."""
    catalog = default_catalog()
    ns, ws = fleet.load_nodes(nodes), fleet.load_workloads(workloads, catalog)
    t0 = time.perf_counter()
    fleet.replay(ns, ws, catalog, span_s)
    secs = time.perf_counter() - t0
    return secs, step_share(nodes, workloads, span_s)


_SHARE = """
import cProfile, pstats, sys
from tensora.config.catalog import default_catalog
from tensora.control import fleet
catalog = default_catalog()
ns, ws = fleet.load_nodes(sys.argv[1]), fleet.load_workloads(sys.argv[2], catalog)
profile = cProfile.Profile()
profile.runcall(fleet.replay, ns, ws, catalog, float(sys.argv[3]))
table = pstats.Stats(profile).stats  # (file, line, name) -> (.., .., .., cumulative, ..)
step = sum(v[3] for k, v in table.items() if k[2] == "step" and k[0].endswith("admission_state.py"))
whole = sum(v[3] for k, v in table.items() if k[2] == "replay" and k[0].endswith("replay.py"))
print(step / whole)
"""


def step_share(nodes: Path, workloads: Path, span_s: float) -> float:
    """cProfile's cumulative time of ``admission_state.step`` over that of the replay, in a child process that
    runs from source (``TENSORA_PURE``): the profiler does not see into compiled functions."""
    out = subprocess.run([sys.executable, "-c", _SHARE, str(nodes), str(workloads), str(span_s)],
                         env={**os.environ, native.PURE_ENV: "1"}, capture_output=True, text=True, check=True)
    return float(out.stdout)


def measure(directory: Path, n: int, n_nodes: int, span: str) -> Figures:
    span_s = parse_duration(span)
    nodes, workloads = write_files(directory / f"{n}x{n_nodes}", n, n_nodes, span_s)
    process_s, states = plan_process(nodes, workloads, span)
    replay_s, share = replay_times(nodes, workloads, span_s)
    placed = states.get("running", 0) + states.get("starting", 0)
    assert placed >= 1 and states.get("queued", 0) >= 1, f"the plan looks broken: {states}"
    return Figures(n, n_nodes, span_s, process_s, replay_s, share, placed, states.get("queued", 0))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="smaller sizes (< 30 s)")
    parser.add_argument("--write", type=Path, help="only write nodes.yaml and workloads.yaml into this folder")
    parser.add_argument("--workloads", type=int, default=10_000)
    parser.add_argument("--nodes", type=int, default=1_000)
    parser.add_argument("--span", default="90m")
    parser.add_argument("--up-to", type=int, help="leave out the sizes above this many workloads")
    args = parser.parse_args()
    if args.write:
        write_files(args.write, args.workloads, args.nodes, parse_duration(args.span))
        return 0
    sizes = [(200, "90m"), (600, "90m")] if args.quick else [(1_000, "90m"), (3_000, "90m"), (10_000, "90m"),
                                                                   (100_000, "24h")]
    sizes = [(n, span) for n, span in sizes if args.up_to is None or n <= args.up_to]
    print(f"plan benchmark ({'quick' if args.quick else 'full'}): one run per size; "
          f"admission {native.why_pure() or 'compiled'} (tensora.native)")
    print(f"{'workloads':>9} {'nodes':>6} {'span':>5} {'process s':>9} {'replay s':>9} {'in step':>7} "
          f"{'us/wl':>7} {'x 1st':>5} {'placed':>7} {'queued':>7}")
    rows: list[Figures] = []
    with tempfile.TemporaryDirectory() as tmp:
        for n, span in sizes:
            f = measure(Path(tmp), n, n // 10, span)
            rows.append(f)
            per = f.replay_s / n
            norm = per / (rows[0].replay_s / rows[0].workloads)
            print(f"{n:>9} {n // 10:>6} {format_duration(f.span_s):>5} {f.process_s:>9.2f} {f.replay_s:>9.2f} "
                  f"{f.step_share:>7.0%} {per * 1e6:>7.0f} {norm:>5.2f} {f.placed:>7} {f.queued:>7}")
    print()
    print(f"{'target':<48} {'measured':>12} {'verdict':>8}")
    for n, limit in ((10_000, 2.0), (100_000, 60.0)):
        got = [f for f in rows if f.workloads == n]
        if got:
            name = f"tensora plan, {n:,} x {n // 10:,}, {format_duration(got[0].span_s)} <= {limit:g} s"
            print(f"{name:<48} {f'{got[0].process_s:.2f} s':>12} {'PASS' if got[0].process_s <= limit else 'MISS':>8}")
    if args.quick:
        print("(quick run: the targets' sizes are not run)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
