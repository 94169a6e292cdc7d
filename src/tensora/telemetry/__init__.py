"""Telemetry: what Tensora's servers tell their operator. ``scrape`` (``/metrics`` on a listener of its own) and
``tracing`` (OpenTelemetry spans). Each server keeps its own metrics beside its code (``api.metrics``,
``control.metrics``, ``gateway.metrics``, ``drivers.localmetrics``); both the control API's process and the
gateway's use these, and neither may import the other."""
