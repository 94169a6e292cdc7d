"""Runs sandboxes with an OCI runtime: ``runc`` by default, ``crun`` when configured on a cgroup v2 host.

Why runc: Debian's runc (1.1) drives cgroup v1, hybrid and v2 hosts alike; Debian's crun (1.8) refuses a
hybrid host ("cgroups in hybrid mode not supported"), which is what many machines still are. crun starts
faster and uses less memory, so a v2 host may choose it (``Runc(..., runtime="crun")``): crun's command line
mirrors runc's for everything used here (not exercised in CI, whose hosts are hybrid).

No image: a bundle is an empty read-only root plus the host's system dirs bound read-only (see
:mod:`tensora.sandbox.spec`). No daemon and no shim: ``runc run --detach`` exits once the workload runs, the
workload is the container's pid 1, and the only process a sandbox adds is its network helper
(:mod:`tensora.sandbox.network`). runc's state lives under ``root`` (``runc --root``), so a new :class:`Runc`
on the same root after a restart of Tensora sees, signals and deletes the sandboxes it had started.

Layout of a bundle (``bundles/<id>``, mode 0700, root's): ``config.json`` (0600: it holds the environment,
including the workload's keys; only root can read it, and the same is true of runc's ``state.json`` under
``root``), ``rootfs/`` (empty), ``out.log`` (the workload's stdout and stderr, unless a log path is given),
``runc.log`` (runc's own errors), ``netns`` and ``pasta.pid`` (the network).

Secrets never go on a command line: not runc's (the config is a file) nor pasta's.
Caveat for callers: the workload is pid 1 of its pid namespace, and the kernel does not deliver a signal to
such a process unless it installed a handler, so ``stop`` works gracefully only for workloads that handle
SIGTERM (JupyterLab, uvicorn-based servers and QEMU do); others are killed when the grace time ends. runc
does not record a detached container's exit code; an OOM kill is read from the cgroup (``oom_killed``).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

from tensora.clock import Clock, SystemClock
from tensora.errors import TensoraError
from tensora.sandbox import network
from tensora.sandbox.host import CGROUP_ROOT, detect_host, memory_cgroup_dir
from tensora.sandbox.spec import CgroupVersion, HostFacts, SandboxSpec, oci_config, validate
from tensora.units import format_memory

CONFIG = "config.json"
ROOTFS = "rootfs"
OUT_LOG = "out.log"
RUNC_LOG = "runc.log"
INIT_PID = "init.pid"


class SandboxError(TensoraError):
    """The OCI runtime or the network helper failed; the message carries their own words."""


class SandboxState(StrEnum):
    """The runtime's view of a container (``runc state``)."""

    CREATED = "created"
    RUNNING = "running"
    PAUSED = "paused"
    STOPPED = "stopped"


@dataclass(frozen=True, slots=True)
class SandboxHandle:
    """A started sandbox: its id, the host pid of its workload, its bundle and its network helper's pid."""

    id: str
    pid: int
    bundle: Path
    net_pid: int | None = None


