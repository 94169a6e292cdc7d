"""``/metrics`` on a listener of its own (``metrics_listen``), apart from the API and the gateway's port.

Not public by default: 127.0.0.1 and a port of its own, so what the metrics say (endpoint names, owners, backends)
is only for whoever can reach that address: Prometheus beside the process, or a Service port in a cluster
(``deploy/``), never the internet-facing one. A separate listener rather than an admin key on the API's port:
Prometheus scrapes without secrets, a scrape never competes with the API's request limits, and the gateway's
hot path is not where it is served. prometheus-client's own server runs it in a thread.

Each server's listener is by default on 127.0.0.1 at its own port + :data:`OFFSET` (the API's 8700 -> 8710, the
gateway's 8701 -> 8711; :func:`derived_listen`), so that a second ``tensora up`` on other ports serves, and reads,
metrics of its own rather than meeting the first one's listeners.
"""

from __future__ import annotations

import logging
import re
import socket
from typing import TYPE_CHECKING, Any

from tensora.errors import ConfigError

if TYPE_CHECKING:
    from prometheus_client.registry import Collector

log = logging.getLogger("tensora")

OFFSET = 10
"""A server's metrics listener is by default at its port + this (its sandbox listener is at + 20)."""
METRICS_HOST = "127.0.0.1"
"""Where a derived metrics listener binds, whatever the server's own address: metrics are not public by default."""

LISTEN = re.compile(r"^(?P<host>\[[0-9a-fA-F:.]+\]|[^:\[\]]*):(?P<port>[0-9]{1,5})$")


def parse_listen(value: str) -> tuple[str, int]:
    """``host:port`` (an IPv6 host in brackets) -> (host, port); ValueError when it is not that."""
    m = LISTEN.match(value)
    if m is None or int(m["port"]) > 65535:
        raise ValueError(f"metrics_listen {value!r}: expected host:port, e.g. 127.0.0.1:8710")
    return m["host"].strip("[]") or "0.0.0.0", int(m["port"])


def derived_listen(port: int) -> str | None:
    """The default ``metrics_listen`` of a server on ``port``: ``127.0.0.1:<port + 10>``; None (no metrics) for an
    ephemeral port (0), whose neighbour is nobody's to take, or one too high."""
    return f"{METRICS_HOST}:{port + OFFSET}" if 0 < port <= 65535 - OFFSET else None


def metrics_beside_port(data: Any, default_port: int) -> Any:
    """A server's settings before validation: ``metrics_listen`` at its port + 10 where nothing set it
    (:func:`derived_listen`). A port that is not a number is left to the port's own validation."""
    if not isinstance(data, dict) or "metrics_listen" in data:
        return data
    try:
        port = int(data.get("port", default_port))
    except (TypeError, ValueError):
        return data
    return {**data, "metrics_listen": derived_listen(port)}


def check_listen(value: str | None) -> str | None:
    """A pydantic validator's body: None or "" turns the metrics off."""
    if not value:
        return None
    parse_listen(value)
    return value


def unbindable(host: str, port: int, exc: OSError, setting: str) -> str:
    """What to say when a metrics listener cannot bind: the address, why, and the setting that moves it."""
    return (f"cannot serve metrics on {host}:{port} ({exc.strerror or exc}): set {setting} to a free host:port, "
            "or to null for no metrics")


def bind_error(host: str, port: int) -> OSError | None:
    """Why ``host:port`` cannot be bound now; None when it can (or is ephemeral)."""
    if port == 0:
        return None
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        with socket.socket(infos[0][0], socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as prometheus-client's server does
            s.bind(infos[0][4])
    except OSError as exc:
        return exc
    return None


def check_free(listen: str | None, setting: str) -> None:
    """Before a server starts: ConfigError naming ``setting`` unless ``listen`` (off when None) can be bound now."""
    if not listen:
        return
    host, port = parse_listen(listen)
    exc = bind_error(host, port)
    if exc is not None:
        raise ConfigError(unbindable(host, port, exc, setting), field=setting)


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

    def start(self, setting: str | None = None) -> bool:
        """Listen. Where ``setting`` names the setting that chose the address, an address that cannot be bound
        is a ConfigError naming both (the server does not start: metrics it says it serves, and that its operator
        page reads, must be its own); without, it is logged as an error and the process serves without metrics."""
        from prometheus_client import start_http_server

        try:
            self._server, _ = start_http_server(self.port, self.host, registry=self.registry)
        except OSError as exc:
            if setting is not None:
                raise ConfigError(unbindable(self.host, self.port, exc, setting), field=setting) from None
            log.error("metrics not served on %s:%d (%s)", self.host, self.port, exc.strerror or exc)
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
