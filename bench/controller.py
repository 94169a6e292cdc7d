"""Benchmark of one controller cycle with a long queue of workloads carrying big ``spec`` blobs.

What it measures (wall time via ``time.perf_counter`` and the controller process's CPU time via
``time.process_time``, medians of N cycles): ``Controller.run_once``
on a fleet with no room left, so every queued workload is read and stays queued each cycle (the
steady state of a busy region). The queue is ``--queued`` notebooks (default 500), each row's
``spec`` padded to ``--spec-kib`` KiB (default 16, the most the API accepts), written straight to
the store so the same rows can be measured on any version of the code. Also reported: the bytes
of ``spec`` the cycle's snapshot reads (the blobs a cycle should not read for queued workloads).

An idle region (``--idle``): the controller's CPU time per cycle with 10,000, 30,000 and 100,000 queued
notebooks and nothing changing, two ways in the same run: *before*, every cycle from a full snapshot (the
kept admission state dropped before each: all live workloads read, all decided); *after*, the kept state told
what changed since the watermark (nothing). Also shown: the full-snapshot path's read and ``decide`` alone
(``tracker.from_scratch``), the least a full-snapshot cycle costs.

Run:  python bench/controller.py              (SQLite, 500 queued, 16 KiB specs, 20 cycles)
      python bench/controller.py --quick      (a smoke run, the idle figure at 2,000 queued too)
      python bench/controller.py --db postgresql
      python bench/controller.py --idle       (the idle region: 10k, 30k, 100k queued; --sizes to choose)

It always exits 0 (a benchmark, not a test) but asserts every cycle leads and leaves the queue waiting.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

from tensora.clock import FakeClock
from tensora.config.catalog import default_catalog
from tensora.control import snapshot, tracker
from tensora.control.controller import Controller
from tensora.drivers.simulated import SimulatedDriver
from tensora.placement.capacity import Node
from tensora.store import workloads as workloads_repo
from tensora.store.db import Database
from tensora.store.ids import new_id

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository root: tests.support
from tests.support.services import pg_cluster

GIB = 2**30
T0 = 1_700_000_000.0


def fill(db: Database, queued: int, spec_kib: int) -> None:
    """One notebook holding the only GPU, then ``queued`` notebooks waiting for it."""
    pad = "x" * max(0, spec_kib * 1024 - 200)
    with db.write() as conn:
        for i in range(queued + 1):
            workloads_repo.insert_workload(conn, {
                "id": new_id("wl_"), "owner": f"owner-{i % 50}", "kind": "notebook", "name": f"nb-{i}",
                "region": "local", "gpu_class": "l40s-48gb", "requested_class": "l40s-48gb", "placed_class": None,
                "fallback": [], "fallback_after_s": 0.0, "placement": "policy", "state": "queued",
                "reason": "queued for l40s-48gb", "fallback_eligible_at": None, "restart_available": False,
                "restart_reason": "", "replicas": 1, "model": None, "model_params": None, "model_bytes": None,
                "spec": {"kind_spec": {"pad": pad}, "image": None, "fallback_models": [],
                         "allow_cross_region": False, "model_path": None, "image_path": None},
                "created_at": T0 + i, "updated_at": T0 + i, "queued_since": T0 + i, "deleted_at": None})


def measure(db_url: str, queued: int, spec_kib: int, cycles: int) -> dict[str, float]:
    db = Database(db_url)
    db.migrate()
    fill(db, queued, spec_kib)
    clock = FakeClock(T0 + queued + 10)
    nodes = [Node("g1", "local", 16, 128 * GIB, {"L40S": 1})]
    c = Controller(db, SimulatedDriver(nodes, clock), default_catalog(), clock=clock)
    first = c.run_once()  # places the first notebook; the rest wait from here on
    assert first.leader and first.placed == 1, first
    times, cpu = [], []
    for _ in range(cycles):
        clock.advance(2)
        began, began_cpu = time.perf_counter(), time.process_time()
        report = c.run_once()
        times.append(time.perf_counter() - began)
        cpu.append(time.process_time() - began_cpu)
        assert report.leader and report.waiting == queued and report.placed == 0, report
    with db.read() as conn:
        got = workloads_repo.workloads_in(conn, "local", snapshot.LIVE)  # the snapshot's read (its rows hold no spec)
    spec_bytes = sum(len(str(getattr(w, "spec", None) or "")) for w in got)
    db.dispose()
    return {"median_ms": statistics.median(times) * 1000, "min_ms": min(times) * 1000,
            "cpu_ms": statistics.median(cpu) * 1000,
            "snapshot_spec_bytes": float(spec_bytes)}


def idle(db_url: str, queued: int, cycles: int) -> dict[str, float]:
    """Median controller CPU ms per cycle of an idle region with ``queued`` waiting: before (a full snapshot
    each cycle), after (the watermark), and the full-snapshot path's read and decide alone."""
    db = Database(db_url)
    db.migrate()
    fill(db, queued, 0)
    clock = FakeClock(T0 + queued + 400)  # every one queued past the starvation timer: no timer comes due
    nodes = [Node("g1", "local", 16, 128 * GIB, {"L40S": 1})]
    c = Controller(db, SimulatedDriver(nodes, clock), default_catalog(), clock=clock)
    assert c.run_once().placed == 1
    clock.advance(2)
    c.run_once()  # the placed one read back once; from here on nothing changes

    def cpu_ms(forget: bool) -> float:
        spent = []
        for _ in range(cycles):
            clock.advance(2)
            if forget:
                c.forget()
            began = time.process_time()
            report = c.run_once()
            spent.append(time.process_time() - began)
            assert report.leader and report.waiting == queued and report.placed == 0, report.waiting
            assert forget or not report.decided, len(report.decisions)  # after: nothing re-decided
        return statistics.median(spent) * 1000

    before, after = cpu_ms(forget=True), cpu_ms(forget=False)
    spent = []
    for _ in range(cycles):
        began = time.process_time()
        with db.read() as conn:
            _, decisions = tracker.from_scratch(conn, nodes, c.catalog, c.region, c.policy, c.owner_defaults.quotas,
                                             clock.now())
        spent.append(time.process_time() - began)
        assert len(decisions) == queued
    db.dispose()
    return {"before_ms": before, "after_ms": after, "old_read_decide_ms": statistics.median(spent) * 1000}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--queued", type=int, default=500)
    parser.add_argument("--spec-kib", type=int, default=16)
    parser.add_argument("--cycles", type=int, default=20)
    parser.add_argument("--db", choices=["sqlite", "postgresql"], default="sqlite")
    parser.add_argument("--quick", action="store_true", help="50 queued, 3 cycles (and the idle figure at 2,000)")
    parser.add_argument("--idle", action="store_true", help="only the idle-region figure")
    parser.add_argument("--sizes", default="10000,30000,100000", help="queue lengths of the idle figure")
    parser.add_argument("--idle-cycles", type=int, default=5)
    args = parser.parse_args()
    if args.quick:
        args.queued, args.cycles, args.sizes, args.idle_cycles = 50, 3, "2000", 3
    with ExitStack() as stack:
        work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="tensora-bench-controller-")))
        pg = None
        if args.db == "postgresql":
            pg = pg_cluster()
            stack.callback(pg.stop)

        def url(name: str) -> str:
            return pg.new_database() if pg is not None else str(work / f"{name}.db")

        if not args.idle:
            r = measure(url("busy"), args.queued, args.spec_kib, args.cycles)
            print(f"{args.db}: run_once with {args.queued} queued ({args.spec_kib} KiB specs): median "
                  f"{r['median_ms']:.1f} ms, min {r['min_ms']:.1f} ms, controller CPU {r['cpu_ms']:.1f} ms (median); "
                  f"spec bytes read by the snapshot: {r['snapshot_spec_bytes']:.0f}")
        if args.idle or args.quick:
            for n in (int(x) for x in args.sizes.split(",")):
                i = idle(url(f"idle-{n}"), n, args.idle_cycles)
                print(f"{args.db}: idle region, {n} queued: controller CPU per cycle (median of {args.idle_cycles}): "
                      f"before (full snapshot) {i['before_ms']:.1f} ms, after (watermark) {i['after_ms']:.2f} ms; "
                      f"the old read+decide alone {i['old_read_decide_ms']:.1f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