class Runc:
    """Starts, inspects, stops and deletes sandboxes; one per Tensora node."""

    def __init__(self, root: Path, bundles: Path, *, runtime: str = "runc", host: HostFacts | None = None,
                 pasta: str = "pasta", ipv6: bool = False, cgroup_root: Path = CGROUP_ROOT) -> None:
        self.root = root
        self.bundles = bundles
        self.runtime = runtime
        self.host = host or detect_host(cgroup_root)
        self.pasta = pasta
        self.ipv6 = ipv6
        self.cgroup_root = cgroup_root
        if runtime.endswith("crun") and self.host.cgroup is CgroupVersion.V1:
            raise ValueError("crun needs cgroup v2; this host has v1 or hybrid cgroups: use runc")

    def bundle(self, sandbox_id: str) -> Path:
        return self.bundles / sandbox_id

    # -- lifecycle -------------------------------------------------------------------------------------

    def start(self, spec: SandboxSpec, log: Path | None = None) -> SandboxHandle:
        """Start ``spec``'s workload in a new sandbox, its network up before its first instruction.

        Raises SandboxError (after cleaning up what it made) when the runtime or the network helper fails,
        or when a sandbox with this id exists; ValueError when the spec would weaken the sandbox.
        """
        validate(spec)
        bundle = self.bundle(spec.id)
        # 1. the id is free: a leftover bundle whose container is gone is cleaned, a live one refused
        if self.state(spec.id) is not None:
            raise SandboxError(f"sandbox {spec.id} exists")
        if bundle.exists():
            self.delete(spec.id)
        # 2. the bundle: root-only dir, config with the environment 0600, an empty root
        self.bundles.mkdir(mode=0o700, parents=True, exist_ok=True)
        bundle.mkdir(mode=0o700)
        try:
            (bundle / ROOTFS).mkdir(mode=0o755)
            plan = network.NetworkPlan(bundle, spec.publish, spec.allow_host_ports, self.ipv6,
                                        spec.publish_address)
            config = oci_config(spec, self.host, netns=str(plan.netns))
            _write_private(bundle / CONFIG, json.dumps(config, indent=1).encode())
            # 3. the network namespace, served and configured before anything runs in it
            net_pid = network.start(plan, self.pasta)
            # 4. the workload, detached: runc exits once it runs
            out = log or bundle / OUT_LOG
            fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
            try:
                self._runc("run", "--detach", "--bundle", str(bundle), "--pid-file", str(bundle / INIT_PID),
                           spec.id, stdout=fd, runc_log=bundle / RUNC_LOG, what=f"start sandbox {spec.id}")
            finally:
                os.close(fd)
            pid = int((bundle / INIT_PID).read_text().strip())
        except BaseException as e:
            with contextlib.suppress(SandboxError, OSError):
                self.delete(spec.id)
            if isinstance(e, network.NetworkError | OSError | ValueError):
                raise SandboxError(f"could not start sandbox {spec.id}: {e}") from e
            raise
        return SandboxHandle(spec.id, pid, bundle, net_pid)

    def state(self, sandbox_id: str) -> SandboxState | None:
        """The runtime's state of the sandbox, None when the runtime knows no such sandbox."""
        info = self._state(sandbox_id)
        return None if info is None else SandboxState(info["status"])

    def handle(self, sandbox_id: str) -> SandboxHandle | None:
        """The handle of a sandbox the runtime knows (to adopt it after a restart), else None."""
        info = self._state(sandbox_id)
        if info is None:
            return None
        bundle = self.bundle(sandbox_id)
        return SandboxHandle(sandbox_id, int(info.get("pid") or 0), bundle, network.helper_pid(bundle))

    def list(self) -> list[str]:
        """The ids of every sandbox under this runtime root, running or stopped."""
        done = self._runc("list", "--format", "json", what="list sandboxes")
        rows = json.loads(done.stdout or b"null") or []
        return sorted(str(r["id"]) for r in rows)

    def kill(self, sandbox_id: str, sig: int = signal.SIGTERM, *, all_processes: bool = False) -> None:
        """Send ``sig`` to the workload (pid 1 of the sandbox), or to every process in it."""
        args = ["kill", *(["--all"] if all_processes else []), sandbox_id, str(int(sig))]
        self._runc(*args, what=f"signal sandbox {sandbox_id}")

    def stop(self, sandbox_id: str, grace_s: float = 10.0, *, clock: Clock | None = None,
             sleep: Callable[[float], None] = time.sleep) -> bool:
        """SIGTERM, wait up to ``grace_s``, then SIGKILL every process. True when it ended within the grace
        time (or had already ended), False when it had to be killed."""
        clock = clock or SystemClock()
        if self.state(sandbox_id) is not SandboxState.RUNNING:
            return True
        with contextlib.suppress(SandboxError):  # it may end between the check and the signal
            self.kill(sandbox_id, signal.SIGTERM)
        deadline = clock.now() + grace_s
        while clock.now() < deadline:
            if self.state(sandbox_id) is not SandboxState.RUNNING:
                return True
            sleep(0.05)
        with contextlib.suppress(SandboxError):
            self.kill(sandbox_id, signal.SIGKILL, all_processes=True)
        deadline = clock.now() + 10.0
        while self.state(sandbox_id) is SandboxState.RUNNING and clock.now() < deadline:
            sleep(0.05)
        return False

    def delete(self, sandbox_id: str) -> None:
        """Remove the sandbox whatever its state: its processes (killed), cgroup, runtime state, network
        helper and namespace, and its bundle. Idempotent. Read ``oom_killed``/``exit_reason`` before."""
        if self._state(sandbox_id) is not None:
            self._runc("delete", "--force", sandbox_id, what=f"delete sandbox {sandbox_id}")
        bundle = self.bundle(sandbox_id)
        network.stop(bundle)
        if bundle.exists():
            inside = [m for m in _mount_points() if m == bundle or bundle in m.parents]
            if inside:  # never remove through a mount (it would delete what it shows)
                raise SandboxError(f"sandbox {sandbox_id}: {inside[0]} is still mounted; bundle kept")
            shutil.rmtree(bundle)

    # -- what happened -----------------------------------------------------------------------------------

    def oom_kills(self, sandbox_id: str) -> int | None:
        """How many of the sandbox's processes the kernel killed for its memory limit; None once deleted."""
        cgroup = memory_cgroup_dir(sandbox_id, self.host.cgroup, self.cgroup_root)
        name = "memory.events" if self.host.cgroup is CgroupVersion.V2 else "memory.oom_control"
        try:
            fields = dict(line.split() for line in (cgroup / name).read_text().splitlines() if line.strip())
        except (OSError, ValueError):
            return None
        if "oom_kill" in fields:
            return int(fields["oom_kill"])
        # v1 before Linux 4.13 has no counter: hitting the limit is the best evidence left
        try:
            return 1 if int((cgroup / "memory.failcnt").read_text()) > 0 else 0
        except (OSError, ValueError):
            return None

    def oom_killed(self, sandbox_id: str) -> bool:
        """Whether the kernel killed a process of the sandbox for its memory limit."""
        return (self.oom_kills(sandbox_id) or 0) > 0

    def exit_reason(self, sandbox_id: str) -> str | None:
        """The failure reason the cgroup tells, such as ``out of memory: limit 16Gi``; None when it tells
        none. Call before ``delete``."""
        if not self.oom_killed(sandbox_id):
            return None
        try:
            config = json.loads((self.bundle(sandbox_id) / CONFIG).read_text())
            limit = int(config["linux"]["resources"]["memory"]["limit"])
        except (OSError, ValueError, KeyError, TypeError):
            return "out of memory"
        return f"out of memory: limit {format_memory(limit)}"

    # -- the runtime's command line ------------------------------------------------------------------------

    def _state(self, sandbox_id: str) -> dict[str, Any] | None:
        done = self._runc("state", sandbox_id, check=False)
        if done.returncode != 0:
            message = (done.stderr or b"").decode(errors="replace")
            if "does not exist" in message or "not exist" in message:
                return None
            raise SandboxError(f"runc state {sandbox_id}: {message.strip()}")
        info: dict[str, Any] = json.loads(done.stdout)
        return info

    def _runc(self, *args: str, stdout: int | None = None, runc_log: Path | None = None, what: str = "",
              check: bool = True) -> subprocess.CompletedProcess[bytes]:
        argv = [self.runtime, "--root", str(self.root)]
        if runc_log is not None:
            argv += ["--log", str(runc_log), "--log-format", "json"]
        argv += args
        try:
            done = subprocess.run(argv, stdin=subprocess.DEVNULL, check=False, timeout=60,
                                  stdout=stdout if stdout is not None else subprocess.PIPE,
                                  stderr=stdout if stdout is not None else subprocess.PIPE)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise SandboxError(f"could not {what or args[0]}: {e}") from e
        if check and done.returncode != 0:
            raise SandboxError(f"could not {what or args[0]}: {_why(done, runc_log)}")
        return done


def _why(done: subprocess.CompletedProcess[bytes], runc_log: Path | None) -> str:
    """runc's own words for a failure: its log's last error, else its stderr's last line."""
    if runc_log is not None:
        with contextlib.suppress(OSError):
            for line in reversed(runc_log.read_text().splitlines()):
                with contextlib.suppress(ValueError):
                    entry = json.loads(line)
                    if entry.get("level") in ("error", "fatal"):
                        return str(entry.get("msg", "")).strip()
    text = (done.stderr or b"").decode(errors="replace").strip()
    return text.splitlines()[-1] if text else f"exit {done.returncode}"


def _write_private(path: Path, data: bytes) -> None:
    with os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as f:
        f.write(data)


def _mount_points() -> list[Path]:
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return []
    # field 5 is the mount point, with spaces and the like escaped as octal
    return [Path(line.split()[4].encode().decode("unicode_escape")) for line in lines if len(line.split()) > 4]
