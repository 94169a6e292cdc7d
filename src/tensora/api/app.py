"""The control API application: ``create_app(services)``.

The controller (when this process runs one) starts and stops with the app. On shutdown
uvicorn stops accepting connections and lets requests in flight finish; from then on the
app answers anything that still reaches it with 503 + Retry-After, and stops the
controller. Running workloads are left running (they never depend on the control API).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI

from tensora import __version__, dashboard
from tensora.api import catalog, errors, files, gatewayroutes, health, keys, metrics, operator, owners, usage, workloads
from tensora.api.apidocs import install as install_docs
from tensora.api.limits import Guard
from tensora.api.services import Services
from tensora.dashboard.headers import PageHeaders

DESCRIPTION = """\
Tensora's control API: notebooks, VMs and OpenAI-compatible endpoints on GPU classes, with
fallbacks that are **opt-in, explicit and visible**.

* A workload asks for `gpu_class` and may list `fallback` classes (or `cpu`) to accept after
  `fallback_after`. It records `requested_class` and `placed_class`; a workload on a fallback
  class carries the condition `degraded` (`cpu_fallback` or `class_fallback`).
* **CPU means no GPU.** An endpoint on CPU serves roughly 10-50x slower than a GPU; a notebook or VM
  runs without one. Responses say which (`warning`) when a fallback list holds CPU.
* Every POST takes `Idempotency-Key`: the same key and body replay the first response for 24 hours
  (`Idempotent-Replayed: true`); another body is 422; while the first runs, 409 with `Retry-After`.
* Every 503 carries `Retry-After`. Errors are `{"error": {"type", "message", "field"}}`.
* Auth: `Authorization: Bearer tsk_...`. Usage is accounted by `placed_class`; nothing is priced.
"""


def create_app(services: Services, *, max_in_flight: int = 256, max_body_bytes: int = 1 << 20,
               run_controller: bool = True) -> Any:
    """The ASGI app: FastAPI wrapped in the dashboard's page headers, the metrics and the Guard (request ids,
    body limit, in-flight bound, draining)."""

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if run_controller and services.controller is not None:
            services.controller.start()
        try:
            yield
        finally:
            guard.draining = True
            if run_controller and services.controller is not None:
                services.controller.stop()
            app.state.operator_sampler.stop()

    # /docs and /redoc: apidocs' pages, whose scripts are served here rather than from a CDN
    app = FastAPI(title="Tensora control API", version=__version__, description=DESCRIPTION, lifespan=lifespan,
                  docs_url=None, redoc_url=None)
    install_docs(app)
    app.state.services = services
    app.state.operator_sampler = operator.Sampler()  # the operator page's samples: this app's own
    errors.install(app)
    for resource in (workloads, catalog, usage, keys, owners, health):
        app.include_router(resource.router)
    app.include_router(gatewayroutes.router)
    app.include_router(files.router)
    app.include_router(operator.router)
    dashboard.install(app)
    guard = Guard(metrics.Measure(PageHeaders(app)), max_in_flight=max_in_flight, max_body_bytes=max_body_bytes)
    guard.fastapi = app  # type: ignore[attr-defined]
    return guard
