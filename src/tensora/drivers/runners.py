"""How the local driver runs a replica's launch: in a sandbox of its own (runc), or as a process of Tensora's user.

Either outlives ``tensora up``: a sandbox is detached by runc, in a session of its own; a process leads a session
of its own and carries its replica's id in its environment (``TENSORA_REPLICA``). So a new driver adopts what a
crash left without a pid in its record: a sandbox's from runc's state, a process's found in ``/proc``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

from tensora.drivers import launch
from tensora.drivers.base import ReplicaSpec
from tensora.drivers.launch import Launch
from tensora.drivers.record import Records, ReplicaRecord
from tensora.placement.catalog import Catalog
from tensora.sandbox import Device, Runc, SandboxError, SandboxState
from tensora.sandbox.network import NETNS_FILE

log = logging.getLogger("tensora.drivers.local")

REPLICA_ENV = "TENSORA_REPLICA"
"""A process replica's id in its environment: how a driver finds a process a crash left unrecorded."""
OUT_LOG = "out.log"
"""A replica's output (stdout and stderr), in its dir."""


class Runner(Protocol):
    """Runs a replica's launch, signals it, and tells once it ended."""

    def run(self, spec: ReplicaSpec, launched: Launch, devices: Sequence[Device], record: ReplicaRecord) -> str | None:
        """Start it, its pid noted in ``record``; why not, else None."""
        ...

    def signal(self, record: ReplicaRecord, sig: int) -> None:
        """Send ``sig`` to the replica (every process of it for SIGKILL); nothing if it ended."""
        ...

    def ended(self, record: ReplicaRecord) -> str | None:
        """None while the replica runs; once it ended, why."""
        ...


class SandboxRunner:
    """Each replica in a runc sandbox of its own, its id the replica's. ``allow_host_ports``: what a sandbox may
    reach on the host's loopback, as (port at its 127.0.0.1, host port) pairs."""

    def __init__(self, runc: Runc, records: Records, catalog: Catalog,
                 allow_host_ports: Sequence[tuple[int, int]]) -> None:
        self.runc = runc
        self.records = records
        self.catalog = catalog
        self.allow_host_ports = tuple(allow_host_ports)
        self.oom_kills = 0
        """Processes of sandboxes killed for their memory limit, seen by this process (metrics)."""

    def run(self, spec: ReplicaSpec, launched: Launch, devices: Sequence[Device], record: ReplicaRecord) -> str | None:
        assert spec.uid is not None and spec.gid is not None
        limits = launch.limits(self.catalog[spec.cls], record.cpuset)
        sandbox = launch.sandbox_spec(launched, spec.id, spec.uid, spec.gid, limits, list(devices),
                                      self.allow_host_ports)
        try:
            handle = self.runc.start(sandbox, log=self.records.dir(spec.id) / OUT_LOG)
        except (SandboxError, ValueError) as exc:
            return str(exc)
        _release_netns_mount(handle.bundle)
        record.pid, record.proc_start = handle.pid, proc_start(handle.pid)
        return None

    def signal(self, record: ReplicaRecord, sig: int) -> None:
        with contextlib.suppress(SandboxError):  # it may have ended meanwhile
            self.runc.kill(record.id, sig, all_processes=sig == signal.SIGKILL)

    def ended(self, record: ReplicaRecord) -> str | None:
        """Once it ended, why: the cgroup's reason (``out of memory: limit 16Gi of cpu-4c-16g``), read before its
        sandbox is deleted."""
        log_file = self.records.dir(record.id) / OUT_LOG
        try:
            state = self.runc.state(record.id)
        except SandboxError as exc:  # the runtime itself failed: look again next time
            log.warning("sandbox %s: %s", record.id, exc)
            return None
        if state in (SandboxState.RUNNING, SandboxState.PAUSED):
            return None
        if state is None:  # the runtime forgot it (a reboot): clean what is left of it
            self.delete(record)
            return f"the process is gone (its sandbox too); see {log_file}"
        reason = self.runc.exit_reason(record.id)  # before the delete, which takes the cgroup with it
        if reason:  # killed for its memory: the kills not yet seen while it ran
            self.oom_kills += max(0, (self.runc.oom_kills(record.id) or 0) - record.oom_kills)
        self.delete(record)
        return f"{reason} of {record.cls}" if reason else f"the process is gone; see {log_file}"

    def note_oom(self, record: ReplicaRecord) -> bool:
        """A process of the running replica killed for its memory limit (a notebook's kernel, which Jupyter
        restarts): said in its detail while it runs on. Whether the record changed."""
        kills = self.runc.oom_kills(record.id) or 0
        if kills <= record.oom_kills:
            return False
        self.oom_kills += kills - record.oom_kills
        reason = self.runc.exit_reason(record.id) or "out of memory"
        record.oom_kills = kills
        record.detail = f"{reason} of {record.cls}: {kills} process(es) killed, the replica runs on"
        return True

    def delete(self, record: ReplicaRecord) -> None:
        """Delete the ended replica's sandbox; ``sandbox_left`` where that failed (tried again later)."""
        try:
            self.runc.delete(record.id)
            record.sandbox_left = False
        except (SandboxError, OSError) as exc:
            log.warning("could not delete sandbox %s (tried again later): %s", record.id, exc)
            record.sandbox_left = True

    def adopt(self, live: Sequence[ReplicaRecord]) -> list[ReplicaRecord]:
        """After a restart: fill in the pid a crash mid-start left out, and delete every sandbox that no live
        record (``live``: the sandboxed ones) claims, as the runtime's state lists them all. The records
        filled in."""
        if shutil.which(self.runc.runtime) is None:
            return []
        claims = {r.id: r for r in live}
        try:
            listed = self.runc.list()
        except SandboxError as exc:
            log.warning("cannot list sandboxes to adopt them: %s", exc)
            return []
        filled = []
        for sandbox_id in listed:
            record = claims.get(sandbox_id)
            if record is None:
                log.warning("deleting sandbox %s: no replica claims it", sandbox_id)
                with contextlib.suppress(SandboxError, OSError):
                    self.runc.delete(sandbox_id)
            elif record.pid is None:  # the start was cut short after runc started it
                handle = self.runc.handle(sandbox_id)
                if handle is not None and handle.pid:
                    record.pid, record.proc_start = handle.pid, proc_start(handle.pid)
                    filled.append(record)
        return filled


