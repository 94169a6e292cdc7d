"""``/metrics`` on a listener of its own (``metrics_listen``), apart from the API and the gateway's port.

Not public by default: 127.0.0.1 and a port of its own, so what the metrics say (endpoint names, owners, backends)
is only for whoever can reach that address: Prometheus beside the process, or a Service port in a cluster
(``deploy/``), never the internet-facing one. A separate listener rather than an admin key on the API's port:
Prometheus scrapes without secrets, a scrape never competes with the API's request limits, and the gateway's
hot path is not where it is served. prometheus-client's own server runs it in a thread.
"""

from __future__ import annotations

import logging
import re
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from prometheus_client.registry import Collector

log = logging.getLogger("tensora")

LISTEN = re.compile(r"^(?P<host>\[[0-9a-fA-F:.]+\]|[^:\[\]]*):(?P<port>[0-9]{1,5})$")


def parse_listen(value: str) -> tuple[str, int]:
    """``host:port`` (an IPv6 host in brackets) -> (host, port); ValueError when it is not that."""
    m = LISTEN.match(value)
    if m is None or int(m["port"]) > 65535:
        raise ValueError(f"metrics_listen {value!r}: expected host:port, e.g. 127.0.0.1:8710")
    return m["host"].strip("[]") or "0.0.0.0", int(m["port"])


def check_listen(value: str | None) -> str | None:
    """A pydantic validator's body: None or "" turns the metrics off."""
    if not value:
        return None
    parse_listen(value)
    return value


class Listener:
    """The metrics of one process, served at ``http://<metrics_listen>/metrics``."""

    def __init__(self, listen: str, *collectors: Collector, process: bool = True, remove: str | None = None) -> None:
        from prometheus_client import CollectorRegistry, GCCollector, ProcessCollector

        self.host, self.port = parse_listen(listen)
        self.registry = CollectorRegistry(auto_describe=False)
        for c in collectors:
            self.registry.register(c)
        if process:  # CPU, memory, open files of this process
            ProcessCollector(registry=self.registry)
            GCCollector(registry=self.registry)
        self._server: Any = None
        self.remove = remove  # a dir of the counts behind it, removed with it

    def start(self) -> bool:
        """Listen; a taken port is warned about, not fatal: the process serves without metrics."""
        from prometheus_client import start_http_server

        try:
            self._server, _ = start_http_server(self.port, self.host, registry=self.registry)
        except OSError as exc:
            log.warning("metrics not served on %s:%d (%s)", self.host, self.port, exc.strerror or exc)
            return False
        self.port = self._server.server_port
        return True

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self.remove is not None:
            import shutil

            shutil.rmtree(self.remove, ignore_errors=True)
