"""Benchmark of the inference gateway against the backend direct and two peers, in one run.

The same bounded loopback load goes to:

* **direct**: a fast fake OpenAI backend (``tests/support/fakebackend.py``: raw asyncio + uvloop
  + httptools, SSE too), two of them (two "replicas");
* **tensora**: ``python -m tensora.gateway`` in front of them, keys, metering (records spooled and
  sent to a usage sink) and rate limits ON; routes from its disk cache, as after a control API
  outage (the control URL is a sink that has no route table);
* **litellm**: the LiteLLM proxy (own venv, ``pip install 'litellm[proxy]'``), two deployments and a
  fallback group, a master key, no database, ``LITELLM_LOCAL_MODEL_COST_MAP=True``;
* **vllm-router**: the Rust router (own venv, ``pip install vllm-router``), round robin;
* **tensora busy-poll**: tensora again with busy polling on (``busy_poll_us``, off by default; ``--busy-poll-us``).

The proxies are pinned to one core (``--proxy-cpu``: all of them, the multi-threaded vllm-router too) and
the load generator and backends to the other (``--load-cpu``), so proxies compare per core. All of them run
at once, and the non-streaming load (``wrk``, c=1 then c=32) goes to each in turn (every other round in
reverse order), ``--rounds`` times: on a machine shared with other work, figures of the same round compare,
figures of different runs barely; the table is the median of the rounds, and the ratios to vllm-router are
taken round by round. 20-chunk streams
are timed one at a time by a small pooled client (first content chunk and total). Then failover: tensora
with a dead replica in front of a live one, its breaker never opening (every other request tries the dead
one first), and with the default breaker (it opens).

Run:  python bench/gateway.py                (10 s a measurement, 3 rounds, peers installed on first use)
      python bench/gateway.py --quick        (1 s, one round, no peers: the smoke run in the test suite)
      python bench/gateway.py --json out.json
      python bench/gateway.py --metrics --no-peers   (and tensora with metrics off/on, alternately, --rounds 3)
Peers' venvs live in ``.cache/bench`` (``--peers-dir``); ``--no-peers`` leaves them out. Exits 0
(a benchmark, not a test) unless a run fails outright (non-2xx answers or socket errors).
"""

from __future__ import annotations

import argparse
import asyncio
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
from statistics import median
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository root: tests.support

from tests.support.services import free_port

from api import taskset
from tensora.keys import apikeys

ROOT = Path(__file__).resolve().parent.parent
FAKEBACKEND = str(ROOT / "tests" / "support" / "fakebackend.py")  # a child process: not part of the product
BODY = {"model": "my-llm", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 16}
CONTENT = re.compile(rb'"content": ?"[^"]')

POST_LUA = """
wrk.method = "POST"
wrk.body = '%(body)s'
wrk.headers["Content-Type"] = "application/json"
wrk.headers["Authorization"] = "Bearer %(key)s"
function request() return wrk.format(nil, "%(path)s") end
"""


def wrk(url: str, path: str, key: str, connections: int, duration: float, cpus: str | None) -> dict[str, Any]:
    from api import wrk as run_wrk

    script = POST_LUA % {"body": json.dumps(BODY), "key": key, "path": path}
    return run_wrk(url, script, connections, duration, cpus)


@contextlib.contextmanager
def process(cmd: list[str], log: Path, ready: str, env: dict[str, str] | None = None,
            deadline_s: float = 120) -> Iterator[subprocess.Popen[bytes]]:
    with log.open("wb") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})},
                                start_new_session=True)
    try:
        deadline = time.monotonic() + deadline_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{cmd[0]} exited {proc.returncode}: {log.read_text()[-2000:]}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(ready, timeout=2).status_code < 500:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"{' '.join(cmd[:3])} not ready in {deadline_s} s: {log.read_text()[-2000:]}")
            time.sleep(0.2)
        yield proc
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def streams(base: str, path: str, key: str, n: int) -> dict[str, Any]:
    """``n`` 20-chunk streams one after another: time to the first content chunk, and in total."""
    from tensora.gateway.upstream import Client

    body = json.dumps({**BODY, "stream": True, "max_tokens": 20}).encode()

    async def run() -> tuple[list[float], list[float]]:
        client = Client()
        first, total = [], []
        for _ in range(n):
            t0 = time.perf_counter()
            resp = await client.post(base, path, body, [("authorization", f"Bearer {key}")], 30)
            if resp.status != 200:
                raise RuntimeError(f"stream answered {resp.status}: {(await resp.read())[:300]!r}")
            t1 = None
            seen = b""
            while (chunk := await resp.next_chunk()) is not None:
                seen += chunk
                if t1 is None and CONTENT.search(seen):
                    t1 = time.perf_counter()
            resp.release()
            t2 = time.perf_counter()
            if b"[DONE]" not in seen or t1 is None:
                raise RuntimeError("a stream ended without content or [DONE]")
            first.append((t1 - t0) * 1000)
            total.append((t2 - t0) * 1000)
        client.close()
        return first, total

    first, total = asyncio.run(run())
    first.sort()
    total.sort()
    return {"first_p50_ms": median(first), "total_p50_ms": median(total),
            "total_p99_ms": total[min(len(total) - 1, int(len(total) * 0.99))], "requests": n}


