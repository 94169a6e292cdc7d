"""Benchmark of the control API: ``POST /v1/workloads`` with ``Idempotency-Key``, over HTTP.

What it measures, for each store (SQLite in the data dir, and a PostgreSQL server this
script starts from Debian's package):

* ``POST /v1/workloads`` with a unique ``Idempotency-Key`` and name per request, at
  ``-c`` connections (default 16), driven by ``wrk`` (a Lua script builds each request):
  requests per second and latency p50 / p99. Targets on this 2-core machine: >= 500 req/s
  on SQLite, >= 1,000 req/s on PostgreSQL, p99 <= 20 ms.
* peers in the same run, on the same server: ``GET /healthz`` (the HTTP stack with no
  auth and no store: the ceiling for this server), and ``GET /v1/workloads/{id}`` (auth
  plus one read). The ratio POST / healthz says how much of the ceiling the write path keeps.
* a direct peer without HTTP: the same work (validate, claim the key, insert workload and
  event, store the response) called in-process, one at a time, on a fresh store of the same
  kind: the store's own cost per create, and the ratio of HTTP to it.

The server is the real ``tensora serve`` in a child process (simulated driver, controller
on: it places what it can while the load runs, as in production). ``wrk`` and the server
share the machine's cores; pin them with ``--server-cpus`` / ``--wrk-cpus`` to compare.

Run:  python bench/api.py                 (10 s per measurement, both stores)
      python bench/api.py --quick         (2 s, SQLite only: a smoke run)
      python bench/api.py --db postgresql --duration 20

Needs ``wrk`` (Debian: ``apt-get install wrk``). Prints a table and, with ``--json FILE``,
writes the figures as JSON. It exits 0 (a benchmark, not a test) unless a run fails
outright: a non-2xx response or a socket error in a run is an error, reported and exit 1.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository root: tests.support

from tests.support.services import PgCluster, free_port, pg_cluster

BENCH_WORKLOADS = 100_000
"""The bench owner's workloads quota (the most an admin may set): a run creates thousands."""

BENCH_CREATES_PER_MINUTE = 1_000_000
"""The bench owner's create rate (the most an admin may set), past the default 120 a minute."""

BODY = {"kind": "notebook", "gpu_class": "l40s-48gb", "fallback": ["a100-80gb", "cpu"], "fallback_after": "10m"}

POST_LUA = """
local counter = 0
local threads = 0
local nonce = "%(nonce)s"

function setup(thread)
  thread:set("tid", threads)
  threads = threads + 1
end

function request()
  counter = counter + 1
  local n = string.format("%%s-%%d-%%d", nonce, tid, counter)
  local body = '{"kind":"notebook","name":"nb-' .. n .. '","gpu_class":"l40s-48gb",' ..
               '"fallback":["a100-80gb","cpu"],"fallback_after":"10m"}'
  return wrk.format("POST", "/v1/workloads", {
    ["Authorization"] = "Bearer %(key)s",
    ["Content-Type"] = "application/json",
    ["Idempotency-Key"] = "bench-" .. n,
  }, body)
end
"""

GET_LUA = """
function request()
  return wrk.format("GET", "%(path)s", {["Authorization"] = "Bearer %(key)s"})
end
"""

DONE_LUA = """
function done(summary, latency, requests)
  io.write(string.format(
    "JSON {\\"requests\\":%d,\\"duration_us\\":%d,\\"p50_us\\":%d,\\"p99_us\\":%d,\\"max_us\\":%d," ..
    "\\"status_errors\\":%d,\\"socket_errors\\":%d}\\n",
    summary.requests, summary.duration, latency:percentile(50), latency:percentile(99), latency.max,
    summary.errors.status,
    summary.errors.connect + summary.errors.read + summary.errors.write + summary.errors.timeout))
end
"""


def taskset(cpus: str | None) -> list[str]:
    return ["taskset", "-c", cpus] if cpus and shutil.which("taskset") else []