class ProcessRunner:
    """Each replica a process of Tensora's user, leading a session of its own (it outlives the server)."""

    def __init__(self, records: Records) -> None:
        self.records = records
        self.children: dict[str, subprocess.Popen[bytes]] = {}
        """The processes this driver started, by replica id: reaped once they end."""

    def run(self, spec: ReplicaSpec, launched: Launch, devices: Sequence[Device], record: ReplicaRecord) -> str | None:
        out = os.open(self.records.dir(record.id) / OUT_LOG, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:  # a session of its own: it outlives the server
            proc = subprocess.Popen(launched.argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env={**launched.env, REPLICA_ENV: record.id}, cwd=launched.cwd,
                                    start_new_session=True)
        except OSError as exc:
            return f"could not start {launched.argv[0]}: {exc}"
        finally:
            os.close(out)
        self.children[record.id] = proc
        record.pid, record.proc_start = proc.pid, proc_start(proc.pid)
        return None

    def signal(self, record: ReplicaRecord, sig: int) -> None:
        if record.pid is None or self.exit_code(record) is not None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(record.pid, sig)  # the replica leads its own session and group

    def ended(self, record: ReplicaRecord) -> str | None:
        code = self.exit_code(record)
        if code is None:
            return None
        log_file = self.records.dir(record.id) / OUT_LOG
        return f"{f'exited with code {code}' if code >= 0 else 'the process is gone'}; see {log_file}"

    def exit_code(self, record: ReplicaRecord) -> int | None:
        """None while the process lives; its exit code (or -1 if unknown) once it is gone."""
        proc = self.children.get(record.id)
        if proc is not None:
            return proc.poll()
        pid = record.pid
        if pid is None:
            return -1
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return -1
        except PermissionError:
            pass
        if record.proc_start is not None and proc_start(pid) not in (None, record.proc_start):
            return -1  # the pid was reused by another process
        if _proc_state(pid) == "Z":
            return -1  # exited; its parent (not this driver) has not reaped it yet
        return None

    def reap(self, replica_id: str) -> None:
        """Reap the ended replica's process if this driver started it (another driver may have stopped it)."""
        child = self.children.get(replica_id)
        if child is not None and child.poll() is not None:
            del self.children[replica_id]

    def forget(self, replica_id: str) -> None:
        self.children.pop(replica_id, None)

    def adopt(self, unrecorded: Sequence[ReplicaRecord]) -> list[ReplicaRecord]:
        """After a restart: the process of a replica whose start was cut short before its pid was recorded
        (``unrecorded``) is found by the id in its environment and adopted. The records filled in."""
        if not unrecorded:
            return []
        claims = {r.id: r for r in unrecorded}
        filled = []
        for pid, replica_id in _replica_processes().items():
            record = claims.get(replica_id)
            if record is not None and record.pid is None:
                log.warning("adopting replica %s: its process %d started, its record was cut short", replica_id, pid)
                record.pid, record.proc_start = pid, proc_start(pid)
                filled.append(record)
        return filled


def _release_netns_mount(bundle: Path) -> None:
    """Detach the bind mount that kept the sandbox's network namespace while runc joined it: the workload and
    pasta hold the namespace themselves from now on. Without it, a data dir whose sandboxes were not deleted
    (a test's leftovers, an operator's ``rm -rf``) cannot be removed at all (EBUSY). Deleting sandboxes
    (``Runc.delete``) is still the way to end them: pasta notices its namespace file gone only sometimes.
    (Belongs in ``tensora.sandbox.network``, next to the mount it releases.)"""
    subprocess.run(["umount", "-l", str(bundle / NETNS_FILE)], capture_output=True, check=False)


def proc_start(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (Linux), to tell a reused pid apart."""
    try:
        line = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(line.rpartition(")")[2].split()[19])


def _proc_state(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return None


def _replica_processes() -> dict[int, str]:
    """Session leaders of this user started as a replica's process (``TENSORA_REPLICA`` in their environment):
    pid to replica id. A leader's children inherit the variable but not the session."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if int((entry / "stat").read_text().rpartition(")")[2].split()[3]) != int(entry.name):
                continue  # not a session leader
            environ = (entry / "environ").read_bytes().split(b"\0")
        except (OSError, ValueError, IndexError):
            continue
        prefix = f"{REPLICA_ENV}=".encode()
        for var in environ:
            if var.startswith(prefix):
                found[int(entry.name)] = var[len(prefix):].decode(errors="replace")
    return found