def measure(name: str, base: str, key: str, a: argparse.Namespace, out: dict[str, Any]) -> None:
    """One round of the non-streaming load on one target; ``base``: the server's root URL (its API under /v1)."""
    r = out.setdefault(name, {"rounds": []})
    if not r["rounds"]:
        wrk(base, "/v1/chat/completions", key, 4, min(1.0, a.duration), a.load_cpu)  # warm up
    one = {"c1": wrk(base, "/v1/chat/completions", key, 1, a.duration, a.load_cpu),
           "c32": wrk(base, "/v1/chat/completions", key, 32, a.duration, a.load_cpu)}
    for k in ("c1", "c32"):
        if one[k]["errors"]:
            raise RuntimeError(f"{name} {k}: {one[k]['errors']} errors")
    r["rounds"].append(one)
    for k in ("c1", "c32"):  # the medians of the rounds so far, figure by figure
        r[k] = {f: median(x[k][f] for x in r["rounds"]) for f in one[k]}
    print(f"  {name:<22} c=1 {one['c1']['rps']:>8.0f} req/s p50 {one['c1']['p50_ms']:.3f} p99 "
          f"{one['c1']['p99_ms']:.3f} ms | c=32 {one['c32']['rps']:>8.0f} req/s p50 {one['c32']['p50_ms']:.2f} p99 "
          f"{one['c32']['p99_ms']:.2f} ms", flush=True)


def measure_streams(name: str, base: str, key: str, a: argparse.Namespace, out: dict[str, Any]) -> None:
    s = out[name]["stream20"] = streams(base + "/v1", "/chat/completions", key, a.streams)
    print(f"  {name:<22} 20-chunk stream: first {s['first_p50_ms']:.3f} total {s['total_p50_ms']:.3f} ms",
          flush=True)


def venv(peers: Path, name: str, package: str, exe: str) -> Path | None:
    bin_ = peers / name / "bin" / exe
    if bin_.exists():
        return bin_
    print(f"installing {package} into {peers / name} (once)...", flush=True)
    subprocess.run([sys.executable, "-m", "venv", str(peers / name)], check=True)
    done = subprocess.run([str(peers / name / "bin" / "pip"), "install", "-q", package], capture_output=True,
                          text=True)
    if done.returncode != 0 or not bin_.exists():
        print(f"  {package} could not be installed; left out:\n{done.stderr[-1000:]}", flush=True)
        return None
    return bin_


def gateway_settings(tmp: Path, sink: str, port: int, *, consecutive: int = 5, metrics: bool | None = True,
                     busy_poll_us: int = 0) -> str:
    """``metrics``: on (the default, as shipped), off, or None: the setting left out (a --baseline-src tree from
    before metrics would refuse it). ``busy_poll_us``: 0 (the default) leaves the setting out."""
    return json.dumps({"data_dir": str(tmp), "control_url": sink, "port": port, "region": "bench",
                       "requests_per_minute": 10**9, "tokens_per_minute": 10**12, "poll_s": 5,
                       "breaker_consecutive": consecutive, "log_level": "error",
                       **({} if metrics is None else
                          {"metrics_listen": f"127.0.0.1:{free_port()}" if metrics else None}),
                       **({"busy_poll_us": busy_poll_us} if busy_poll_us else {})})


