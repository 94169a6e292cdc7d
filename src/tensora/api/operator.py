"""``GET /v1/operator``: the figures of the dashboard's operator page, from the metrics this server already serves.

Read by scraping the metrics listeners over loopback (``metrics_listen``: the controller's counts live in the
supervisor, not in the HTTP worker answering; the gateway's in its own process), parsed with prometheus-client's
parser, each with a short timeout: a listener that does not answer is said to be unavailable, never waited for.
"The last hour" is the difference from a sample the app keeps (its ``Sampler``, made and stopped with it): one a
minute, from a thread started by the first read (a server nobody asks does not scrape itself), 61 kept; until they
cover an hour, the figures are totals since the processes started, and the answer says which (``window_s``: null).
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from typing import Annotated, Any

import httpx
from fastapi import APIRouter, Depends, Request
from prometheus_client.parser import text_string_to_metric_families

from tensora.api.deps import ERRORS, Admin, Svc

router = APIRouter(tags=["operator"])
TIMEOUT_S = 1.0
HOUR_S, EVERY_S = 3600.0, 60.0
KEPT = 61  # samples: an hour of them, and the one an hour before the latest
COUNTERS = ("fallbacks", "failovers", "placed", "ttft")  # differenced over the window; the rest are as they are now


def scrape(listen: str | None) -> list[Any] | None:
    """The families at ``http://<listen>/metrics``; None when off or it does not answer."""
    if not listen:
        return None
    host, _, port = listen.rpartition(":")
    host = {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "[::]": "[::1]"}.get(host, host)
    try:
        r = httpx.get(f"http://{host}:{port}/metrics", timeout=TIMEOUT_S)
        r.raise_for_status()
        return list(text_string_to_metric_families(r.text))
    except (httpx.HTTPError, ValueError):
        return None


def snapshot(control: list[Any] | None, gateway: list[Any] | None) -> dict[str, Any]:
    """The figures as they are now: counters and histogram buckets cumulative, summed over regions."""
    s: dict[str, Any] = {"control": control is not None, "gateway": gateway is not None, "fallbacks": {},
                         "failovers": {}, "placed": {}, "ttft": {}, "queue": {}, "breakers": {}, "ejected": [],
                         "spool": None}

    def add(d: dict[str, float], k: str, v: float) -> None:
        d[k] = d.get(k, 0.0) + v

    for f in [*(control or ()), *(gateway or ())]:
        for x in f.samples:
            n, lb, v = x.name, x.labels, x.value
            if n == "tensora_controller_fallback_placements_total":
                add(s["fallbacks"], f"{lb['requested']} -> {lb['placed']}", v)
            elif n == "tensora_controller_time_to_placement_seconds_bucket":
                add(s["placed"], lb["le"], v)
            elif n == "tensora_controller_queue_depth":
                add(s["queue"], lb["class"], v)
            elif n == "tensora_gateway_failovers_total":
                add(s["failovers"], lb["trigger"], v)
            elif n == "tensora_gateway_ttft_seconds_bucket":
                add(s["ttft"], lb["le"], v)
            elif n == "tensora_gateway_breakers":
                add(s["breakers"], lb["state"], v)
            elif n == "tensora_gateway_backend_ejected" and v:
                s["ejected"].append(f"{lb['backend']} ({lb['state']})")
            elif n == "tensora_gateway_spool_batches":
                s["spool"] = {**(s["spool"] or {}), "batches": int(v)}
            elif n == "tensora_gateway_spool_bytes":
                s["spool"] = {**(s["spool"] or {}), "bytes": int(v)}
    return s


def since(now: dict[str, float], base: dict[str, float]) -> dict[str, float]:
    """Counters' increase from ``base``; a counter that went down was restarted: all of it is new."""
    return {k: (v - base.get(k, 0.0) if v >= base.get(k, 0.0) else v) for k, v in now.items()}


def quantile(q: float, buckets: dict[str, float]) -> float | None:
    """Prometheus' ``histogram_quantile`` over cumulative buckets (``le`` -> count): linear within a bucket, the
    highest finite bound when it falls in +Inf; None without observations."""
    bs = sorted((float(le), n) for le, n in buckets.items())
    if not bs or bs[-1][1] <= 0:
        return None
    rank = q * bs[-1][1]
    lo, below = 0.0, 0.0
    for le, n in bs:
        if n >= rank:
            if math.isinf(le):
                return lo
            return lo + (le - lo) * ((rank - below) / (n - below) if n > below else 1.0)
        lo, below = le, n
    return lo


