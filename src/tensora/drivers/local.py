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

* notebook: JupyterLab on 127.0.0.1 and a free port in its sandbox, published on its own address (bound there
  directly when not sandboxed), its token in its environment; ready when ``/api/status`` answers. Its files are
  in ``DATA_DIR/workdirs/<workload id>/`` (owned by the owner's uid), kept across the workload's restarts and
  removed by ``release`` once it is deleted: a file system of its own of ``home_size`` (``drivers.homes``;
  measured, and the notebook stopped past it, where none can be mounted). GPU placement shows its GPUs (device nodes and
  ``CUDA_VISIBLE_DEVICES``) and the host's NVIDIA driver (read-only at ``/opt/nvidia``, see ``drivers.launch``);
  CPU placement none.
* vm: QEMU with QMP on a unix socket in the VM's dir (shared with the host); KVM when ``/dev/kvm`` opens, else
  TCG; ready when QMP ``query-status`` says running. Stop = ``system_powerdown``, then ``quit``, then SIGKILL.
  An optional disk image, which the server resolved inside the owner's files (``files_root``, the dir
  ``storage.owner_dir`` names for the replica's owner) or inside a shared root (``shared_models``): before
  anything opens it, ``vmdisk.inspect`` checks its whole backing chain against the one of those roots that
  holds the image (an owner's image cannot use a shared image as its backing file, nor the reverse), and a
  refusal fails the replica with its message, which names no host path (a virtual size over the class's
  ``disk`` is refused too). The guest writes only to an overlay,
  ``replicas/<id>/vm/disk.qcow2`` (the owner's uid, 0600): kept when the same replica starts again, a new one
  for a new replica, removed by ``release`` once the workload is deleted. The owner's image stays intact.
* endpoint: a model server from the runtime registry (``runtimes``) on a free port, its model read-only at
  ``/model`` (the name it answers to, reported as ``served_model``); ready when ``/v1/models`` answers. A
  runtime that takes an API key gets the replica's (``replicakeys``, in its environment): only the gateway
  and this driver's probe send it.
  Without an installed runtime the replica fails with a reason that says which to install; with
  ``auto_install`` (``runtimes.auto_install``, on for ``tensora up``) it waits, starting, while the portable
  runtime installs in the background (``runtimes.Background``, the install's step its reason), and starts
  once it is installed (a failed install fails it, with the installer's last lines).

Each live replica's ``out.log`` and a VM's console are cut back to ``log_size`` on observe (``drivers.logcap``).
What a replica's owner is shown (its ``url``) names no host path: a VM has none.

Stop is graceful first (SIGTERM, or QMP), then SIGKILL of every process after a deadline; ``observe`` does the
escalation, so nothing here blocks the controller. A replica that ends is reported stopped (asked) or failed,
with the cgroup's reason (``out of memory: limit 16 GiB of cpu-4c-16g``), read before its sandbox is deleted.

Isolation (``Isolation``): ``sandbox`` as above; ``none`` (the operator's explicit choice) runs replicas as
plain processes of Tensora's user; ``admin-only`` (no sandbox on this host, none chosen) runs only the admin
owner's replicas, as processes, and fails every other owner's with the reason.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import secrets
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import replace
from enum import StrEnum
from pathlib import Path
from typing import Any

import httpx

from tensora.drivers import homes, logcap, loopback, vmdisk
from tensora.drivers import launch as plan
from tensora.drivers.base import ReplicaSpec, ReplicaStatus
from tensora.drivers.vmdisk import ImageRefused
from tensora.errors import ModelFileError
from tensora.keys import replicakeys
from tensora.models import runtimes
from tensora.placement.capacity import Node
from tensora.placement.catalog import Catalog, ComputeClass
from tensora.placement.kinds import ReplicaState, WorkloadKind
from tensora.sandbox import Device, Runc, SandboxError, SandboxState, host_device
from tensora.sandbox.host import NvidiaDriver
from tensora.sandbox.host import nvidia_driver as find_nvidia_driver
from tensora.sandbox.network import NETNS_FILE
from tensora.storage import owner_dir
from tensora.units import format_memory

log = logging.getLogger("tensora.drivers.local")

STOP_GRACE_S = 10.0
VM_POWERDOWN_S = 3.0
PROBE_TIMEOUT_S = 0.5
FORGET_STOPPED_S = 3600.0
ADMIN_OWNER = "admin"
"""The owner of the admin key ``tensora serve`` creates on first start."""
ENDED = ("stopped", "failed")
LOG_SIZE = 16 * 2**20
"""A replica's log, and a VM's serial console, are cut back past this (one rotated file of as much kept)."""
HOME_SIZE = 10 * 2**30
"""A notebook's home: the size of its file system (``drivers.homes``), or the bound measured where none can be
mounted."""
HOME_CHECK_S = 30.0
"""How often a measured home (no file system of its own) is measured."""
REPLICA_ENV = "TENSORA_REPLICA"
"""A process replica's id in its environment: how a driver finds a process a crash left unrecorded."""


class Isolation(StrEnum):
    """How the local driver runs replicas."""

    SANDBOX = "sandbox"
    """Each in a sandbox of its own (the default)."""
    NONE = "none"
    """As processes of Tensora's user: the operator chose it (``isolation: none``)."""
    ADMIN_ONLY = "admin-only"
    """This host cannot sandbox and the operator chose nothing: only the admin owner's replicas run."""


PORTABLE = "tensora-transformers"
"""The runtime installed for an endpoint that finds none: every kind's fallback (CPU, CUDA, MPS)."""


class _Installing(Exception):
    """The endpoint's runtime is installing in the background: the replica waits (the message says how far)."""

    def __init__(self, runtime: str, progress: str) -> None:
        super().__init__(progress or f"installing runtime {runtime}")
        self.runtime = runtime


def kvm_usable() -> bool:
    try:
        fd = os.open("/dev/kvm", os.O_RDWR)
    except OSError:
        return False
    os.close(fd)
    return True


def qmp(path: str, *commands: dict[str, Any], timeout: float = 2.0) -> list[Any]:
    """Run QMP commands on a VM's socket; their ``return`` values (an error raises OSError).

    A path longer than a socket address allows (a data dir deep in the tree) is reached through its dir's
    descriptor (``/proc/self/fd/N/name``)."""
    with contextlib.ExitStack() as stack, socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        if len(os.fsencode(path)) > 100:
            fd = os.open(os.path.dirname(path), os.O_PATH | os.O_DIRECTORY)
            stack.callback(os.close, fd)
            path = f"/proc/self/fd/{fd}/{os.path.basename(path)}"
        s.connect(path)
        f = s.makefile("rwb")
        json.loads(f.readline())  # the greeting
        out = []
        for cmd in ({"execute": "qmp_capabilities"}, *commands):
            f.write(json.dumps(cmd).encode() + b"\n")
            f.flush()
            while True:
                msg = json.loads(f.readline() or b"{}")
                if not msg:
                    raise OSError("QMP closed the connection")
                if "event" in msg:
                    continue
                if "error" in msg:
                    raise OSError(f"QMP {cmd['execute']}: {msg['error'].get('desc')}")
                out.append(msg.get("return"))
                break
        return out[1:]


def tensora_env() -> plan.PythonEnv:
    """Tensora's own Python environment (JupyterLab comes from it), and the installation it was made from."""
    python = sys.executable if sys.executable.startswith(sys.prefix + "/") else f"{sys.prefix}/bin/python3"
    return plan.PythonEnv(sys.prefix, sys.base_prefix, python, f"{sys.version_info[0]}.{sys.version_info[1]}")


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
        self.log_size, self.home_size = log_size, home_size
        self.files_root = Path(files_root) if files_root is not None else data_dir / "files"
        self.shared_models = {name: Path(path) for name, path in (shared_models or {}).items()}
        self.runtimes = runtimes_dir or runtimes.runtimes_dir(data_dir)
        self.auto_install = auto_install
        self.installs = runtimes.Background(self.runtimes, installer)
        self._waiting: dict[str, ReplicaSpec] = {}  # replicas waiting for their runtime's install
        self.root = _private_dir(data_dir / "replicas")
        self.oom_kills = 0  # processes of sandboxes killed for their memory limit, seen by this process (metrics)
        self.replica_secret = replicakeys.ensure_secret(data_dir)
        self.work = data_dir / "workdirs"
        self.node = node
        self.catalog = catalog
        self.vfio = dict(vfio or {})  # GPU index -> PCI address bound to vfio-pci (VM passthrough)
        self.gpu_indices = sorted(set(gpu_indices) | set(self.vfio))
        self.sysfs, self.devfs = sysfs, devfs
        self.nvidia_paths = tuple(nvidia_driver)  # the operator's node.nvidia_driver; () = found as usual
        self._nvidia: NvidiaDriver | None = None
        self.isolation = Isolation(isolation)
        self.allow_host_ports = tuple(allow_host_ports)
        sandboxes = data_dir / "sandboxes"
        self.runc = runc or Runc(sandboxes / "runc", sandboxes / "bundles")
        self.python = tensora_env()
        self._children: dict[str, subprocess.Popen[bytes]] = {}
        if self.isolation is Isolation.SANDBOX or any(m.get("sandbox") for m in self._metas()):
            _private_dir(sandboxes)
            self._adopt()
        self._adopt_processes()

    # -- the driver protocol -------------------------------------------------------------

    def nodes(self) -> Sequence[Node]:
        return [self.node]

    def start(self, spec: ReplicaSpec) -> ReplicaStatus:
        # 1. idempotent: a replica already starting or running is left as it is
        meta = self._read(spec.id)
        if meta is not None and meta["state"] not in ENDED and not meta.get("installing"):
            return self._status(meta)
        if meta is not None and meta.get("installing") and spec.id in self._waiting:
            return self._status(meta)
        _private_dir(self.root / spec.id)
        sandboxed = self.isolation is Isolation.SANDBOX
        meta = {"id": spec.id, "workload_id": spec.workload_id, "kind": spec.kind.value, "cls": spec.cls,
                "node": spec.node, "owner": spec.owner, "model": spec.model, "image": spec.image,
                "sandbox": sandboxed, "uid": spec.uid, "state": "starting", "pid": None, "proc_start": None,
                "port": None, "address": None, "host": None, "token": None, "url": None, "socket": None,
                "console": None, "served_model": None,
                "detail": "", "started_at": time.time(), "stop_requested_at": None, "ended_at": None, "gpus": [],
                "cpuset": [], "oom_kills": 0}
        # 2. what it runs and sees; a replica that cannot start fails with the reason
        try:
            launch, devices = self._launch(spec, meta, sandboxed)
        except _Installing as exc:  # no process yet: ``observe`` starts it once its runtime is installed
            self._waiting[spec.id] = spec
            meta.update(installing=exc.runtime, detail=str(exc), gpus=[], cpuset=[])
            self._write(meta)
            return self._status(meta)
        except (plan.LaunchError, ImageRefused, ModelFileError, OSError) as exc:
            # a missing runtime, a refused image or model: placing it again fails the same way
            permanent = isinstance(exc, ImageRefused | ModelFileError) or getattr(exc, "permanent", False)
            return self._fail(meta, str(exc), permanent)
        # 3. claimed before its sandbox exists: a crash from here on leaves no sandbox that no replica claims
        self._write(meta)
        # 4. run it: in its sandbox, or as a process of Tensora's user
        error = self._run_sandbox(spec, launch, devices, meta) if sandboxed else self._run_process(launch, meta)
        if error is not None:
            return self._fail(meta, error)
        self._write(meta)
        return self._status(meta)

    def _run_sandbox(self, spec: ReplicaSpec, launch: plan.Launch, devices: list[Device],
                     meta: dict[str, Any]) -> str | None:
        assert spec.uid is not None and spec.gid is not None
        limits = plan.limits(self.catalog[spec.cls], meta["cpuset"])
        sandbox = plan.sandbox_spec(launch, spec.id, spec.uid, spec.gid, limits, devices, self.allow_host_ports)
        try:
            handle = self.runc.start(sandbox, log=self.root / spec.id / "out.log")
        except (SandboxError, ValueError) as exc:
            return str(exc)
        _release_netns_mount(handle.bundle)
        meta.update(pid=handle.pid, proc_start=_proc_start(handle.pid))
        return None

    def _run_process(self, launch: plan.Launch, meta: dict[str, Any]) -> str | None:
        out = os.open(self.root / meta["id"] / "out.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:  # a session of its own: it outlives the server
            proc = subprocess.Popen(launch.argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env={**launch.env, REPLICA_ENV: meta["id"]}, cwd=launch.cwd,
                                    start_new_session=True)
        except OSError as exc:
            return f"could not start {launch.argv[0]}: {exc}"
        finally:
            os.close(out)
        self._children[meta["id"]] = proc
        meta.update(pid=proc.pid, proc_start=_proc_start(proc.pid))
        return None

    def stop(self, replica_id: str) -> ReplicaStatus:
        meta = self._read(replica_id)
        if meta is None:
            raise KeyError(replica_id)
        if meta["state"] in ENDED:
            return self._status(meta)
        if meta["stop_requested_at"] is None:
            meta.update(stop_requested_at=time.time(), state="stopping")
            self._write(meta)
            if meta["kind"] == WorkloadKind.VM.value and meta["socket"]:
                with contextlib.suppress(OSError, ValueError):
                    qmp(meta["socket"], {"execute": "system_powerdown"})
            else:
                self._signal(meta, signal.SIGTERM)
        return self._status(meta)

    def release(self, workload_id: str) -> None:
        """Remove what a deleted workload's replicas left: a notebook's working dir (kept across its restarts
        until now), a VM's disk overlays (what its guests wrote)."""
        homes.unmount(self._home_path(workload_id))
        shutil.rmtree(self._home_path(workload_id), ignore_errors=True)
        for meta in self._metas():
            if meta["workload_id"] == workload_id and meta["state"] in ENDED:
                with contextlib.suppress(FileNotFoundError):
                    (self.root / meta["id"] / "vm" / plan.DISK).unlink()

    def prune(self, ended_before: float) -> int:
        """Remove the dirs of replicas that ended at or before ``ended_before`` (their record and log): a crash loop
        leaves one a try. Kept: one still holding a VM's disk (``release`` removes it once the workload is
        deleted) or a sandbox whose delete failed (``observe`` retries it)."""
        gone = 0
        for meta in self._metas():
            ended = meta.get("ended_at")
            if (meta["state"] not in ENDED or ended is None or ended > ended_before or meta.get("sandbox_left")
                    or (self.root / meta["id"] / "vm" / plan.DISK).exists()):
                continue
            self._children.pop(meta["id"], None)
            shutil.rmtree(self.root / meta["id"], ignore_errors=True)
            gone += 1
        return gone

    def observe(self) -> Sequence[ReplicaStatus]:
        out = []
        now = time.time()
        for meta in self._metas():
            if meta["state"] in ENDED:
                child = self._children.get(meta["id"])
                if child is not None and child.poll() is not None:  # reap it (another driver stopped it)
                    del self._children[meta["id"]]
                if meta.get("sandbox_left"):  # its delete failed before: try again
                    self._delete_sandbox(meta)
                    self._write(meta)
                if now - (meta["ended_at"] or now) < FORGET_STOPPED_S:
                    out.append(self._status(meta))
                continue
            self._refresh(meta, now)
            self._cap_logs(meta)
            out.append(self._status(meta))
        return out

    def _cap_logs(self, meta: dict[str, Any]) -> None:
        """A live replica's log and a VM's console cut back to ``log_size`` (``logcap``); the rotated copies
        stay in the replica's dir, which only Tensora enters."""
        d = self.root / meta["id"]
        logcap.cap(d / "out.log", self.log_size, d / "out.log.1")
        if meta["kind"] == WorkloadKind.VM.value:
            logcap.cap(d / "vm" / "console.log", self.log_size, d / "console.log.1")

    # -- what a replica runs ------------------------------------------------------------

    def _launch(self, spec: ReplicaSpec, meta: dict[str, Any],
                sandboxed: bool) -> tuple[plan.Launch, list[Device]]:
        """The replica's launch and its devices, or LaunchError saying why it cannot start."""
        if self.isolation is Isolation.ADMIN_ONLY and spec.owner != ADMIN_OWNER:
            raise plan.LaunchError("this host cannot sandbox replicas, so it runs the admin owner's only (the "
                                   "operator may set isolation: none to run every owner's unsandboxed)", permanent=True)
        if sandboxed and (not spec.uid or not spec.gid):
            raise plan.LaunchError(f"no sandbox uid for owner {spec.owner!r}: the replica was not started")
        cls = self.catalog[spec.cls]
        meta["gpus"] = gpus = self._claim_gpus(cls.gpu_count) if not cls.is_cpu else []
        d = self.root / spec.id
        if spec.kind is WorkloadKind.NOTEBOOK:
            if not _importable("jupyterlab"):
                raise plan.LaunchError("JupyterLab is not installed: pip install 'tensora[notebook]'", permanent=True)
            origin, port = self._origin(spec.id, meta)
            token = secrets.token_urlsafe(24)
            home, meta["home_mounted"] = self._home(spec.workload_id, spec.uid if sandboxed else None, spec.gid)
            if not sandboxed:
                for name in ("config", "data", "runtime"):
                    (d / "jupyter" / name).mkdir(parents=True, exist_ok=True)
            launch = plan.notebook(self.python, home, d, port, token, cls, gpus, sandboxed=sandboxed,
                                   as_root=os.geteuid() == 0, origin=origin)
            meta.update(token=token, url=origin.url(port, f"/lab?token={token}"))
        elif spec.kind is WorkloadKind.VM:
            launch = self._vm(spec, cls, gpus, meta, sandboxed)
        else:
            launch = self._endpoint(spec, cls, gpus, meta, sandboxed)
        if not sandboxed:
            return launch, []
        devices = [self._device(p) for p in launch.devices]
        if spec.kind is not WorkloadKind.VM and gpus:  # a VM takes its GPUs by VFIO, not the NVIDIA driver
            devices += self._gpu_devices(gpus)
            launch = plan.with_nvidia_driver(launch, self._nvidia_driver())
        meta["cpuset"] = self._claim_cores(cls)
        return launch, devices

    def _endpoint(self, spec: ReplicaSpec, cls: ComputeClass, gpus: list[int], meta: dict[str, Any],
                  sandboxed: bool) -> plan.Launch:
        kind = "metal" if (cls.gpu_model or "").upper().endswith("METAL") else ("cpu" if cls.is_cpu else "gpu")
        runtime = runtimes.choose(self.runtimes, kind)
        if runtime is None and self.auto_install:
            name = PORTABLE
            self.installs.want(name)
            raise _Installing(name, self.installs.state(name)[1])
        if runtime is None:
            raise plan.LaunchError(f"no model runtime is installed for {kind} endpoints in {self.runtimes}: "
                                   "tensora runtime install tensora-transformers", permanent=True)
        if not spec.model:
            raise plan.LaunchError("an endpoint needs a model", permanent=True)
        if not os.path.exists(spec.model):
            raise plan.LaunchError("the endpoint's model is not in its owner's storage any more", permanent=True)
        if sandboxed:
            _readable_by_others(Path(spec.model), "the model's")
        venv = runtimes.venv_dir(self.runtimes, runtime.name)
        env = plan.PythonEnv(str(venv), str(runtimes.base_prefix(venv) or venv), str(venv / "bin" / "python"))
        origin, port = self._origin(spec.id, meta)
        launch = plan.endpoint(runtime, env, spec.model, spec.workload_id, port, kind, cls, gpus,
                               self.root / spec.id, sandboxed=sandboxed,
                               api_key=replicakeys.derive(self.replica_secret, spec.id), address=origin.address)
        # the gateway's route: the address (the gateway resolves no *.localhost name), never a browser's page
        meta.update(url=origin.connect_url(port, "/v1"), runtime=runtime.name,
                    served_model=launch.served_model, detail=f"runtime {runtime.name}")
        return launch

    def _vm(self, spec: ReplicaSpec, cls: ComputeClass, gpus: list[int], meta: dict[str, Any],
            sandboxed: bool) -> plan.Launch:
        qemu = _which("qemu-system-x86_64")
        if qemu is None:
            raise plan.LaunchError("QEMU is not installed: apt-get install qemu-system-x86", permanent=True)
        vfio = [self._vfio(g) for g in gpus]
        accel = "kvm" if kvm_usable() else "tcg"
        if vfio and accel != "kvm":
            raise plan.LaunchError("GPU passthrough needs KVM (/dev/kvm), which this host does not offer",
                                   permanent=True)
        vm_dir = _private_dir(self.root / spec.id) / "vm"
        vm_dir.mkdir(mode=0o700, exist_ok=True)
        # the disk first: checked before anything opens it, its overlay made, or the replica fails here
        disk = self._disk(spec, vm_dir, sandboxed) if spec.image else None
        if sandboxed:  # QEMU (the owner's uid) makes its socket and console here; the host reaches them
            assert spec.uid is not None and spec.gid is not None
            os.chown(vm_dir, spec.uid, spec.gid)
            host_socket, inner_socket = str(vm_dir / "qmp.sock"), f"{plan.VM_DIR}/qmp.sock"
        else:
            host_socket = inner_socket = _short_socket(self.root / spec.id)
        launch = plan.vm(qemu, spec.id, cls, accel, [a for a, _ in vfio], vm_dir, inner_socket, disk,
                         sandboxed=sandboxed, vfio_groups=[g for _, g in vfio])
        # no url: its socket is a host path, which its owner is never shown
        meta.update(socket=host_socket, url=None, detail=f"accel {accel}", console=str(vm_dir / "console.log"))
        return launch

    def _disk(self, spec: ReplicaSpec, vm_dir: Path, sandboxed: bool) -> vmdisk.ImageInfo:
        """The VM's disk: the owner's image and its backing chain checked inside the root that holds it
        (``vmdisk.inspect``, which opens nothing outside it), then its overlay in the VM dir, the owner's
        (``vmdisk.overlay``: an existing one is kept). ImageRefused or LaunchError say why not."""
        assert spec.image is not None
        image = Path(spec.image)
        roots = [owner_dir(self.files_root, spec.owner), *self.shared_models.values()]
        root = plan.image_root(image.resolve(), [r.resolve() for r in roots])
        if root is None:  # a row from before owners' files, or a path the server never resolved
            raise ImageRefused(image.name, "not in your files")
        cls = self.catalog[spec.cls]
        info = vmdisk.inspect(image, root, vmdisk.DiskCap(cls.disk, f"class {cls.name}"))
        if sandboxed:  # each file is bound alone into the sandbox: its own mode decides
            for layer in info.chain:
                _readable_by_others(layer.path, "the disk image")
        overlay = vmdisk.overlay(info, vm_dir / plan.DISK)
        if sandboxed:
            assert spec.uid is not None and spec.gid is not None
            _own(overlay, spec.uid, spec.gid)
        return info

    def _origin(self, replica_id: str, meta: dict[str, Any]) -> tuple[loopback.Origin, int]:
        """The replica's own loopback host (none a live replica has) and a free port there, noted in ``meta``."""
        taken = {h for m in self._live_metas() if m["id"] != replica_id for h in (m.get("address"), m.get("host"))
                 if h}
        try:
            origin = loopback.choose(replica_id, taken, loopback.bindable)
        except loopback.NoAddress as exc:
            raise plan.LaunchError(str(exc)) from None
        port = loopback.free_port(origin.address, [inside for inside, _ in self.allow_host_ports])
        meta.update(address=origin.address, host=origin.host, port=port)
        return origin, port

    def _home(self, workload_id: str, uid: int | None, gid: int | None) -> tuple[Path, bool]:
        """A notebook's files, kept across its restarts: owned by the owner's uid when sandboxed, on a file
        system of ``home_size`` of its own (``drivers.homes``); whether it is (else its size is measured)."""
        home = self._home_path(workload_id)
        _private_dir(self.work)
        home.mkdir(mode=0o700, exist_ok=True)
        try:
            homes.mount(home, self.home_size, os.geteuid() if uid is None else uid,
                        os.getegid() if gid is None else gid)
            mounted = True
        except homes.NoBound as exc:
            log.warning("notebook home %s has no file system of its own (%s): its size is measured instead",
                        workload_id, exc)
            mounted = False
        except OSError as exc:  # an older, unbounded home that does not fit its bound
            raise plan.LaunchError(f"{self._bound().full()} (what it held before does not fit: {exc.strerror})",
                                   permanent=True) from None
        if uid is not None and gid is not None and home.stat().st_uid != uid:
            for where, dirs, files in os.walk(home):  # made by an earlier, unsandboxed run, or another uid
                for name in (where, *(os.path.join(where, n) for n in dirs + files)):
                    os.lchown(name, uid, gid)
        return home, mounted

    def _bound(self, mounted: bool = True) -> homes.HomeBound:
        return homes.HomeBound(self.home_size, mounted)

    def _home_full(self, meta: dict[str, Any], now: float) -> str | None:
        """A notebook's home at its bound: why (the replica's reason), else None. A mounted home is full when
        its file system has no room left; a measured one is measured every ``HOME_CHECK_S``."""
        if meta["kind"] != WorkloadKind.NOTEBOOK.value:
            return None
        home = self._home_path(meta["workload_id"])
        if meta.get("home_mounted"):
            room = homes.room(home)
            return self._bound().full() if room is not None and room < homes.FULL_BELOW else None
        if now - meta.get("home_measured_at", meta["started_at"]) < HOME_CHECK_S:  # first: a check after start
            return None
        meta["home_measured_at"] = now
        used = homes.usage(home)
        return f"{self._bound(False).full()} ({format_memory(used)} written): stopped" if used > self.home_size \
            else None

    def _home_path(self, workload_id: str) -> Path:
        if not re.fullmatch(r"[A-Za-z0-9_]+", workload_id):  # an id, never a path
            raise ValueError(f"not a workload id: {workload_id!r}")
        return self.work / workload_id

    def _device(self, path: str) -> Device:
        """The sandbox's device node ``path``, with the numbers of the host's (``devfs`` in tests)."""
        try:
            return replace(host_device(str(self.devfs / path.removeprefix("/dev/"))), path=path)
        except OSError:
            raise plan.LaunchError(f"{path} is not on this host") from None

    def _gpu_devices(self, gpus: Sequence[int]) -> list[Device]:
        """Only these GPUs' nodes, plus NVIDIA's shared control nodes this host has."""
        if not gpus:
            return []
        out = [self._device(f"/dev/nvidia{g}") for g in gpus]
        for name in plan.GPU_CONTROL_DEVICES:
            with contextlib.suppress(plan.LaunchError):
                out.append(self._device(f"/dev/{name}"))
        return out

    def _nvidia_driver(self) -> NvidiaDriver:
        """The host's NVIDIA driver files, found once (the first GPU replica's start)."""
        if self._nvidia is None:
            self._nvidia = find_nvidia_driver(self.nvidia_paths)
        return self._nvidia

    def _vfio(self, gpu: int) -> tuple[str, str]:
        """The PCI address of GPU ``gpu`` for ``-device vfio-pci`` and its IOMMU group, checked: bound to
        vfio-pci, its group open to QEMU. Otherwise the reason a user needs to fix it."""
        addr = self.vfio.get(gpu)
        if addr is None:
            raise plan.LaunchError(f"GPU {gpu} is not set up for VM passthrough: bind it to vfio-pci and declare "
                                   f"node.vfio {{{gpu}: <PCI address>}}")
        dev = self.sysfs / "bus" / "pci" / "devices" / addr
        if not dev.exists():
            raise plan.LaunchError(f"GPU {gpu}: no PCI device {addr} on this host (node.vfio)")
        driver = (dev / "driver").resolve().name if (dev / "driver").exists() else "no driver"
        if driver != "vfio-pci":
            raise plan.LaunchError(f"GPU {gpu} at {addr} is bound to {driver}, not vfio-pci: the VM cannot take it")
        group = (dev / "iommu_group").resolve().name if (dev / "iommu_group").exists() else None
        if group is None or not (self.devfs / "vfio" / group).exists():
            raise plan.LaunchError(f"GPU {gpu} at {addr}: its IOMMU group is not open to QEMU "
                                   f"(/dev/vfio/{group}); enable the IOMMU (intel_iommu=on / amd_iommu=on)")
        return addr, group

    def _claim_gpus(self, count: int) -> list[int]:
        taken = {g for m in self._live_metas() for g in m.get("gpus", [])}
        free = [g for g in self.gpu_indices if g not in taken]
        if len(free) < count:
            raise plan.LaunchError(f"{count} GPU(s) needed, {len(free)} free on this machine")
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
        taken = {c for m in self._live_metas() for c in m.get("cpuset", [])}
        return plan.choose_cpuset(offered, taken, cls.cpu, overcommitted=overcommitted)

    # -- state ---------------------------------------------------------------------------

    def _adopt(self) -> None:
        """After a restart: fill in what a crash mid-start left out, and delete every sandbox that no live
        ``replica.json`` claims (the runtime's state lists them all)."""
        if shutil.which(self.runc.runtime) is None:
            return
        live = {m["id"]: m for m in self._live_metas() if m.get("sandbox")}
        try:
            listed = self.runc.list()
        except SandboxError as exc:
            log.warning("cannot list sandboxes to adopt them: %s", exc)
            return
        for sandbox_id in listed:
            meta = live.get(sandbox_id)
            if meta is None:
                log.warning("deleting sandbox %s: no replica claims it", sandbox_id)
                with contextlib.suppress(SandboxError, OSError):
                    self.runc.delete(sandbox_id)
            elif meta["pid"] is None:  # the start was cut short after runc started it
                handle = self.runc.handle(sandbox_id)
                if handle is not None and handle.pid:
                    meta.update(pid=handle.pid, proc_start=_proc_start(handle.pid))
                    self._write(meta)

    def _adopt_processes(self) -> None:
        """After a restart: the process of a replica whose start was cut short before its pid was recorded (it
        leads a session of its own and carries its id in ``TENSORA_REPLICA``) is adopted."""
        unrecorded = {m["id"]: m for m in self._live_metas()
                      if not m.get("sandbox") and m["pid"] is None and not m.get("installing")}
        if not unrecorded:
            return
        for pid, replica_id in _replica_processes().items():
            meta = unrecorded.get(replica_id)
            if meta is not None and meta["pid"] is None:
                log.warning("adopting replica %s: its process %d started, its record was cut short", replica_id, pid)
                meta.update(pid=pid, proc_start=_proc_start(pid))
                self._write(meta)

    def _refresh(self, meta: dict[str, Any], now: float) -> None:
        if meta.get("installing"):
            self._install_step(meta)
            return
        ended = self._ended(meta)
        if ended is not None:
            stopped = meta["stop_requested_at"] is not None and not meta.get("bound")
            full = None if stopped else meta.get("bound") or self._home_full(meta, now)
            meta.update(state="stopped" if stopped else "failed",
                        detail="stopped" if stopped else f"{full}; {ended}" if full else ended, ended_at=now)
            self._write(meta)
            return
        if meta["stop_requested_at"] is not None:
            waited = now - meta["stop_requested_at"]
            if meta["kind"] == WorkloadKind.VM.value and waited > VM_POWERDOWN_S and meta["socket"]:
                with contextlib.suppress(OSError, ValueError):
                    qmp(meta["socket"], {"execute": "quit"})
            if waited > STOP_GRACE_S:
                self._signal(meta, signal.SIGKILL)
            return
        if meta.get("sandbox"):
            self._note_oom(meta)
        if not meta.get("home_mounted") and (full := self._home_full(meta, now)):  # measured past its bound
            meta.update(bound=full, detail=full)
            self._write(meta)
            self.stop(meta["id"])
            meta.update(self._read(meta["id"]) or {})
            return
        if meta["state"] == "starting" and self._ready(meta):
            meta["state"] = "running"
            self._write(meta)

    def _install_step(self, meta: dict[str, Any]) -> None:
        """A replica waiting for its runtime: its install's progress, its failure, or its start once installed."""
        spec = self._waiting.get(meta["id"])
        if meta["stop_requested_at"] is not None or spec is None:  # asked to stop, or this driver restarted
            self._waiting.pop(meta["id"], None)
            stopped = meta["stop_requested_at"] is not None
            meta.update(state="stopped" if stopped else "failed", installing=None, ended_at=time.time(),
                        detail="stopped" if stopped else "its runtime's install was cut short (Tensora restarted)")
            self._write(meta)
            return
        state, why = self.installs.state(meta["installing"])
        if state == "installing":
            if why != meta["detail"]:
                meta["detail"] = why
                self._write(meta)
            return
        if state == "failed":
            del self._waiting[meta["id"]]
            self._fail(meta | {"installing": None}, why or f"installing runtime {meta['installing']} failed",
                       permanent=True)
        else:
            self.start(self._waiting.pop(meta["id"]))
        meta.clear()
        meta.update(self._read(spec.id) or {})

    def _ended(self, meta: dict[str, Any]) -> str | None:
        """None while the replica runs; once it ended, why (its sandbox deleted by then)."""
        log_file = self.root / meta["id"] / "out.log"
        if not meta.get("sandbox"):
            code = self._exit_code(meta)
            if code is None:
                return None
            return f"{f'exited with code {code}' if code >= 0 else 'the process is gone'}; see {log_file}"
        try:
            state = self.runc.state(meta["id"])
        except SandboxError as exc:  # the runtime itself failed: look again next time
            log.warning("sandbox %s: %s", meta["id"], exc)
            return None
        if state in (SandboxState.RUNNING, SandboxState.PAUSED):
            return None
        if state is None:  # the runtime forgot it (a reboot): clean what is left of it
            self._delete_sandbox(meta)
            return f"the process is gone (its sandbox too); see {log_file}"
        reason = self.runc.exit_reason(meta["id"])  # before the delete, which takes the cgroup with it
        if reason:  # killed for its memory: the kills not yet seen while it ran
            self.oom_kills += max(0, (self.runc.oom_kills(meta["id"]) or 0) - meta.get("oom_kills", 0))
        self._delete_sandbox(meta)
        return f"{reason} of {meta['cls']}" if reason else f"the process is gone; see {log_file}"

    def _note_oom(self, meta: dict[str, Any]) -> None:
        """A process of a running replica killed for its memory limit (a notebook's kernel, which Jupyter
        restarts): said in the replica's detail while it runs on."""
        kills = self.runc.oom_kills(meta["id"]) or 0
        if kills > meta.get("oom_kills", 0):
            self.oom_kills += kills - meta.get("oom_kills", 0)
            reason = self.runc.exit_reason(meta["id"]) or "out of memory"
            meta.update(oom_kills=kills, detail=f"{reason} of {meta['cls']}: {kills} process(es) killed, "
                                                "the replica runs on")
            self._write(meta)

    def _delete_sandbox(self, meta: dict[str, Any]) -> None:
        try:
            self.runc.delete(meta["id"])
            meta.pop("sandbox_left", None)
        except (SandboxError, OSError) as exc:
            log.warning("could not delete sandbox %s (tried again later): %s", meta["id"], exc)
            meta["sandbox_left"] = True

    def _ready(self, meta: dict[str, Any]) -> bool:
        if meta["kind"] == WorkloadKind.NOTEBOOK.value:
            try:
                address = meta.get("address") or loopback.TENSORA_HOST  # none: recorded before replicas had their own
                r = httpx.get(f"http://{address}:{meta['port']}/api/status", timeout=PROBE_TIMEOUT_S,
                              headers={"Authorization": f"token {meta['token']}"})
            except httpx.HTTPError:
                return False
            return r.status_code == 200
        if meta["kind"] == WorkloadKind.VM.value:
            try:
                status = qmp(meta["socket"], {"execute": "query-status"}, timeout=PROBE_TIMEOUT_S)[0]
            except (OSError, ValueError):
                return False
            return bool(status.get("running"))
        try:  # an endpoint's model server (one that takes no key ignores it)
            key = replicakeys.derive(self.replica_secret, meta["id"])
            r = httpx.get(f"{meta['url']}/models", timeout=PROBE_TIMEOUT_S,
                          headers={"Authorization": f"Bearer {key}"})
        except httpx.HTTPError:
            return False
        return r.status_code == 200

    def _exit_code(self, meta: dict[str, Any]) -> int | None:
        """A process replica: None while the process lives; its exit code (or -1 if unknown) once it is gone."""
        proc = self._children.get(meta["id"])
        if proc is not None:
            return proc.poll()
        pid = meta["pid"]
        if pid is None:
            return -1
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return -1
        except PermissionError:
            pass
        if meta["proc_start"] is not None and _proc_start(pid) not in (None, meta["proc_start"]):
            return -1  # the pid was reused by another process
        if _proc_state(pid) == "Z":
            return -1  # exited; its parent (not this driver) has not reaped it yet
        return None

    def _signal(self, meta: dict[str, Any], sig: int) -> None:
        if meta.get("sandbox"):
            with contextlib.suppress(SandboxError):  # it may have ended meanwhile
                self.runc.kill(meta["id"], sig, all_processes=sig == signal.SIGKILL)
            return
        if meta["pid"] is None or self._exit_code(meta) is not None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(meta["pid"], sig)  # the replica leads its own session and group

    def _fail(self, meta: dict[str, Any], detail: str, permanent: bool = False) -> ReplicaStatus:
        meta.update(state="failed", detail=detail, ended_at=time.time(), permanent=permanent)
        self._write(meta)
        return self._status(meta)

    def _metas(self) -> list[dict[str, Any]]:
        metas = [self._read(d.name) for d in sorted(self.root.iterdir())]
        return [m for m in metas if m is not None]

    def _live_metas(self) -> list[dict[str, Any]]:
        return [m for m in self._metas() if m["state"] not in ENDED]

    def _read(self, replica_id: str) -> dict[str, Any] | None:
        try:
            data: dict[str, Any] = json.loads((self.root / replica_id / "replica.json").read_text())
            return data
        except (OSError, ValueError):
            return None

    def _write(self, meta: dict[str, Any]) -> None:
        """``replica.json``, 0600: it holds the notebook's token."""
        path = self.root / meta["id"] / "replica.json"
        tmp = path.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            os.fchmod(fd, 0o600)
            f.write(json.dumps(meta))
        os.replace(tmp, path)

    def _status(self, meta: dict[str, Any]) -> ReplicaStatus:
        return ReplicaStatus(meta["id"], meta["workload_id"], meta["cls"], meta["node"], ReplicaState(meta["state"]),
                             meta["url"], meta["detail"], meta.get("served_model"),
                             bool(meta.get("permanent")), meta["detail"] if meta.get("installing") else "")

    def access(self, replica_id: str) -> dict[str, Any]:
        """What a user needs to reach the replica (notebook URL, VM console and QMP socket)."""
        meta = self._read(replica_id) or {}
        return {k: meta.get(k) for k in ("url", "socket", "pid", "console")} | {
            "log": str(self.root / replica_id / "out.log")}


def _private_dir(path: Path) -> Path:
    """A dir only Tensora's user may enter (its files may hold secrets)."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    if path.stat().st_mode & 0o077:
        path.chmod(0o700)
    return path


def _release_netns_mount(bundle: Path) -> None:
    """Detach the bind mount that kept the sandbox's network namespace while runc joined it: the workload and
    pasta hold the namespace themselves from now on. Without it, a data dir whose sandboxes were not deleted
    (a test's leftovers, an operator's ``rm -rf``) cannot be removed at all (EBUSY). Deleting sandboxes
    (``Runc.delete``) is still the way to end them: pasta notices its namespace file gone only sometimes.
    (Belongs in ``tensora.sandbox.network``, next to the mount it releases.)"""
    subprocess.run(["umount", "-l", str(bundle / NETNS_FILE)], capture_output=True, check=False)


def _readable_by_others(path: Path, what: str) -> None:
    """LaunchError unless every file of ``path`` (a model, a disk image) is readable by any uid (the sandbox runs
    as the owner's, and owners' uploads are written 0644); names the first that is not, relative to ``path``,
    after ``what``."""
    paths = [path] if path.is_file() else [path, *sorted(path.rglob("*"))]
    for p in paths:
        mode = p.stat().st_mode
        need = 0o005 if p.is_dir() else 0o004
        if mode & need != need:
            name = p.relative_to(path) if p != path else path.name
            raise plan.LaunchError(f"{what} {name} is not readable by the sandbox (mode {mode & 0o777:o}, "
                                   "not readable by others)", permanent=True)


def _own(path: Path, uid: int, gid: int) -> None:
    """Give a regular file in a replica's dir to the owner's uid, 0600: opened without following a link and
    without blocking on a FIFO, so nothing planted there redirects the chown."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise plan.LaunchError(f"{path.name} in the VM's dir is not a regular file")
        os.fchown(fd, uid, gid)
        os.fchmod(fd, 0o600)
    finally:
        os.close(fd)


def _proc_start(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (Linux), to tell a reused pid apart."""
    try:
        line = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(line.rpartition(")")[2].split()[19])


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


def _proc_state(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return None


def _short_socket(d: Path) -> str:
    tag = hashlib.sha256(str(d.resolve()).encode()).hexdigest()[:16]
    return str(Path(tempfile.gettempdir()) / f"tensora-qmp-{tag}.sock")


def _which(name: str) -> str | None:
    return shutil.which(name)


def _importable(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None