def write_routes(tmp: Path, key: str, urls: list[str]) -> None:
    reps = [{"id": f"r{i}", "url": u, "cls": "l40s-48gb", "cpu": False, "upstream_model": "/models/m"}
            for i, u in enumerate(urls)]
    table = {"version": "bench", "region": "bench", "endpoints": [
        {"id": "wl_bench", "name": "my-llm", "owner": "bench", "region": "bench", "model": "/models/m",
         "requested_cpu": False, "cpu_fallback": False, "replicas": reps}],
        "keys": [{"id": "key_bench", "digest": apikeys.digest(key), "owner": "bench", "scopes": ["inference"]}]}
    (tmp / "gateway").mkdir(parents=True, exist_ok=True)
    (tmp / "gateway" / "routes.json").write_text(json.dumps(table))
    (tmp / "admin-key").write_text(key + "\n")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--duration", type=float, default=10.0)
    ap.add_argument("--rounds", type=int, default=3, help="each target's c=1 and c=32 runs, in turn with the others")
    ap.add_argument("--streams", type=int, default=300)
    ap.add_argument("--quick", action="store_true", help="1 s runs, 30 streams, no peers")
    ap.add_argument("--proxy-cpu", default="0")
    ap.add_argument("--load-cpu", default="1")
    ap.add_argument("--peers-dir", type=Path, default=ROOT / ".cache" / "bench")
    ap.add_argument("--no-peers", action="store_true")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--baseline-src", type=Path, help="also the gateway of another source tree (its src/, e.g. "
                    "of `git archive main`) as 'tensora baseline', in the same rounds: an A/B of a change")
    ap.add_argument("--busy-poll-us", type=int, default=100, help="also tensora with busy polling on, this many µs "
                    "(the setting busy_poll_us, off by default), as 'tensora busy-poll'; 0: not")
    ap.add_argument("--metrics", action="store_true", help="also tensora with its metrics off and on, alternately "
                    "(--rounds each), in the same run: what counting them costs")
    a = ap.parse_args()
    if a.quick:
        a.duration, a.streams, a.no_peers, a.rounds, a.busy_poll_us = 1.0, 30, True, 1, 0
    if (os.cpu_count() or 1) < 2:
        a.proxy_cpu = a.load_cpu = None
    if shutil.which("wrk") is None:
        print("wrk is needed: apt-get install wrk", file=sys.stderr)
        return 1
    results: dict[str, Any] = {}
    key = apikeys.generate()
    py = sys.executable
    with tempfile.TemporaryDirectory(prefix="tensora-bench-gw-") as d:
        tmp = Path(d)
        ports = [free_port() for _ in range(3)]
        backs = [f"http://127.0.0.1:{p}" for p in ports]
        with contextlib.ExitStack() as stack:
            for i, p in enumerate(ports):
                stack.enter_context(process(
                    [*taskset(a.load_cpu), py, FAKEBACKEND, "--port", str(p),
                     "--name", f"b{i}", "--chunks", "20"], tmp / f"backend{i}.log", f"{backs[i]}/v1/models"))
            sink = backs[2]  # takes the gateway's usage batches; has no route table
            print(f"gateway benchmark: proxies on cpu {a.proxy_cpu}, load and backends on cpu {a.load_cpu}; "
                  f"{a.duration:g} s a run, {a.rounds} round(s)", flush=True)
            with contextlib.ExitStack() as proxies:
                targets = {"direct": (backs[0], key)}

                def gateway(d: Path, env: dict[str, str] | None = None, **settings: Any) -> tuple[str, str]:
                    """A Tensora gateway in front of the first two backends: its own data dir, spool and port."""
                    write_routes(d, key, [f"{b}/v1" for b in backs[:2]])
                    port = free_port()
                    proxies.enter_context(process(
                        [*taskset(a.proxy_cpu), py, "-m", "tensora.gateway"], d / "gateway.log",
                        f"http://127.0.0.1:{port}/healthz",
                        env={"TENSORA_GATEWAY_SETTINGS": gateway_settings(d, sink, port, **settings), **(env or {})}))
                    return f"http://127.0.0.1:{port}", key

                targets["tensora"] = gateway(tmp)
                if a.busy_poll_us:  # the same gateway with busy polling on (opt-in)
                    targets["tensora busy-poll"] = gateway(tmp / "busy-poll", busy_poll_us=a.busy_poll_us)
                if a.baseline_src is not None:  # another tree's (maybe from before metrics: the setting left out)
                    baseline = {"PYTHONPATH": str(a.baseline_src.resolve())}
                    targets["tensora baseline"] = gateway(tmp / "baseline", baseline, metrics=None)
                if not a.no_peers:
                    targets.update(peers(a, tmp, key, backs, proxies))
                names = list(targets)
                for i in range(a.rounds):  # every other round in reverse: no proxy always follows the same one
                    print(f" round {i + 1}", flush=True)
                    for name in names if i % 2 == 0 else names[::-1]:
                        measure(name, *targets[name], a, results)
                for name, (base, k) in targets.items():
                    measure_streams(name, base, k, a, results)
            spool = list((tmp / "gateway" / "spool").glob("batch-*.jsonl"))
            results["tensora"]["usage_batches_left"] = len(spool)
            if a.metrics:
                metrics_on_off(a, tmp, key, sink, results)

            # failover: a dead replica (nothing listens) in front of a live one
            dead = f"http://127.0.0.1:{free_port()}/v1"
            for label, consecutive in (("tensora dead replica", 10**9), ("tensora breaker open", 5)):
                fdir = tmp / label.replace(" ", "-")
                write_routes(fdir, key, [dead, f"{backs[0]}/v1"])
                port = free_port()
                with process([*taskset(a.proxy_cpu), py, "-m", "tensora.gateway"], fdir / "gateway.log",
                             f"http://127.0.0.1:{port}/healthz",
                             env={"TENSORA_GATEWAY_SETTINGS": gateway_settings(fdir, sink, port,
                                                                               consecutive=consecutive)}):
                    r1 = wrk(f"http://127.0.0.1:{port}", "/v1/chat/completions", key, 1, a.duration, a.load_cpu)
                    if r1["errors"]:
                        raise RuntimeError(f"{label}: {r1['errors']} errors")
                    results[label] = {"c1": r1}
                    print(f"  {label:<22} c=1 {r1['rps']:>8.0f} req/s p50 {r1['p50_ms']:.3f} "
                          f"p99 {r1['p99_ms']:.3f} ms", flush=True)
    report(results)
    if a.json:
        a.json.write_text(json.dumps({"results": results, "args": {k: str(v) for k, v in vars(a).items()}},
                                     indent=2))
    return 0


