"""The control API's metrics: requests by route template and status, their latency, Idempotency-Key replays and
refusals, 503s by cause.

prometheus-client's own metrics (the API is not a hot path measured in microseconds). Under ``tensora serve``'s
HTTP workers (separate processes) they are in its multiprocess mode (``PROMETHEUS_MULTIPROC_DIR``, set by the
supervisor before it starts them), and the supervisor's ``metrics_listen`` sums every worker's; in one process
they are served from ``REGISTRY``. Labels: the route's template (``/v1/workloads/{name}``, never the path: no
names or ids), the method, the status; an unmatched path is ``unmatched``.
"""

from __future__ import annotations

import time
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram

REGISTRY = CollectorRegistry(auto_describe=False)
BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)

REQUESTS = Counter("tensora_api_requests", "Control API requests, by route template, method and status",
                   ["route", "method", "status"], registry=REGISTRY)
DURATION = Histogram("tensora_api_request_duration_seconds", "Control API requests' time to their last byte, by "
                     "route template and method", ["route", "method"], buckets=BUCKETS, registry=REGISTRY)
IDEMPOTENCY = Counter("tensora_api_idempotency", "POSTs with an Idempotency-Key answered from its record or refused: "
                      "replayed, conflict (409: the first is still running), mismatch (422: another body)",
                      ["outcome"], registry=REGISTRY)
UNAVAILABLE = Counter("tensora_api_unavailable", "503s by cause: draining, overloaded (max_in_flight), database, "
                      "storage (no files configured), disk_full", ["cause"], registry=REGISTRY)
for _o in ("replayed", "conflict", "mismatch"):
    IDEMPOTENCY.labels(_o)
for _c in ("draining", "overloaded", "database", "storage", "disk_full"):
    UNAVAILABLE.labels(_c)


_METHODS = frozenset(("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"))


def idempotency(outcome: str) -> None:
    IDEMPOTENCY.labels(outcome).inc()


def unavailable(cause: str) -> None:
    UNAVAILABLE.labels(cause).inc()


class Measure:
    """Pure ASGI middleware, outermost: each HTTP request counted under its route's template once it is answered."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = [500]

        async def sent(message: Any) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, sent)
        finally:
            route = scope.get("route")
            template = getattr(route, "path", None) or "unmatched"
            method = scope.get("method", "")
            if method not in _METHODS:
                method = "other"
            REQUESTS.labels(template, method, str(status[0])).inc()
            DURATION.labels(template, method).observe(time.perf_counter() - start)