@contextlib.contextmanager
def tensora_serve(data_dir: Path, db_url: str | None, cpus: str | None, workers: int) -> Iterator[tuple[str, str]]:
    """A real ``tensora serve`` child process; yields (base URL, admin key)."""
    port = free_port()
    cmd = [*taskset(cpus), sys.executable, "-m", "tensora.cli", "serve", "--data-dir", str(data_dir),
           "--port", str(port), "--workers", str(workers)]
    if db_url:
        cmd += ["--database-url", db_url]
    env = {**os.environ, "TENSORA_START_DELAY_S": "0.5", "TENSORA_LOG_LEVEL": "warning"}
    data_dir.mkdir(parents=True, exist_ok=True)
    log = open(data_dir / "serve.log", "w")  # noqa: SIM115 (closed below)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"tensora serve exited {proc.returncode}: {(data_dir / 'serve.log').read_text()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/readyz", timeout=2).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError("tensora serve did not become ready in 60 s")
            time.sleep(0.2)
        yield url, (data_dir / "admin-key").read_text().strip()
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def wrk(url: str, script: str, connections: int, duration: float, cpus: str | None) -> dict[str, Any]:
    with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as f:
        f.write(script + DONE_LUA)
        path = f.name
    try:
        threads = max(1, min(2, connections))
        out = subprocess.run([*taskset(cpus), "wrk", "-t", str(threads), "-c", str(connections),
                              "-d", f"{duration:g}s", "--timeout", "10s", "-s", path, url],
                             capture_output=True, text=True, timeout=duration + 60, check=True).stdout
    finally:
        os.unlink(path)
    match = re.search(r"^JSON (.*)$", out, re.M)
    if match is None:
        raise RuntimeError(f"wrk printed no summary:\n{out}")
    r = json.loads(match.group(1))
    return {"rps": r["requests"] / (r["duration_us"] / 1e6), "p50_ms": r["p50_us"] / 1000,
            "p99_ms": r["p99_us"] / 1000, "max_ms": r["max_us"] / 1000, "requests": r["requests"],
            "errors": r["status_errors"] + r["socket_errors"]}


