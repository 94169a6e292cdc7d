"""One ``tensora up`` per data dir: an flock on ``DATA_DIR/up.pid`` (which says its pid and addresses), held for
as long as it runs, so that a crashed one never blocks the next. A second one, or one whose port is taken, stops
before it prints or writes anything (:class:`~tensora.serving.ports.Occupied`)."""

from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from tensora import listeners
from tensora.config.settings import UP_LOCK_FILE
from tensora.serving.ports import Occupied, already_running, check_metrics, check_port, client_host, distinct_ports
from tensora.store.db import private_dir
from tensora.telemetry.scrape import parse_listen

if TYPE_CHECKING:
    from tensora.config.settings import ServeSettings

HOLDER_WAIT_S = 1.0
"""How long a reader waits for the lock's holder to write who it is (it does just after taking the lock)."""
_HOLDER_POLL_S = 0.05


def claim_up(settings: ServeSettings, gateway_port: int, gateway_sandbox_port: int | None = None,
             gateway_metrics_listen: str | None = None) -> IO[str]:
    """Check that nothing holds this data dir or the ports, then hold the data dir's lock for as long
    as the returned file stays open (the process's life; the OS drops it however that ends).

    Occupied when another ``tensora up`` holds the lock, or a port is in use (by a Tensora, or
    by another program, naming the flag or setting that chooses another), the metrics listeners' included:
    metrics this ``up`` says it serves, and its operator page reads, are its own; nothing is written until then."""
    import fcntl

    path = settings.data_dir / UP_LOCK_FILE
    # 1. another tensora up on this data dir
    holder = lock_holder(path)
    if holder is not None:
        raise Occupied(already_running(holder.get("api"), holder.get("pid")))
    # 2. the ports: free, or held by a Tensora (another data dir), or by another program
    for port, flag in ((settings.port, "--port"), (gateway_port, "--gateway-port")):
        check_port(settings.host, port, flag)
    sandboxes = ((settings.sandbox_listener(), "sandbox_port"), (gateway_sandbox_port, "gateway.sandbox_port"))
    metrics = ((settings.metrics_listen, "metrics_listen"), (gateway_metrics_listen, "gateway.metrics_listen"))
    distinct_ports([(settings.port, "--port"), (gateway_port, "--gateway-port"), *sandboxes,
                    *((parse_listen(listen)[1] if listen else None, name) for listen, name in metrics)])
    for sandbox_port, setting in sandboxes:
        if sandbox_port is not None:
            check_port(listeners.SANDBOX_HOST, sandbox_port, setting)
    for listen, setting in metrics:
        check_metrics(listen, setting)
    # 3. take the lock and say who holds it
    private_dir(settings.data_dir)
    f = path.open("a+")  # not inherited by children (close-on-exec): replicas never hold it
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.close()
        holder = lock_holder(path) or {}
        raise Occupied(already_running(holder.get("api"), holder.get("pid"))) from None
    f.truncate(0)
    f.write(json.dumps({"pid": os.getpid(), "api": f"{client_host(settings.host)}:{settings.port}",
                        "gateway": f"{client_host(settings.host)}:{gateway_port}"}) + "\n")
    f.flush()
    return f


def lock_holder(path: Path) -> dict[str, Any] | None:
    """What ``up.pid`` says when a live process holds its lock, else None (absent, or left by a
    process that is gone)."""
    import fcntl

    try:
        f = path.open("r")
    except FileNotFoundError:
        return None
    with f:
        try:
            fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError:
            pass
        else:
            return None  # nobody holds it: a stale file
        for _ in range(round(HOLDER_WAIT_S / _HOLDER_POLL_S)):  # its holder writes it just after taking the lock
            f.seek(0)
            with contextlib.suppress(ValueError):
                data = json.loads(f.read())
                if isinstance(data, dict):
                    return data
            time.sleep(_HOLDER_POLL_S)
        return {}
