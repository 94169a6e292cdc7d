"""A sandbox's network: its own namespace, served by ``pasta`` (Debian's ``passt``).

Why pasta, not slirp4netns: pasta's ``-T`` forwards chosen ports of the namespace's loopback to the host's
loopback, which is exactly "the sandbox reaches Tensora's API and gateway and no other host loopback service";
slirp4netns can only open all of the host's loopback or none. And pasta gives the namespace the host's own
address, so connecting to it from inside stays inside instead of reaching the host's wildcard listeners.

How (no race with the workload): the namespace is created first as a file (``unshare --net=FILE``, kept in
the bundle), pasta is attached to it and has configured the interface, default route and DNS by the time it
returns; only then does runc start the container *in* that namespace (``oci_config(..., netns=FILE)``).
The workload therefore never sees a network that is not up yet.

What the sandbox reaches:
- out: the internet through pasta (TCP and UDP; no ICMP: an unprivileged process in a new namespace cannot
  open ping sockets anyway, and pasta's ICMP buffers cost 2 MiB), via the host's default route; DNS is the host's
  ``/etc/resolv.conf`` (bound read-only) reached through that route;
- the host's loopback: only ``allow_host_ports``, each ``(port, host_port)`` pair making ``127.0.0.1:<port>``
  inside reach the host's ``127.0.0.1:<host_port>`` (the same URL as on the host, served by a listener kept for
  sandboxes: ``tensora.listeners``); ``--no-map-gw`` stops pasta's default mapping of the gateway address to the
  host;
- in: each ``publish`` pair makes the host's ``<publish_address>:<host_port>`` reach ``127.0.0.1:<port>``
  inside; servers bind :data:`SERVER_HOST`. The local driver gives each replica a loopback address of its own
  (``drivers.loopback``), never 127.0.0.1, where Tensora's own servers are: a browser sends a host's cookies
  to every port of it.
What it still reaches, as any internet client would: the host's *other* addresses (a docker bridge, a second
NIC) and link-local metadata services, since pasta connects out from the host; an egress firewall
(nftables) is the next layer for hosts that serve private things on those addresses.

Privileges: Debian 12's pasta (2023-03) drops to "nobody" with no capabilities *before* joining a
namespace, which then fails; ``--runas 0`` keeps it root, and it then keeps only CAP_SYS_ADMIN and
CAP_NET_BIND_SERVICE, with no-new-privileges, its own seccomp filter and its own mount, pid, ipc and uts
namespaces. IPv4 only by default: pasta's IPv6 buffers cost about 10 MiB more per sandbox (measured: about
17 MiB of memory per sandbox with IPv4 only, 27 MiB with IPv6).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path

from tensora.errors import TensoraError

SERVER_HOST = "127.0.0.1"
"""The address a server in a sandbox listens on (``--host``/``--ip``): pasta splices a published host port to
the namespace's loopback, so a server bound only to the namespace's interface address is not reached."""

NETNS_FILE = "netns"
PID_FILE = "pasta.pid"
LOG_FILE = "net.log"


class NetworkError(TensoraError):
    """The namespace or its helper could not be set up; the message says which and why."""


@dataclass(frozen=True, slots=True)
class NetworkPlan:
    """The files a sandbox's network lives in (all in its bundle dir) and what pasta forwards."""

    bundle: Path
    publish: tuple[tuple[int, int], ...] = ()
    allow_host_ports: tuple[tuple[int, int], ...] = ()  # (port inside, host port)
    ipv6: bool = False
    publish_address: str = "127.0.0.1"

    @property
    def netns(self) -> Path:
        return self.bundle / NETNS_FILE

    @property
    def pid_file(self) -> Path:
        return self.bundle / PID_FILE


def pasta_argv(plan: NetworkPlan, pasta: str = "pasta") -> list[str]:
    """pasta's command line for ``plan``: every forward named, none left to ``auto`` (which would forward
    every port bound on either side)."""
    argv = [pasta, "--runas", "0", "--config-net", "--no-map-gw", "--no-icmp", "-q",
            "-l", str(plan.bundle / LOG_FILE), "-P", str(plan.pid_file)]
    if not plan.ipv6:
        argv.append("-4")
    for host_port, port in plan.publish:
        argv += ["-t", f"{plan.publish_address}/{host_port}:{port}"]
    if not plan.publish:
        argv += ["-t", "none"]
    # -T's spec: a namespace port, then ":" and the host port it reaches when they differ
    forwards = [str(port) if port == host_port else f"{port}:{host_port}" for port, host_port in plan.allow_host_ports]
    argv += ["-u", "none", "-U", "none", "-T", ",".join(forwards) or "none"]
    return [*argv, "--netns", str(plan.netns)]


def start(plan: NetworkPlan, pasta: str = "pasta") -> int:
    """Create the namespace file and attach pasta to it; returns pasta's pid. The namespace is configured
    (address, default route) when this returns."""
    plan.netns.touch(mode=0o600, exist_ok=False)
    _run(["unshare", f"--net={plan.netns}", "true"], "create the network namespace")
    _run(pasta_argv(plan, pasta), "start pasta")
    pid = helper_pid(plan.bundle)
    if pid is None:
        raise NetworkError(f"pasta exited at start: see {plan.bundle / LOG_FILE}")
    return pid


def helper_pid(bundle: Path) -> int | None:
    """The pid of the pasta serving ``bundle``'s namespace, if it still runs (checked against its command
    line, so a recycled pid is never taken for it)."""
    try:
        pid = int((bundle / PID_FILE).read_text().strip())
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, ValueError, IndexError):
        return None
    if state in ("Z", "X") or os.fsencode(bundle / NETNS_FILE) not in cmdline:
        return None
    return pid


def stop(bundle: Path) -> None:
    """Stop pasta and remove the namespace file; idempotent."""
    pid = helper_pid(bundle)
    if pid is not None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    netns = bundle / NETNS_FILE
    if netns.exists():
        # lazy: the network helper (or a half-started runc) may still hold it open; the namespace dies with its
        # last user
        subprocess.run(["umount", "-l", str(netns)], capture_output=True, check=False)
        with contextlib.suppress(FileNotFoundError):
            netns.unlink()


def _run(argv: list[str], what: str) -> None:
    try:
        done = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise NetworkError(f"could not {what}: {e}") from e
    if done.returncode != 0:
        detail = (done.stderr or done.stdout).decode(errors="replace")
        lines = [x for x in detail.splitlines() if "syslog" not in x]  # pasta's noise when no syslog runs
        raise NetworkError(f"could not {what}: {' '.join(lines[-3:]) or f'exit {done.returncode}'}")