def metrics_on_off(a: argparse.Namespace, tmp: Path, key: str, sink: str, results: dict[str, Any]) -> None:
    """tensora with metrics off, then on, ``--rounds`` times over: the machine's load drifts alike for both."""
    py = sys.executable
    runs: dict[bool, list[dict[str, Any]]] = {False: [], True: []}
    for i in range(a.rounds):
        for on in (False, True):
            name = f"tensora metrics {'on' if on else 'off'} {i + 1}"
            port = free_port()
            with process([*taskset(a.proxy_cpu), py, "-m", "tensora.gateway"], tmp / "gateway.log",
                         f"http://127.0.0.1:{port}/healthz",
                         env={"TENSORA_GATEWAY_SETTINGS": gateway_settings(tmp, sink, port, metrics=on)}):
                measure(name, f"http://127.0.0.1:{port}", key, a, results)
                measure_streams(name, f"http://127.0.0.1:{port}", key, a, results)
            runs[on].append(results.pop(name))
    summary = {}
    for on in (False, True):
        summary["on" if on else "off"] = {
            "c1_p50_ms": median(r["c1"]["p50_ms"] for r in runs[on]),
            "c32_rps": median(r["c32"]["rps"] for r in runs[on]),
            "stream_first_p50_ms": median(r["stream20"]["first_p50_ms"] for r in runs[on])}
    off, on_ = summary["off"], summary["on"]
    summary["c1_p50_added_ms"] = on_["c1_p50_ms"] - off["c1_p50_ms"]
    summary["c1_p50_change"] = on_["c1_p50_ms"] / off["c1_p50_ms"] - 1
    summary["c32_rps_change"] = on_["c32_rps"] / off["c32_rps"] - 1
    summary["rounds"] = {"off": runs[False], "on": runs[True]}
    results["metrics on/off"] = summary
    print(f"  metrics on vs off (median of {a.rounds}): c=1 p50 {off['c1_p50_ms']:.3f} -> {on_['c1_p50_ms']:.3f} ms "
          f"({summary['c1_p50_change']:+.1%}), c=32 {off['c32_rps']:.0f} -> {on_['c32_rps']:.0f} req/s "
          f"({summary['c32_rps_change']:+.1%})", flush=True)


