"""Child processes of ``tensora serve`` and ``tensora up`` that end with it: the HTTP workers and the gateway.

On Linux each child asks the kernel (``prctl(PR_SET_PDEATHSIG)``) for SIGTERM when its parent dies, so that the
workers and the gateway of a crashed (SIGKILLed) server do not keep its ports. The workloads' replicas are not
among them: they keep running without the server, and the next ``tensora up`` adopts them.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tensora.gateway.app import GatewaySettings

PR_SET_PDEATHSIG = 1
GATEWAY_STOP_S = 10.0
"""How long the gateway has to drain after SIGTERM before it is killed."""


def die_with_parent(parent: int | None = None) -> None:
    """Have this process sent SIGTERM when its parent dies, so that the HTTP workers and the gateway
    of a crashed (SIGKILLed) server do not keep its ports; exit now if ``parent`` is already gone."""
    ask = parent_death_signal()
    if ask is not None:
        ask()
    if parent is not None and os.getppid() != parent:
        os._exit(0)


def parent_death_signal() -> Callable[[], None] | None:
    """Linux: a call (safe between fork and exec: it imports nothing) that asks for SIGTERM on the
    parent's death. Elsewhere None: a crash there leaves the children to be stopped by hand."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    term = int(signal.SIGTERM)
    return lambda: prctl(PR_SET_PDEATHSIG, term, 0, 0, 0)


def start_gateway(gw: GatewaySettings) -> subprocess.Popen[bytes]:
    """tensora up: the gateway in a process of its own (its own core, its own event loop), reading
    routes from this server. It stops with ``tensora up``, even a crashed one; the workloads do not."""
    from tensora.gateway.app import GATEWAY_SETTINGS_ENV

    env = dict(os.environ, **{GATEWAY_SETTINGS_ENV: gw.model_dump_json()})
    return subprocess.Popen([sys.executable, "-m", "tensora.gateway"], env=env,
                            preexec_fn=parent_death_signal())


def stop_gateway(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM, and SIGKILL if it has not ended :data:`GATEWAY_STOP_S` later."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(GATEWAY_STOP_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
