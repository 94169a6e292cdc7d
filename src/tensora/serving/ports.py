"""Whether ``tensora up`` can listen on a port, and if not, who holds it: a Tensora (which, and its pid) or
another program. Checked before anything is printed or written, so that a second ``tensora up`` stops at once
with a sentence that says what to do."""

from __future__ import annotations

import contextlib
import errno
import os
import socket
from pathlib import Path

from tensora.errors import TensoraError

LISTEN_STATE = "0A"
"""TCP_LISTEN, as ``/proc/net/tcp`` writes a socket's state (hex)."""
PROC_TCP_TABLES = ("/proc/net/tcp", "/proc/net/tcp6")


class Occupied(TensoraError):
    """``tensora up`` cannot start: a Tensora already runs on this data dir or port, or another
    program holds the port. The message says which, and what to do."""


def client_host(bind: str) -> str:
    """Where a client on this machine reaches a server bound to ``bind`` (a wildcard: the loopback)."""
    return "127.0.0.1" if bind in ("0.0.0.0", "::", "") else bind


def already_running(api: str | None, pid: int | None) -> str:
    """The sentence of an :class:`Occupied` that another Tensora causes."""
    return f"Tensora is already running on {api or 'this data dir'}" + (f" (pid {pid})" if pid else "")


def check_port(host: str, port: int, flag: str) -> None:
    """Occupied unless this process could listen on ``host:port``; ``flag`` is what chooses another."""
    if port == 0:
        return
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise Occupied(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    family, _, _, _, address = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the servers do: TIME_WAIT is no owner
        try:
            s.bind(address)
            return
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE:
                raise Occupied(f"cannot listen on {host}:{port} ({exc.strerror}): choose another with {flag}") \
                    from None
    if is_tensora(client_host(host), port):
        raise Occupied(already_running(f"{client_host(host)}:{port}", listener_pid(port)))
    raise Occupied(f"port {port} is in use by another program (not Tensora): choose another with {flag}")


def check_metrics(listen: str | None, setting: str) -> None:
    """Occupied unless this process could serve metrics at ``listen`` (None: off), naming who holds it (another
    Tensora's metrics, or another program) and ``setting``, which chooses another address."""
    from tensora.telemetry.scrape import bind_error, parse_listen, unbindable

    if not listen:
        return
    host, port = parse_listen(listen)
    exc = bind_error(host, port)
    if exc is None:
        return
    if exc.errno != errno.EADDRINUSE:
        raise Occupied(f"{setting}: {unbindable(host, port, exc, setting)}")
    where = client_host(host)
    if serves_tensora_metrics(where, port) or is_tensora(where, port):
        pid = listener_pid(port)
        who = "another Tensora" + (f" (pid {pid})" if pid else "")
    else:
        who = "another program (not Tensora)"
    raise Occupied(f"cannot serve metrics on {host}:{port}: {who} listens there; set {setting} to a free "
                   "host:port, or to null for no metrics")


def distinct_ports(named: list[tuple[int | None, str]]) -> None:
    """Occupied when two of one server's listeners would take the same port (each named by the setting or flag
    that chooses it); None and 0 (ephemeral) take none."""
    seen: dict[int, str] = {}
    for port, name in named:
        if not port:
            continue
        if port in seen:
            raise Occupied(f"{seen[port]} and {name} would both listen on port {port}: choose another with {name}")
        seen[port] = name


def serves_tensora_metrics(host: str, port: int) -> bool:
    """Whether a Tensora's metrics listener answers there (its families are named tensora_*)."""
    import httpx

    try:
        text = httpx.get(f"http://{host}:{port}/metrics", timeout=2).text
    except httpx.HTTPError:
        return False
    return "# TYPE tensora_" in text


def is_tensora(host: str, port: int) -> bool:
    """Whether a Tensora control API or gateway answers there (their /readyz bodies say so)."""
    import httpx

    try:
        body = httpx.get(f"http://{host}:{port}/readyz", timeout=2).json()
    except (httpx.HTTPError, ValueError):
        return False
    return isinstance(body, dict) and ("controller" in body or "routes" in body)


def listening_inodes(table: str, port: int) -> set[str]:
    """The sockets (as ``/proc/<pid>/fd`` links name them: ``socket:[inode]``) listening on TCP ``port``,
    from the text of a ``/proc/net/tcp`` or ``tcp6`` table. Pure."""
    inodes: set[str] = set()
    for line in table.splitlines()[1:]:
        f = line.split()
        if len(f) > 9 and f[3] == LISTEN_STATE and int(f[1].rsplit(":", 1)[1], 16) == port:
            inodes.add(f"socket:[{f[9]}]")
    return inodes


def listener_pid(port: int) -> int | None:
    """Linux: the process listening on TCP ``port`` (the eldest, where workers share its socket)."""
    inodes: set[str] = set()
    for table in PROC_TCP_TABLES:
        with contextlib.suppress(OSError):
            inodes |= listening_inodes(Path(table).read_text(), port)
    pids: set[int] = set()
    for proc in Path("/proc").iterdir() if inodes else ():
        if not proc.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            if any(os.readlink(fd) in inodes for fd in (proc / "fd").iterdir()):
                pids.add(int(proc.name))
    for pid in sorted(pids):  # the one whose parent does not share the socket: the server, not a worker
        with contextlib.suppress(OSError, ValueError, IndexError):
            ppid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
            if ppid not in pids:
                return pid
    return min(pids) if pids else None
