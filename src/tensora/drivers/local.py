"""The local driver: replicas on this machine, each in a sandbox of its own.

Every replica (JupyterLab, a model server, QEMU) runs in an OCI sandbox (``tensora.sandbox``: runc, the
owner's uid, a read-only host, the placed class's cgroup limits, only its devices, its own network
namespace); what it runs and sees is ``drivers.launch``. The sandbox's id is the replica's id.

State: ``DATA_DIR/replicas/<id>/`` (0700) holds ``replica.json`` (0600: what it is, its port, token, pid) and
its log; runc's own state is under ``DATA_DIR/sandboxes/`` (0700). A sandbox outlives ``tensora up`` (runc
detaches it, in a session of its own), so a new driver on the same data dir adopts the replicas still running
(the runtime's state says which), reports the ones that ended, and deletes any sandbox no ``replica.json``
claims (a crash in the middle of a start): no orphan. ``replica.json`` is written, with its port and GPUs, before
the process starts: a crash between the start and the record of its pid leaves a claim without a pid, which the
next driver fills in (a sandbox's from runc's state; a process's by the ``TENSORA_REPLICA`` it was started
with, found in ``/proc``), so that replica is adopted, never started a second time on the same GPU or port.

Every replica that serves HTTP (a notebook's JupyterLab, an endpoint's model server) is served on a loopback
address of its own (``drivers.loopback``: ``127.a.b.c`` drawn from its id, none a live replica has, recorded in
``replica.json`` so an adopted replica keeps it), never on Tensora's 127.0.0.1: browsers send a host's cookies to
every port of it, and the tenant controls its server. Its URL, this driver's probes and the gateway's route use
that address; a host with no other loopback address (macOS) gets ``r-<hex>.localhost`` names on 127.0.0.1.

The kinds (``drivers.launcher``: one launcher each, behind one protocol; the driver composes them with a runner,
``drivers.runners``, and keeps their records, ``drivers.record``):

* notebook (``drivers.notebooks``): JupyterLab, its token in its environment; its files in
  ``DATA_DIR/workdirs/<workload id>/``, kept across the workload's restarts and removed by ``release`` once it is
  deleted, a file system of its own of ``home_size`` (``drivers.homes``; measured, and the notebook stopped past
  it, where none can be mounted). GPU placement shows its GPUs (device nodes and ``CUDA_VISIBLE_DEVICES``) and
  the host's NVIDIA driver (read-only at ``/opt/nvidia``, see ``drivers.launch``); CPU placement none.
* vm (``drivers.vms``): QEMU with QMP on a unix socket in the VM's dir; an optional disk image, which the server
  resolved inside the owner's files (``files_root``) or inside a shared root (``shared_models``), checked by
  ``vmdisk.inspect`` before anything opens it (a refusal fails the replica with its message, which names no host
  path); the guest writes only to an overlay in the replica's dir, removed by ``release``.
* endpoint (``drivers.endpoints``): a model server from the runtime registry (``runtimes``), its model read-only
  at ``/model``; without an installed runtime the replica fails with a reason that says which to install, or,
  with ``auto_install`` (on for ``tensora up``), waits, starting, while the portable runtime installs in the
  background, and starts once it is installed (a failed install fails it, with the installer's last lines).

Each live replica's ``out.log`` and a VM's console are cut back to ``log_size`` on observe (``drivers.logcap``).
What a replica's owner is shown (its ``url``) names no host path: a VM has none.

Stop is graceful first (SIGTERM, or QMP), then SIGKILL of every process after a deadline; ``observe`` does the
escalation, so nothing here blocks the controller. A replica that ends is reported stopped (asked) or failed,
with the cgroup's reason (``out of memory: limit 16Gi of cpu-4c-16g``), read before its sandbox is deleted.

Isolation (``Isolation``): ``sandbox`` as above; ``none`` (the operator's explicit choice) runs replicas as
plain processes of Tensora's user; ``admin-only`` (no sandbox on this host, none chosen) runs only the admin
owner's replicas, as processes, and fails every other owner's with the reason.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import time
from collections.abc import Mapping, Sequence
from dataclasses import fields, replace
from enum import StrEnum
from pathlib import Path
from typing import Any

from tensora.drivers import launch, logcap
from tensora.drivers.base import ReplicaSpec, ReplicaStatus
from tensora.drivers.endpoints import EndpointLauncher, Installing
from tensora.drivers.launch import GPU_CONTROL_DEVICES, Launch, LaunchError
from tensora.drivers.launcher import Launcher, Origins, private_dir
from tensora.drivers.notebooks import HOME_SIZE, NotebookLauncher
from tensora.drivers.record import Records, ReplicaRecord
from tensora.drivers.runners import OUT_LOG, ProcessRunner, Runner, SandboxRunner
from tensora.drivers.vmdisk import ImageRefused
from tensora.drivers.vms import VmLauncher, overlay_path
from tensora.errors import ModelFileError
from tensora.keys import replicakeys
from tensora.models import runtimes
from tensora.placement.capacity import Node
from tensora.placement.catalog import Catalog, ComputeClass
from tensora.placement.kinds import ReplicaState, WorkloadKind
from tensora.sandbox import Device, Runc, host_device
from tensora.sandbox.host import NvidiaDriver
from tensora.sandbox.host import nvidia_driver as find_nvidia_driver

STOP_GRACE_S = 10.0
"""How long a replica asked to stop has before every process of it is killed."""
FORGET_STOPPED_S = 3600.0
"""How long ``observe`` still reports a replica that ended."""
ADMIN_OWNER = "admin"
"""The owner of the admin key ``tensora serve`` creates on first start."""
LOG_SIZE = 16 * 2**20
"""A replica's log, and a VM's serial console, are cut back past this (one rotated file of as much kept)."""


class Isolation(StrEnum):
    """How the local driver runs replicas."""

    SANDBOX = "sandbox"
    """Each in a sandbox of its own (the default)."""
    NONE = "none"
    """As processes of Tensora's user: the operator chose it (``isolation: none``)."""
    ADMIN_ONLY = "admin-only"
    """This host cannot sandbox and the operator chose nothing: only the admin owner's replicas run."""


