"""Benchmark of the gateway's route document: a poll that finds no change against a full build.

Every gateway polls ``GET /v1/gateway/routes`` every second, and most polls find nothing changed. Building the
whole document (endpoints with their specs, replicas, every live key, owners), serializing and hashing it to
answer 304 is the peer; a poll reads the store's marker (``store.routes.route_marker``) instead and answers from the
document cached at that marker. Measured in process, on a store filled with ``--endpoints`` serving
endpoints (2 routable replicas each, a 2 KiB spec), ``--keys`` live keys and ``--owners`` owners with
limit overrides:

* ``full build``: what a poll costs without the marker: ``routes_table`` and the JSON of the answer;
* ``unchanged poll``: what a poll costs now when nothing changed (the marker query and a comparison);
* ``poll after a change``: a poll right after a key is created (marker, full build, serialization).

Each is the median of ``--runs`` calls, each in its own read transaction, as the handler does. The ratio
full / unchanged says how much cheaper the common poll is.

Run:  python bench/routes.py                 (SQLite and PostgreSQL, 300 endpoints, 10,000 keys)
      python bench/routes.py --quick         (SQLite, small: the smoke run in the test suite)
      python bench/routes.py --db postgresql --keys 50000 --json out.json

It exits 0 (a benchmark, not a test) unless a poll gives a wrong answer.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
from sqlalchemy import insert, update

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository root: tests.support

from tests.support.services import pg_cluster
from tests.support.stack import stack

from tensora.api import gatewayroutes
from tensora.api.auth import create_key
from tensora.store import owners as owners_repo
from tensora.store.tables import O, R, W


def fill(st: Any, endpoints: int, keys: int, owners: int) -> None:
    now = st.clock.now()
    spec = {"kind_spec": {"ttft_deadline_s": 10}, "image": None, "fallback_models": [], "pad": "x" * 2048}
    ws, rs = [], []
    for i in range(endpoints):
        wid = f"wl_bench{i:06d}"
        ws.append({"id": wid, "owner": f"owner-{i % max(owners, 1):05d}", "kind": "endpoint", "name": f"ep-{i}",
                   "region": "local", "gpu_class": "l40s-48gb", "requested_class": "l40s-48gb",
                   "placed_class": "l40s-48gb", "fallback": ["cpu"], "fallback_after_s": 600.0, "placement": "policy",
                   "state": "running", "reason": "", "fallback_eligible_at": None, "restart_available": False,
                   "restart_reason": "", "replicas": 2, "model": "m", "model_params": 10**9, "model_bytes": 2 * 10**9,
                   "spec": spec, "created_at": now, "updated_at": now, "queued_since": None, "deleted_at": None,
                   "released_at": None})
        rs += [{"id": f"rp_bench{i:06d}_{s}", "workload_id": wid, "slot": s, "cls": "l40s-48gb", "node": "n1",
                "region": "local", "state": "running", "role": "primary", "url": f"http://10.0.{i % 250}.{s}:8000/v1",
                "detail": "", "created_at": now, "updated_at": now, "served_model": None} for s in range(2)]
    with st.services.db.write() as conn:
        if ws:
            conn.execute(insert(W), ws)
            conn.execute(insert(R), rs)
        for i in range(keys):
            create_key(conn, f"owner-{i % max(owners, 1):05d}", "app", ["inference"], now)
        for i in range(owners):
            owners_repo.set_owner(conn, f"owner-{i:05d}", False, now)
        conn.execute(update(O).values(limits={"requests_per_minute": 100}))


def median_ms(runs: int, fn: Callable[[], Any]) -> float:
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1000


def measure(db: str, url: str, tmp: Path, a: argparse.Namespace) -> dict[str, Any]:
    st = stack(url, tmp, run_controller=False)
    svc = st.services
    try:
        fill(st, a.endpoints, a.keys, a.owners)
        cache = gatewayroutes.route_cache(svc)

        def full() -> None:
            with svc.db.read() as conn:
                orjson.dumps(gatewayroutes.routes_table(conn, svc))

        def poll() -> gatewayroutes.Document:
            with svc.db.read() as conn:
                return cache.get(conn, svc)

        first = poll()
        full_ms = median_ms(a.runs, full)
        builds = cache.builds
        unchanged_ms = median_ms(a.runs, poll)
        assert cache.builds == builds and poll() == first, "an unchanged poll rebuilt the document"

        def changed() -> None:
            with svc.db.write() as conn:
                create_key(conn, "owner-00000", "more", ["inference"], st.clock.now())
            doc = poll()
            assert doc.version != first.version, "a change was missed"

        changed_ms = median_ms(max(3, a.runs // 4), changed)
        return {"endpoints": a.endpoints, "keys": a.keys, "owners": a.owners, "document_bytes": len(first.body),
                "full_build_ms": round(full_ms, 3), "unchanged_poll_ms": round(unchanged_ms, 3),
                "poll_after_change_ms": round(changed_ms, 3), "ratio": round(full_ms / unchanged_ms, 1)}
    finally:
        svc.db.dispose()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--quick", action="store_true", help="SQLite only, small store, few runs")
    ap.add_argument("--db", choices=["sqlite", "postgresql", "both"], default=None)
    ap.add_argument("--endpoints", type=int, default=None)
    ap.add_argument("--keys", type=int, default=None)
    ap.add_argument("--owners", type=int, default=None)
    ap.add_argument("--runs", type=int, default=None)
    ap.add_argument("--json", type=Path, default=None, help="write the figures here")
    a = ap.parse_args()
    a.db = a.db or ("sqlite" if a.quick else "both")
    a.endpoints = a.endpoints if a.endpoints is not None else (20 if a.quick else 300)
    a.keys = a.keys if a.keys is not None else (500 if a.quick else 10_000)
    a.owners = a.owners if a.owners is not None else (50 if a.quick else 1_000)
    a.runs = a.runs or (10 if a.quick else 40)
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="tensora-bench-routes-") as d:
        if a.db in ("sqlite", "both"):
            results["sqlite"] = measure("sqlite", str(Path(d) / "s" / "tensora.db"), Path(d) / "s", a)
        if a.db in ("postgresql", "both"):
            pg = pg_cluster()
            try:
                results["postgresql"] = measure("postgresql", pg.new_database(), Path(d) / "p", a)
            finally:
                pg.stop()
    print(f"route document: {a.endpoints} endpoints x 2 replicas, {a.keys:,} keys, {a.owners:,} owners; "
          f"median of {a.runs} runs")
    print(f"{'store':<11} {'doc KiB':>8} {'full build ms':>14} {'unchanged ms':>13} {'after change ms':>16} "
          f"{'full/unchanged':>15}")
    for name, r in results.items():
        print(f"{name:<11} {r['document_bytes'] / 1024:>8.0f} {r['full_build_ms']:>14.2f} "
              f"{r['unchanged_poll_ms']:>13.3f} {r['poll_after_change_ms']:>16.2f} {r['ratio']:>14.1f}x")
    if a.json:
        a.json.write_text(json.dumps({"results": results}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
