"""Benchmark of the per-replica sandbox: what it costs a notebook to start, and what it costs in memory.

What it measures, in one run, with the real local driver (``tensora.drivers.local``):

* a notebook's start to ready (``LocalDriver.start`` until ``observe`` says running: JupyterLab answers
  ``/api/status`` on its host port) with ``isolation: none`` (a plain process of this user) and with the
  sandbox (runc, its own network namespace served by pasta, the owner's uid, the class's cgroup limits),
  alternating the two, ``--runs`` times each: the medians and their difference (target: <= +1 s). Also the
  time ``start`` itself blocks the controller (the sandbox is made then: namespace, pasta, runc).
* memory per sandbox beyond the workload itself: the PSS and RSS of its network helper, pasta (runc leaves
  no daemon or shim behind: the workload is the container's pid 1), with the workload's own PSS beside it
  for scale (target: <= 20 MiB). Kernel memory of the namespaces and cgroups is not counted.

The notebook runs on ``cpu-1c-4g`` (1 vCPU quota when sandboxed); the machine's other work shares its cores,
so the figures are rough: compare within one run, as here.

Run:  python bench/sandbox.py            (5 runs of each)
      python bench/sandbox.py --quick    (1 run of each: a smoke run, < 60 s)

Needs root, runc and pasta (``tensora.sandbox.available()``); without them it says why and exits 0. It exits 0
(a benchmark, not a test) unless a notebook fails to start, which is reported and exits 1.
"""

from __future__ import annotations

import argparse
import json
import secrets
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tensora.config.catalog import default_catalog
from tensora.drivers.base import ReplicaSpec
from tensora.drivers.local import Isolation, LocalDriver
from tensora.placement.capacity import Node
from tensora.placement.kinds import ReplicaState, WorkloadKind
from tensora.sandbox import available
from tensora.sandbox.network import helper_pid

MIB = 2**20
UID = 164_999  # a uid of the sandbox range no owner is likely to hold on this machine
ENDED = (ReplicaState.STOPPED, ReplicaState.FAILED)


def memory(pid: int) -> dict[str, int]:
    """PSS and RSS of a process, in bytes (``/proc/PID/smaps_rollup``)."""
    fields: dict[str, int] = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        name, _, rest = line.partition(":")
        if name in ("Pss", "Rss"):
            fields[name.lower()] = int(rest.split()[0]) * 1024
    return fields


def one_start(data: Path, isolation: Isolation, tag: str) -> dict[str, Any]:
    """Start a notebook, wait until it is ready, measure it, stop it."""
    d = LocalDriver(data, Node("bench", "local", 8, 16 << 30), default_catalog(), isolation=isolation)
    rid = f"rp_bench_{tag}"
    began = time.perf_counter()
    d.start(ReplicaSpec(rid, f"wl_bench_{tag}", WorkloadKind.NOTEBOOK, "cpu-1c-4g", "bench", owner="bench",
                        uid=UID, gid=UID))
    blocked = time.perf_counter() - began
    try:
        while True:
            seen = {s.id: s for s in d.observe()}[rid]
            if seen.state is not ReplicaState.STARTING:
                break
            time.sleep(0.02)
        ready = time.perf_counter() - began
        if seen.state is not ReplicaState.RUNNING:
            raise RuntimeError(f"the notebook did not start ({isolation}): {seen.detail}")
        meta = d._read(rid) or {}
        out: dict[str, Any] = {"ready_s": ready, "start_call_s": blocked, "workload": memory(int(meta["pid"]))}
        if isolation is Isolation.SANDBOX:
            pasta = helper_pid(d.runc.bundle(rid))
            out["pasta"] = memory(pasta) if pasta else {}
        return out
    finally:
        d.stop(rid)
        deadline = time.monotonic() + 30
        while {s.id: s for s in d.observe()}[rid].state not in ENDED and time.monotonic() < deadline:
            time.sleep(0.1)
        for sandbox_id in d.runc.list():
            d.runc.delete(sandbox_id)
        d.release(f"wl_bench_{tag}")  # its home: a file system of its own, unmounted with the workload


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=None, help="starts of each kind (default 5; quick 1)")
    parser.add_argument("--quick", action="store_true", help="one start of each: a smoke run")
    parser.add_argument("--data-dir", type=Path, default=None, help="where the replicas live (default: a temp dir)")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = parser.parse_args()
    why = available()
    if why is not None:
        print(f"no sandbox on this host: {why}")
        return 0
    runs = args.runs or (1 if args.quick else 5)
    root = args.data_dir or Path(tempfile.mkdtemp(prefix="tensora-bench-sandbox-"))
    results: dict[str, list[dict[str, Any]]] = {"none": [], "sandbox": []}
    run = secrets.token_hex(3)
    try:
        for i in range(runs):
            for isolation in (Isolation.NONE, Isolation.SANDBOX):  # alternate: the machine's drift hits both
                tag = f"{run}_{isolation.value}_{i}"
                results[isolation.value].append(one_start(root / tag, isolation, tag))
    except RuntimeError as exc:
        print(exc, file=sys.stderr)
        return 1
    plain = statistics.median(r["ready_s"] for r in results["none"])
    boxed = statistics.median(r["ready_s"] for r in results["sandbox"])
    call = statistics.median(r["start_call_s"] for r in results["sandbox"])
    pss = statistics.median(r["pasta"].get("pss", 0) for r in results["sandbox"]) / MIB
    rss = statistics.median(r["pasta"].get("rss", 0) for r in results["sandbox"]) / MIB
    own = statistics.median(r["workload"]["pss"] for r in results["sandbox"]) / MIB
    print(f"notebook start to ready (JupyterLab on cpu-1c-4g, median of {runs}):")
    for label, median, kind in (("no sandbox", plain, "none"), ("sandbox", boxed, "sandbox")):
        each = ", ".join(f"{r['ready_s']:.2f}" for r in results[kind])
        print(f"  {label:<10}  {median:6.2f} s   ({each})")
    print(f"  difference  {boxed - plain:+6.2f} s   (target <= +1 s); start() itself blocks {call * 1000:.0f} ms "
          "sandboxed (namespace, pasta, runc)")
    print(f"memory per sandbox beyond its workload: pasta PSS {pss:.1f} MiB, RSS {rss:.1f} MiB (target <= 20 MiB); "
          f"no runc process stays; the workload itself (JupyterLab) PSS {own:.0f} MiB")
    if args.json is not None:
        args.json.write_text(json.dumps({"ready_s": {"none": plain, "sandbox": boxed}, "start_call_s": call,
                                         "pasta_pss_mib": pss, "pasta_rss_mib": rss, "runs": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