def record(now_t: float, snap: dict[str, Any], ring: deque[tuple[float, dict[str, Any]]]) -> None:
    """Keep ``snap`` when the last kept is a minute old (or there is none)."""
    if not ring or now_t - ring[-1][0] >= EVERY_S - 1:
        ring.append((now_t, snap))


def figures(now_t: float, snap: dict[str, Any], ring: deque[tuple[float, dict[str, Any]]]) -> dict[str, Any]:
    """The page's figures: counters since the oldest sample of the last hour once the samples cover an hour,
    else since the processes started."""
    record(now_t, snap, ring)
    covered = now_t - ring[0][0] >= HOUR_S - EVERY_S
    base = next(((t, s) for t, s in ring if 0 < now_t - t <= HOUR_S), None) if covered else None
    out = dict(snap)
    for k in COUNTERS:
        out[k] = since(snap[k], base[1][k]) if base else snap[k]
    out["fallbacks"] = {k: int(v) for k, v in out["fallbacks"].items() if v}
    out["failovers"] = {k: int(v) for k, v in out["failovers"].items() if v}
    out["queue"] = {k: int(v) for k, v in snap["queue"].items()}
    out["breakers"] = {k: int(v) for k, v in snap["breakers"].items()}
    placed = out.pop("placed")
    out["time_to_placement"] = {"p50": quantile(0.5, placed), "p99": quantile(0.99, placed)}
    ttft = out.pop("ttft")
    out["ttft"] = {"p50": quantile(0.5, ttft), "p99": quantile(0.99, ttft)}
    out["window_s"] = round(now_t - base[0]) if base else None
    return out


class Sampler:
    """One sample a minute of this server's listeners, into its ``ring``; started by the first read, stopped with
    the app (``stop``). One per app: two apps in one process (tests) keep samples of their own."""

    def __init__(self, every_s: float = EVERY_S) -> None:
        self.every_s = every_s
        self.lock = threading.Lock()
        self.ring: deque[tuple[float, dict[str, Any]]] = deque(maxlen=KEPT)
        self.sources: dict[str, str] = {}
        self.thread: threading.Thread | None = None
        self.stopping = threading.Event()

    def read(self, sources: dict[str, str]) -> dict[str, Any]:
        with self.lock:
            self.sources = dict(sources)
            if self.thread is None and not self.stopping.is_set():
                self.thread = threading.Thread(target=self._loop, name="operator-sampler", daemon=True)
                self.thread.start()
        snap = self.snap()
        with self.lock:
            return figures(time.monotonic(), snap, self.ring)

    def snap(self) -> dict[str, Any]:
        return snapshot(scrape(self.sources.get("control")), scrape(self.sources.get("gateway")))

    def stop(self) -> None:
        """The sampling thread ends (at once if it waits; after its scrape, bounded by ``TIMEOUT_S``, if not)."""
        self.stopping.set()
        thread = self.thread
        if thread is not None:
            thread.join(timeout=2 * TIMEOUT_S + 1)

    def _loop(self) -> None:
        while not self.stopping.wait(self.every_s):
            snap = self.snap()
            with self.lock:
                record(time.monotonic(), snap, self.ring)


async def sampler(request: Request) -> Sampler:
    """The app's sampler (``api.app.create_app`` makes it)."""
    found: Sampler = request.app.state.operator_sampler
    return found


Sampled = Annotated[Sampler, Depends(sampler)]


@router.get("/v1/operator", responses=ERRORS, summary="What an operator watches (admin keys only)",
            description="Fallback placements (requested -> placed), time to placement p50/p99, queue depth by "
                        "class, gateway failovers by trigger, breaker states, TTFT p50/p99, spool depth: over "
                        "the last hour (``window_s``), or since the processes started (``window_s``: null). "
                        "From this server's metrics listeners; ``control``/``gateway`` false where one did not "
                        "answer.")
def operator(svc: Svc, _: Admin, sampled: Sampled) -> dict[str, Any]:
    return sampled.read(svc.metrics_listen)
