"""Traces (OpenTelemetry, optional: the ``tracing`` extra): a span per gateway request with a child per attempt,
W3C ``traceparent`` sent to backends and peers, and a span per controller cycle with its steps as events.

Off by default (``tracing: {otlp_endpoint: ...}`` turns it on), and then nothing of it runs: the gateway and the
controller hold ``None`` and test for it, and opentelemetry is imported only by ``setup`` (a process without the
extra runs untraced). Spans go over OTLP/HTTP in batches, from the SDK's own thread.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class TracingSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    otlp_endpoint: str | None = Field(default=None, description="OTLP/HTTP traces URL, e.g. "
                                      "http://127.0.0.1:4318/v1/traces; null: no tracing")
    service_name: str | None = Field(default=None, description="the spans' service.name (tensora-gateway or "
                                     "tensora-control unless set)")


class Tracing:
    """The spans of one process."""

    def __init__(self, provider: Any) -> None:
        from opentelemetry import trace
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.provider, self.trace = provider, trace
        self.tracer = provider.get_tracer("tensora")
        self.w3c = TraceContextTextMapPropagator()  # W3C, whatever the process's global propagator is

    @contextmanager
    def request(self, name: str, headers: list[tuple[bytes, bytes]], attributes: dict[str, Any]) -> Iterator[Any]:
        """A server span, the child of the caller's ``traceparent`` when it sent one (a peer gateway does)."""
        carrier = {k.decode("latin-1"): v.decode("latin-1") for k, v in headers if k in (b"traceparent",
                                                                                          b"tracestate")}
        with self.tracer.start_as_current_span(name, context=self.w3c.extract(carrier) if carrier else None,
                                               kind=self.trace.SpanKind.SERVER, attributes=attributes) as span:
            yield span

    @contextmanager
    def span(self, name: str, attributes: dict[str, Any], client: bool = False) -> Iterator[Any]:
        kind = self.trace.SpanKind.CLIENT if client else self.trace.SpanKind.INTERNAL
        with self.tracer.start_as_current_span(name, kind=kind, attributes=attributes) as span:
            yield span

    def headers(self) -> list[tuple[str, str]]:
        """``traceparent`` (and ``tracestate``) of the current span, for a request it sends."""
        carrier: dict[str, str] = {}
        self.w3c.inject(carrier)
        return list(carrier.items())

    def event(self, name: str) -> None:
        self.trace.get_current_span().add_event(name)

    def close(self) -> None:
        self.provider.shutdown()  # what is batched is sent first


def setup(settings: TracingSettings | None, service: str) -> Tracing | None:
    """Tracing as ``settings`` say; None when off. Without the extra installed: an ImportError naming it."""
    if settings is None or not settings.otlp_endpoint:
        return None
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError as exc:
        raise ImportError("tracing.otlp_endpoint is set but OpenTelemetry is not installed: "
                          "pip install 'tensora[tracing]'") from exc
    provider = TracerProvider(resource=Resource.create({"service.name": settings.service_name or service}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=settings.otlp_endpoint)))
    return Tracing(provider)
