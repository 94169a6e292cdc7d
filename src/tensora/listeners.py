"""The sandbox listener: the second port on which Tensora's servers take the local driver's sandboxes.

A sandbox reaches the control API and the gateway through pasta, which splices the namespace's 127.0.0.1:<port>
to the host's loopback, and every such connection comes from 127.0.0.1: the address of the admin's CLI and
dashboard (pasta's ``--outbound`` does not change the source of a spliced connection). Counted by client address
alone, a sandbox holding its share of the connections would hold the host's clients' share too. So the API and
the gateway also listen on a port of their own for sandboxes (``sandbox_port``, by default their port + 20),
pasta forwards the namespace's 127.0.0.1:<port> there (the URL inside stays the same), and each server counts a
client's connections by (client address, the port they came in on): the sandboxes share the sandbox listener's
share among themselves, and none of them can take what the host's clients hold.

At the top of the package: the control API's server, the gateway and their settings use it, and the gateway may not
import the API's code.
"""

from __future__ import annotations

import socket

from tensora.errors import ConfigError

SANDBOX_HOST = "127.0.0.1"
"""Where a sandbox listener binds: pasta connects to the host's loopback, whatever address the main port has."""

OFFSET = 20
"""The default sandbox port is the server's port + this (8700 -> 8720, 8701 -> 8721; 8710/8711 are metrics)."""


def derived(port: int) -> int | None:
    """The default sandbox port of a server on ``port``; None for an ephemeral port (0) or one too high."""
    return port + OFFSET if 0 < port <= 65535 - OFFSET else None


def listen(port: int, setting: str, backlog: int = 2048) -> socket.socket:
    """A listening socket on 127.0.0.1:``port``, inheritable (uvicorn's worker processes serve it); ConfigError
    naming ``setting`` when it cannot be bound, before anything is served."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the main listener: TIME_WAIT is no owner
        s.bind((SANDBOX_HOST, port))
        s.listen(backlog)
    except OSError as exc:
        s.close()
        raise ConfigError(f"cannot listen on {SANDBOX_HOST}:{port} for sandboxes ({exc.strerror}): choose another "
                          "port", field=setting) from None  # said as "<setting>: cannot listen ..."
    s.set_inheritable(True)
    return s