class LocalDriver:
    """Replicas on this machine, one node (this machine's, from ``hardware``).

    ``allow_host_ports``: what a sandbox may reach on the host's loopback, as (port at its 127.0.0.1, host port)
    pairs (Tensora's API and gateway, which check keys, on their sandbox listeners); every other host service
    stays out of reach. ``files_root`` (default ``DATA_DIR/files``) and
    ``shared_models`` are owners' storage and the operator's shared roots, as ``tensora.storage`` has them:
    the only places a VM's disk and its backing files may be."""

    def __init__(self, data_dir: Path, node: Node, catalog: Catalog, gpu_indices: Sequence[int] = (),
                 runtimes_dir: Path | None = None, vfio: Mapping[int, str] | None = None,
                 sysfs: Path = Path("/sys"), devfs: Path = Path("/dev"), *,
                 isolation: Isolation | str = Isolation.SANDBOX,
                 allow_host_ports: Sequence[tuple[int, int]] = (),
                 runc: Runc | None = None, files_root: Path | None = None,
                 shared_models: Mapping[str, Path] | None = None,
                 nvidia_driver: Sequence[str | Path] = (), auto_install: bool = False,
                 installer: runtimes.Installer = runtimes.install, log_size: int = LOG_SIZE,
                 home_size: int = HOME_SIZE) -> None:
        data_dir = Path(data_dir)
        self.log_size = log_size
        self.root = private_dir(data_dir / "replicas")
        self.records = Records(self.root)
        self.runtimes = runtimes_dir or runtimes.runtimes_dir(data_dir)
        self.installs = runtimes.Background(self.runtimes, installer)
        self._waiting: dict[str, ReplicaSpec] = {}  # replicas waiting for their runtime's install
        self.node = node
        self.catalog = catalog
        vfio = dict(vfio or {})  # GPU index -> PCI address bound to vfio-pci (VM passthrough)
        self.gpu_indices = sorted(set(gpu_indices) | set(vfio))
        self.devfs = devfs
        self.nvidia_paths = tuple(nvidia_driver)  # the operator's node.nvidia_driver; () = found as usual
        self._nvidia: NvidiaDriver | None = None
        self.isolation = Isolation(isolation)
        origins = Origins(self.records, [inside for inside, _ in allow_host_ports])
        self.work = data_dir / "workdirs"
        self.notebooks = NotebookLauncher(self.records, origins, self.work, home_size)
        self.vms = VmLauncher(self.records, Path(files_root) if files_root is not None else data_dir / "files",
                              {name: Path(path) for name, path in (shared_models or {}).items()}, vfio, sysfs, devfs)
        self.endpoints = EndpointLauncher(self.records, origins, self.runtimes, self.installs,
                                          replicakeys.ensure_secret(data_dir), auto_install=auto_install)
        self.launchers: dict[WorkloadKind, Launcher] = {
            WorkloadKind.NOTEBOOK: self.notebooks, WorkloadKind.VM: self.vms, WorkloadKind.ENDPOINT: self.endpoints}
        sandboxes = data_dir / "sandboxes"
        self.sandboxes = SandboxRunner(runc or Runc(sandboxes / "runc", sandboxes / "bundles"), self.records,
                                       catalog, allow_host_ports)
        self.processes = ProcessRunner(self.records)
        if self.isolation is Isolation.SANDBOX or any(r.sandbox for r in self.records.all()):
            private_dir(sandboxes)
            self._write_all(self.sandboxes.adopt([r for r in self.records.live() if r.sandbox]))
        self._write_all(self.processes.adopt([r for r in self.records.live()
                                              if not r.sandbox and r.pid is None and not r.installing]))

    @property
    def runc(self) -> Runc:
        """The sandbox runtime."""
        return self.sandboxes.runc

    @property
    def oom_kills(self) -> int:
        """Processes of sandboxes killed for their memory limit, seen by this process (metrics)."""
        return self.sandboxes.oom_kills

    # -- the driver protocol -------------------------------------------------------------

    def nodes(self) -> Sequence[Node]:
        return [self.node]

    def start(self, spec: ReplicaSpec) -> ReplicaStatus:
        # 1. idempotent: a replica already starting or running is left as it is
        record = self.records.read(spec.id)
        if record is not None and not record.ended and not record.installing:
            return record.status()
        if record is not None and record.installing and spec.id in self._waiting:
            return record.status()
        private_dir(self.records.dir(spec.id))
        sandboxed = self.isolation is Isolation.SANDBOX
        record = ReplicaRecord.claim(spec, sandboxed=sandboxed, now=time.time())
        # 2. what it runs and sees; a replica that cannot start fails with the reason
        try:
            launched, devices = self._launch(spec, record)
        except Installing as exc:  # no process yet: ``observe`` starts it once its runtime is installed
            self._waiting[spec.id] = spec
            record.installing, record.detail, record.gpus, record.cpuset = exc.runtime, str(exc), [], []
            self.records.write(record)
            return record.status()
        except (LaunchError, ImageRefused, ModelFileError, OSError) as exc:
            # a missing runtime, a refused image or model: placing it again fails the same way
            permanent = isinstance(exc, ImageRefused | ModelFileError) or getattr(exc, "permanent", False)
            return self._fail(record, str(exc), permanent)
        # 3. claimed before its sandbox exists: a crash from here on leaves no sandbox that no replica claims
        self.records.write(record)
        # 4. run it: in its sandbox, or as a process of Tensora's user
        error = self._runner(record).run(spec, launched, devices, record)
        if error is not None:
            return self._fail(record, error)
        self.records.write(record)
        return record.status()

    def stop(self, replica_id: str) -> ReplicaStatus:
        record = self.records.read(replica_id)
        if record is None:
            raise KeyError(replica_id)
        if record.ended:
            return record.status()
        if record.stop_requested_at is None:
            record.stop_requested_at, record.state = time.time(), ReplicaState.STOPPING
            self.records.write(record)
            if not self.launchers[record.kind].ask_to_stop(record):
                self._runner(record).signal(record, signal.SIGTERM)
        return record.status()

    def release(self, workload_id: str) -> None:
        """Remove what a deleted workload's replicas left: a notebook's working dir (kept across its restarts
        until now), a VM's disk overlays (what its guests wrote)."""
        ended = [r for r in self.records.all() if r.workload_id == workload_id and r.ended]
        for kind, launcher in self.launchers.items():
            launcher.release(workload_id, [r for r in ended if r.kind is kind])

    def prune(self, ended_before: float) -> int:
        """Remove the dirs of replicas that ended at or before ``ended_before`` (their record and log): a crash loop
        leaves one a try. Kept: one still holding a VM's disk (``release`` removes it once the workload is
        deleted) or a sandbox whose delete failed (``observe`` retries it)."""
        gone = 0
        for record in self.records.all():
            ended = record.ended_at
            if (not record.ended or ended is None or ended > ended_before or record.sandbox_left
                    or overlay_path(self.records.dir(record.id)).exists()):
                continue
            self.processes.forget(record.id)
            shutil.rmtree(self.records.dir(record.id), ignore_errors=True)
            gone += 1
        return gone

    def observe(self) -> Sequence[ReplicaStatus]:
        out = []
        now = time.time()
        for record in self.records.all():
            if record.ended:
                self.processes.reap(record.id)
                if record.sandbox_left:  # its delete failed before: try again
                    self.sandboxes.delete(record)
                    self.records.write(record)
                if now - (record.ended_at or now) < FORGET_STOPPED_S:
                    out.append(record.status())
                continue
            self._refresh(record, now)
            self._cap_logs(record)
            out.append(record.status())
        return out

    def access(self, replica_id: str) -> dict[str, str | int | None]:
        """What a user needs to reach the replica (notebook URL, VM console and QMP socket)."""
        record = self.records.read(replica_id)
        found: dict[str, str | int | None] = {"url": None, "socket": None, "pid": None, "console": None}
        if record is not None:
            found = {"url": record.url, "socket": record.socket, "pid": record.pid, "console": record.console}
        return found | {"log": str(self.records.dir(replica_id) / OUT_LOG)}

    # -- what a replica runs ------------------------------------------------------------

    def _launch(self, spec: ReplicaSpec, record: ReplicaRecord) -> tuple[Launch, list[Device]]:
        """The replica's launch (its kind's launcher's) and its devices, or LaunchError saying why it cannot
        start."""
        if self.isolation is Isolation.ADMIN_ONLY and spec.owner != ADMIN_OWNER:
            raise LaunchError("this host cannot sandbox replicas, so it runs the admin owner's only (the "
                              "operator may set isolation: none to run every owner's unsandboxed)", permanent=True)
        if record.sandbox and (not spec.uid or not spec.gid):
            raise LaunchError(f"no sandbox uid for owner {spec.owner!r}: the replica was not started")
        cls = self.catalog[spec.cls]
        record.gpus = self._claim_gpus(cls.gpu_count) if not cls.is_cpu else []
        launched = self.launchers[spec.kind].launch(spec, record, cls)
        if not record.sandbox:
            return launched, []
        devices = [self._device(p) for p in launched.devices]
        if spec.kind is not WorkloadKind.VM and record.gpus:  # a VM takes its GPUs by VFIO, not the NVIDIA driver
            devices += self._gpu_devices(record.gpus)
            launched = launch.with_nvidia_driver(launched, self._nvidia_driver())
        record.cpuset = self._claim_cores(cls)
        return launched, devices

    def _device(self, path: str) -> Device:
        """The sandbox's device node ``path``, with the numbers of the host's (``devfs`` in tests)."""
        try:
            return replace(host_device(str(self.devfs / path.removeprefix("/dev/"))), path=path)
        except OSError:
            raise LaunchError(f"{path} is not on this host") from None

    def _gpu_devices(self, gpus: Sequence[int]) -> list[Device]:
        """Only these GPUs' nodes, plus NVIDIA's shared control nodes this host has."""
        if not gpus:
            return []
        out = [self._device(f"/dev/nvidia{g}") for g in gpus]
        for name in GPU_CONTROL_DEVICES:
            with contextlib.suppress(LaunchError):
                out.append(self._device(f"/dev/{name}"))
        return out

    def _nvidia_driver(self) -> NvidiaDriver:
        """The host's NVIDIA driver files, found once (the first GPU replica's start)."""
        if self._nvidia is None:
            self._nvidia = find_nvidia_driver(self.nvidia_paths)
        return self._nvidia

    def _claim_gpus(self, count: int) -> list[int]:
        taken = {g for r in self.records.live() for g in r.gpus}
        free = [g for g in self.gpu_indices if g not in taken]
        if len(free) < count:
            raise LaunchError(f"{count} GPU(s) needed, {len(free)} free on this machine")
        return free[:count]

    def _claim_cores(self, cls: ComputeClass) -> list[int]:
        """Cores of its own where the node does not overcommit them (see ``launch.choose_cpuset``)."""
        cores = self.node.cores
        overcommitted = cores is not None and self.node.cpu > cores + 1e-9
        try:
            mine = sorted(os.sched_getaffinity(0))
        except AttributeError:
            return []
        offered = mine[-int(cores if cores is not None else self.node.cpu):] if mine else []
        taken = {c for r in self.records.live() for c in r.cpuset}
        return launch.choose_cpuset(offered, taken, cls.cpu, overcommitted=overcommitted)

    # -- what becomes of a replica ------------------------------------------------------

    def _refresh(self, record: ReplicaRecord, now: float) -> None:
        """One live replica: its install's step, its end, its stop's escalation, its bound, its readiness."""
        if record.installing:
            self._install_step(record)
            return
        launcher = self.launchers[record.kind]
        ended = self._runner(record).ended(record)
        if ended is not None:
            stopped = record.stop_requested_at is not None and not record.bound
            full = None if stopped else record.bound or launcher.over_bound(record, now)
            record.state = ReplicaState.STOPPED if stopped else ReplicaState.FAILED
            record.detail = "stopped" if stopped else f"{full}; {ended}" if full else ended
            record.ended_at = now
            self.records.write(record)
            return
        if record.stop_requested_at is not None:
            waited = now - record.stop_requested_at
            launcher.urge_to_stop(record, waited)
            if waited > STOP_GRACE_S:
                self._runner(record).signal(record, signal.SIGKILL)
            return
        if record.sandbox:
            self._note_oom(record)
        if not record.home_mounted and (full := launcher.over_bound(record, now)):  # measured past its bound
            record.bound = record.detail = full
            self.records.write(record)
            self.stop(record.id)
            self._reload(record)
            return
        if record.state is ReplicaState.STARTING and launcher.ready(record):
            record.state = ReplicaState.RUNNING
            self.records.write(record)

    def _install_step(self, record: ReplicaRecord) -> None:
        """A replica waiting for its runtime: its install's progress, its failure, or its start once installed."""
        spec = self._waiting.get(record.id)
        if record.stop_requested_at is not None or spec is None:  # asked to stop, or this driver restarted
            self._waiting.pop(record.id, None)
            stopped = record.stop_requested_at is not None
            record.state = ReplicaState.STOPPED if stopped else ReplicaState.FAILED
            record.installing, record.ended_at = None, time.time()
            record.detail = "stopped" if stopped else "its runtime's install was cut short (Tensora restarted)"
            self.records.write(record)
            return
        runtime = record.installing
        assert runtime is not None
        state, why = self.installs.state(runtime)
        if state == "installing":
            if why != record.detail:
                record.detail = why
                self.records.write(record)
            return
        if state == "failed":
            del self._waiting[record.id]
            self._fail(replace(record, installing=None), why or f"installing runtime {runtime} failed",
                       permanent=True)
        else:
            self.start(self._waiting.pop(record.id))
        self._reload(record)

    def _note_oom(self, record: ReplicaRecord) -> None:
        """A process of a running replica killed for its memory limit: said in its detail while it runs on."""
        if self.sandboxes.note_oom(record):
            self.records.write(record)

    def _cap_logs(self, record: ReplicaRecord) -> None:
        """A live replica's logs cut back to ``log_size`` (``logcap``); the rotated copies stay in the replica's
        dir, which only Tensora enters."""
        d = self.records.dir(record.id)
        logcap.cap(d / OUT_LOG, self.log_size, d / f"{OUT_LOG}.1")
        for log_file in self.launchers[record.kind].logs(record):
            logcap.cap(log_file.path, self.log_size, log_file.rotated)

    def _fail(self, record: ReplicaRecord, detail: str, permanent: bool = False) -> ReplicaStatus:
        record.state, record.detail, record.ended_at, record.permanent = (
            ReplicaState.FAILED, detail, time.time(), permanent)
        self.records.write(record)
        return record.status()

    def _runner(self, record: ReplicaRecord) -> Runner:
        return self.sandboxes if record.sandbox else self.processes

    # -- records ---------------------------------------------------------------------------

    def _reload(self, record: ReplicaRecord) -> None:
        """``record`` as written since (another step of this observe wrote it); unchanged if it is gone."""
        again = self.records.read(record.id)
        if again is not None:
            for f in fields(again):
                setattr(record, f.name, getattr(again, f.name))

    def _write_all(self, records: Sequence[ReplicaRecord]) -> None:
        for record in records:
            self.records.write(record)

    def _read(self, replica_id: str) -> dict[str, Any] | None:
        """The replica's ``replica.json`` as it is on disk (for diagnostics and tests)."""
        return self.records.read_json(replica_id)