def peers(a: argparse.Namespace, tmp: Path, key: str, backs: list[str],
          stack: contextlib.ExitStack) -> dict[str, tuple[str, str]]:
    """Start the peers that can be installed, in ``stack``; their root URLs and keys by name."""
    out: dict[str, tuple[str, str]] = {}
    litellm = venv(a.peers_dir, "litellm", "litellm[proxy]", "litellm")
    if litellm is not None:
        master = "sk-bench-" + key[-12:]
        cfg = tmp / "litellm.yaml"
        deployments = "".join(
            f"  - model_name: {name}\n    litellm_params:\n      model: openai/m\n      api_base: {b}/v1\n"
            f"      api_key: none\n" for name, b in (("my-llm", backs[0]), ("my-llm", backs[1]),
                                                   ("my-llm-fallback", backs[1])))
        cfg.write_text(f"model_list:\n{deployments}router_settings:\n  fallbacks: [{{\"my-llm\": "
                       f"[\"my-llm-fallback\"]}}]\ngeneral_settings:\n  master_key: {master}\n"
                       "litellm_settings:\n  drop_params: true\n  set_verbose: false\n")
        port = free_port()
        env = {"LITELLM_LOCAL_MODEL_COST_MAP": "True", "LITELLM_LOG": "ERROR", "DISABLE_SCHEMA_UPDATE": "true"}
        stack.enter_context(process([*taskset(a.proxy_cpu), str(litellm), "--config", str(cfg), "--host",
                                     "127.0.0.1", "--port", str(port), "--num_workers", "1"], tmp / "litellm.log",
                                    f"http://127.0.0.1:{port}/health/liveliness", env=env, deadline_s=180))
        out["litellm"] = (f"http://127.0.0.1:{port}", master)
    router = venv(a.peers_dir, "router", "vllm-router", "vllm-router")
    if router is not None:
        port = free_port()
        stack.enter_context(process([*taskset(a.proxy_cpu), str(router), "--worker-urls", backs[0], backs[1],
                                     "--policy", "round_robin", "--host", "127.0.0.1", "--port", str(port)],
                                    tmp / "router.log", f"http://127.0.0.1:{port}/health", deadline_s=60))
        out["vllm-router"] = (f"http://127.0.0.1:{port}", key)
    return out


def report(results: dict[str, Any]) -> None:
    d = results["direct"]
    print("\nadded over direct (p50, c=1): ", end="")
    rows = []
    for name, r in results.items():
        if name == "direct" or "c1" not in r:
            continue
        added = {"p50_ms": r["c1"]["p50_ms"] - d["c1"]["p50_ms"], "p99_ms": r["c1"]["p99_ms"] - d["c1"]["p99_ms"]}
        if "stream20" in r:
            added["stream_total_ms"] = r["stream20"]["total_p50_ms"] - d["stream20"]["total_p50_ms"]
            added["stream_first_ms"] = r["stream20"]["first_p50_ms"] - d["stream20"]["first_p50_ms"]
        r["added_over_direct"] = added
        rows.append(f"{name} +{added['p50_ms']:.3f} ms")
    print(", ".join(rows))
    for name in ("tensora", "tensora busy-poll", "tensora baseline"):
        t = results.get(name)
        for peer in ("litellm", "vllm-router"):
            if t is not None and peer in results:  # round by round: the same minutes of a shared machine
                pairs = list(zip(t["rounds"], results[peer]["rounds"], strict=True))
                rps = [x["c32"]["rps"] / y["c32"]["rps"] for x, y in pairs]
                p99 = [x["c32"]["p99_ms"] / y["c32"]["p99_ms"] for x, y in pairs]
                t[f"c32_vs_{peer}"], t[f"c32_p99_vs_{peer}"] = median(rps), median(p99)
                print(f"{name} / {peer} at c=32, by round: req/s {' '.join(f'{v:.2f}x' for v in rps)}; "
                      f"p99 {' '.join(f'{v:.2f}x' for v in p99)}")


if __name__ == "__main__":
    sys.exit(main())