def direct(db_url: str, data_dir: Path, n: int) -> dict[str, Any]:
    """The create path without HTTP: validate, claim, insert, store the response; one at a time."""
    from tensora.api.owners import check_quota
    from tensora.api.workloads import _out
    from tensora.config.catalog import default_catalog
    from tensora.config.settings import ServeSettings
    from tensora.control import workloads
    from tensora.control.spec import WorkloadSpec
    from tensora.serve import build

    services = build(ServeSettings(data_dir=data_dir, database_url=db_url, controller=False,
                                   quotas={"workloads": BENCH_WORKLOADS}), catalog=default_catalog())
    latencies = []
    t_start = time.perf_counter()
    for i in range(n):
        t0 = time.perf_counter()
        body = WorkloadSpec.model_validate({**BODY, "name": f"nb-direct-{i}", "region": services.region})
        checked = workloads.validate(body, services.catalog, "bench", services.storage)

        def action(conn: Any, checked: Any = checked) -> tuple[int, dict[str, Any]]:
            check_quota(conn, services, "bench", "workloads")  # as the route does: count under the owner's lock
            row = workloads.create(conn, checked, services.clock.now())
            return 201, _out(row, [], services)

        services.idempotency.run("bench", "POST", "/v1/workloads", f"direct-{i}", body.model_dump(mode="json"),
                                 action)
        latencies.append(time.perf_counter() - t0)
    elapsed = time.perf_counter() - t_start
    services.db.engine.dispose()
    latencies.sort()
    return {"rps": n / elapsed, "p50_ms": latencies[n // 2] * 1000, "p99_ms": latencies[int(n * 0.99)] * 1000,
            "requests": n, "errors": 0}


def bench_store(kind: str, workers: int, args: argparse.Namespace, pg: PgCluster | None) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix=f"tensora-bench-{kind}-"))
    try:
        db_url = pg.new_database() if pg else None
        with tensora_serve(work / "data", db_url, args.server_cpus, workers) as (url, admin):
            created = httpx.post(url + "/v1/keys", headers={"Authorization": f"Bearer {admin}"},
                                 json={"name": "bench", "owner": "bench"}, timeout=10)
            created.raise_for_status()
            key = created.json()["key"]
            room = httpx.put(url + "/v1/owners/bench", headers={"Authorization": f"Bearer {admin}"},
                             json={"quotas": {"workloads": BENCH_WORKLOADS},  # past the default 50
                                   "limits": {"creates_per_minute": BENCH_CREATES_PER_MINUTE}}, timeout=10)
            room.raise_for_status()
            one = httpx.post(url + "/v1/workloads", headers={"Authorization": f"Bearer {key}"},
                             json={**BODY, "name": "probe"}, timeout=10)
            one.raise_for_status()
            results = {}
            warm = min(2.0, args.duration)
            wrk(url, POST_LUA % {"nonce": "warm", "key": key}, args.connections, warm, args.wrk_cpus)
            results["POST /v1/workloads"] = wrk(url, POST_LUA % {"nonce": f"run{time.time_ns()}", "key": key},
                                                args.connections, args.duration, args.wrk_cpus)
            results["GET /v1/workloads/{id}"] = wrk(
                url, GET_LUA % {"path": f"/v1/workloads/{one.json()['id']}", "key": key},
                args.connections, args.duration, args.wrk_cpus)
            results["GET /healthz"] = wrk(url, GET_LUA % {"path": "/healthz", "key": key}, args.connections,
                                          args.duration, args.wrk_cpus)
            rows = httpx.get(url + "/v1/workloads?limit=1", headers={"Authorization": f"Bearer {key}"}, timeout=10)
            rows.raise_for_status()
        direct_url = pg.new_database() if pg else str(work / "direct.db")
        results["direct create (no HTTP)"] = direct(direct_url, work / "direct", args.direct_n)
        return results
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--db", default=None, help="sqlite,postgresql (default both; --quick: sqlite)")
    parser.add_argument("--duration", type=float, default=None, help="seconds per wrk run (default 10; quick 2)")
    parser.add_argument("-c", "--connections", type=int, default=16)
    parser.add_argument("--direct-n", type=int, default=None, help="creates in the direct peer (default 2000)")
    parser.add_argument("--workers", default=None, help="server worker counts to run, e.g. 1,2 (default 1,2; "
                        "quick: 1)")
    parser.add_argument("--server-cpus", default=None, help="taskset list for the server, e.g. 0")
    parser.add_argument("--wrk-cpus", default=None, help="taskset list for wrk, e.g. 1")
    parser.add_argument("--quick", action="store_true", help="a short smoke run")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = parser.parse_args()
    args.duration = args.duration or (2.0 if args.quick else 10.0)
    args.direct_n = args.direct_n or (200 if args.quick else 2000)
    stores = (args.db or ("sqlite" if args.quick else "sqlite,postgresql")).split(",")
    worker_counts = [int(w) for w in (args.workers or ("1" if args.quick else "1,2")).split(",")]
    if shutil.which("wrk") is None:
        print("bench/api.py needs wrk: apt-get install wrk", file=sys.stderr)
        return 1

    figures: dict[str, Any] = {}
    pg = pg_cluster() if "postgresql" in stores else None
    try:
        for kind in stores:
            for workers in worker_counts:
                figures[f"{kind} w={workers}"] = bench_store(kind, workers, args, pg if kind == "postgresql" else None)
    finally:
        if pg:
            pg.stop()

    targets = {"sqlite": 500, "postgresql": 1000}
    print(f"\ncontrol API, c={args.connections}, {args.duration:g} s per run, {os.cpu_count()} cores")
    print(f"{'store':<15} {'request':<26} {'req/s':>8} {'p50 ms':>8} {'p99 ms':>8} {'errors':>7}  vs")
    failed = False
    for kind, results in figures.items():
        post = results["POST /v1/workloads"]
        for name, r in results.items():
            ratio = ""
            if name != "POST /v1/workloads":
                ratio = f"POST = {post['rps'] / r['rps']:.2f}x this"
            print(f"{kind:<15} {name:<26} {r['rps']:>8.0f} {r['p50_ms']:>8.2f} {r['p99_ms']:>8.2f} "
                  f"{r['errors']:>7}  {ratio}")
            failed = failed or r["errors"] > 0
        target = targets[kind.split()[0]]
        met = post["rps"] >= target and post["p99_ms"] <= 20
        print(f"{kind:<15} target >= {target} req/s, p99 <= 20 ms: {'met' if met else 'NOT met'}")
    if args.json:
        args.json.write_text(json.dumps({"connections": args.connections, "duration_s": args.duration,
                                         "results": figures}, indent=2))
    if failed:
        print("some requests failed: see the errors column", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
