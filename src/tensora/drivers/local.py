"""The local driver: replicas as child processes on this machine.

Each replica is a process in a session of its own (so it outlives ``tensora up``) with a
directory ``DATA_DIR/replicas/<id>/`` holding ``replica.json`` (what it is, its pid, port,
token) and its log. The directory is the driver's whole state: a new driver on the same
data dir adopts the replicas still running and reports the ones that died as failed.

* notebook: JupyterLab on 127.0.0.1 and a free port, with a token; ready when
  ``/api/status`` answers. Its files are in ``DATA_DIR/workdirs/<workload id>/``, kept across
  the workload's restarts and removed by ``release`` once it is deleted. GPU placement sets
  ``CUDA_VISIBLE_DEVICES`` to its GPUs; CPU placement hides them all.
* vm: QEMU with QMP on a unix socket; KVM when ``/dev/kvm`` opens, else TCG; an optional
  disk image; ready when QMP ``query-status`` says running. Stop = ``system_powerdown``,
  then ``quit``, then SIGKILL.
* endpoint: a model server from the runtime registry (``runtimes``) on 127.0.0.1 and a free
  port; ready when ``/v1/models`` answers. Without an installed runtime the replica fails
  with a reason that says which to install.

Stop is graceful first (SIGTERM to the process group, or QMP), then SIGKILL after a deadline;
``observe`` does the escalation, so nothing here blocks the controller.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx

from tensora import runtimes
from tensora.admission import WorkloadKind
from tensora.capacity import Node
from tensora.catalog import Catalog
from tensora.drivers.base import ReplicaSpec, ReplicaState, ReplicaStatus

STOP_GRACE_S = 10.0
VM_POWERDOWN_S = 3.0
PROBE_TIMEOUT_S = 0.5
FORGET_STOPPED_S = 3600.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def kvm_usable() -> bool:
    try:
        fd = os.open("/dev/kvm", os.O_RDWR)
    except OSError:
        return False
    os.close(fd)
    return True


def qmp(path: str, *commands: dict[str, Any], timeout: float = 2.0) -> list[Any]:
    """Run QMP commands on a VM's socket; their ``return`` values (an error raises OSError)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
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


class LocalDriver:
    """Child processes on this machine, one node (this machine's, from ``hardware``)."""

    def __init__(self, data_dir: Path, node: Node, catalog: Catalog, gpu_indices: Sequence[int] = (),
                 runtimes_dir: Path | None = None, vfio: Mapping[int, str] | None = None,
                 sysfs: Path = Path("/sys"), devfs: Path = Path("/dev")) -> None:
        self.runtimes = runtimes_dir or runtimes.runtimes_dir(Path(data_dir))
        self.root = Path(data_dir) / "replicas"
        self.root.mkdir(parents=True, exist_ok=True)
        self.work = Path(data_dir) / "workdirs"
        self.node = node
        self.catalog = catalog
        self.vfio = dict(vfio or {})  # GPU index -> PCI address bound to vfio-pci (VM passthrough)
        self.gpu_indices = sorted(set(gpu_indices) | set(self.vfio))
        self.sysfs, self.devfs = sysfs, devfs
        self._children: dict[str, subprocess.Popen[bytes]] = {}

    # -- the driver protocol -------------------------------------------------------------

    def nodes(self) -> Sequence[Node]:
        return [self.node]

    def start(self, spec: ReplicaSpec) -> ReplicaStatus:
        meta = self._read(spec.id)
        if meta is not None and meta["state"] not in ("stopped", "failed"):
            return self._status(meta)
        d = self.root / spec.id
        d.mkdir(parents=True, exist_ok=True)
        meta = {"id": spec.id, "workload_id": spec.workload_id, "kind": spec.kind.value, "cls": spec.cls,
                "node": spec.node, "model": spec.model, "image": spec.image, "state": "starting", "pid": None,
                "proc_start": None, "port": None, "token": None, "url": None, "socket": None, "detail": "",
                "started_at": time.time(), "stop_requested_at": None, "ended_at": None, "gpus": []}
        try:
            cmd, env, cwd = self._command(spec, meta)
        except RuntimeError as exc:
            meta.update(state="failed", detail=str(exc), ended_at=time.time())
            self._write(meta)
            return self._status(meta)
        log = (d / "out.log").open("ab")
        try:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                    cwd=cwd, start_new_session=True)
        except OSError as exc:
            meta.update(state="failed", detail=f"could not start {cmd[0]}: {exc}", ended_at=time.time())
            self._write(meta)
            return self._status(meta)
        finally:
            log.close()
        self._children[spec.id] = proc
        meta.update(pid=proc.pid, proc_start=_proc_start(proc.pid))
        self._write(meta)
        return self._status(meta)

    def stop(self, replica_id: str) -> ReplicaStatus:
        meta = self._read(replica_id)
        if meta is None:
            raise KeyError(replica_id)
        if meta["state"] in ("stopped", "failed"):
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
        """Remove a deleted notebook's working dir (kept across its restarts until now)."""
        if not re.fullmatch(r"[A-Za-z0-9_]+", workload_id):  # an id, never a path
            raise ValueError(f"not a workload id: {workload_id!r}")
        shutil.rmtree(self.work / workload_id, ignore_errors=True)

    def observe(self) -> Sequence[ReplicaStatus]:
        out = []
        now = time.time()
        for d in sorted(self.root.iterdir()):
            meta = self._read(d.name)
            if meta is None:
                continue
            if meta["state"] in ("stopped", "failed"):
                child = self._children.get(meta["id"])
                if child is not None and child.poll() is not None:  # reap it (another driver stopped it)
                    del self._children[meta["id"]]
                if now - (meta["ended_at"] or now) < FORGET_STOPPED_S:
                    out.append(self._status(meta))
                continue
            self._refresh(meta, now)
            out.append(self._status(meta))
        return out

    # -- commands ------------------------------------------------------------------------

    def _command(self, spec: ReplicaSpec, meta: dict[str, Any]) -> tuple[list[str], dict[str, str], str]:
        cls = self.catalog[spec.cls]
        gpus = self._claim_gpus(cls.gpu_count) if not cls.is_cpu else []
        meta["gpus"] = gpus
        env = dict(os.environ)
        # CPU placement hides every GPU; GPU placement shows only its own
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in gpus)
        threads = str(max(1, int(cls.cpu)))
        env.update(OMP_NUM_THREADS=threads, MKL_NUM_THREADS=threads)
        d = self.root / spec.id
        if spec.kind is WorkloadKind.NOTEBOOK:
            port, token = free_port(), secrets.token_urlsafe(24)
            work = self.work / spec.workload_id
            work.mkdir(parents=True, exist_ok=True)
            for name in ("config", "data", "runtime"):
                (d / "jupyter" / name).mkdir(parents=True, exist_ok=True)
            env.update(JUPYTER_CONFIG_DIR=str(d / "jupyter/config"), JUPYTER_DATA_DIR=str(d / "jupyter/data"),
                       JUPYTER_RUNTIME_DIR=str(d / "jupyter/runtime"))
            cmd = [sys.executable, "-m", "jupyterlab", "--no-browser", "--ServerApp.ip=127.0.0.1",
                   f"--ServerApp.port={port}", "--ServerApp.port_retries=0",
                   f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={work}"]
            if os.geteuid() == 0:
                cmd.append("--allow-root")
            if not _importable("jupyterlab"):
                raise RuntimeError("JupyterLab is not installed: pip install 'tensora[notebook]'")
            meta.update(port=port, token=token, url=f"http://127.0.0.1:{port}/lab?token={token}")
            return cmd, env, str(work)
        if spec.kind is WorkloadKind.VM:
            qemu = _which("qemu-system-x86_64")
            if qemu is None:
                raise RuntimeError("QEMU is not installed: apt-get install qemu-system-x86")
            passthrough = [a for g in gpus for a in ("-device", f"vfio-pci,host={self._vfio_address(g)}")]
            sock = _short_socket(d)
            accel = "kvm" if kvm_usable() else "tcg"
            memory_mib = max(64, cls.memory // 2**20)
            cmd = [qemu, "-name", f"tensora-{spec.id}", "-machine", "q35", "-accel", accel,
                   "-m", str(memory_mib), "-smp", str(max(1, int(cls.cpu))), "-nodefaults", "-no-user-config",
                   "-display", "none", "-serial", f"file:{d / 'console.log'}",
                   "-qmp", f"unix:{sock},server=on,wait=off", *passthrough]
            if passthrough and accel != "kvm":
                raise RuntimeError("GPU passthrough needs KVM (/dev/kvm), which this host does not offer")
            if spec.image:
                if not Path(spec.image).is_file():
                    raise RuntimeError(f"the disk image {spec.image} does not exist")
                cmd += ["-drive", f"file={spec.image},if=virtio"]
            meta.update(socket=sock, url=f"qmp+unix://{sock}", detail=f"accel {accel}")
            return cmd, env, str(d)
        return self._endpoint(spec, cls, meta, env)

    def _endpoint(self, spec: ReplicaSpec, cls: Any, meta: dict[str, Any],
                  env: dict[str, str]) -> tuple[list[str], dict[str, str], str]:
        kind = "metal" if (cls.gpu_model or "").upper().endswith("METAL") else ("cpu" if cls.is_cpu else "gpu")
        runtime = runtimes.choose(self.runtimes, kind)
        if runtime is None:
            raise RuntimeError(f"no model runtime is installed for {kind} endpoints in {self.runtimes}: "
                               "tensora runtime install tensora-transformers")
        if not spec.model:
            raise RuntimeError("an endpoint needs a model")
        port = free_port()
        device = {"cpu": "cpu", "metal": "mps", "gpu": "cuda"}[kind]
        env = runtimes.clean_env(env) | runtime.env
        meta.update(port=port, url=f"http://127.0.0.1:{port}/v1", runtime=runtime.name,
                    served_model=spec.model,
                    detail=f"runtime {runtime.name}")
        d = self.root / spec.id
        return runtimes.command(runtime, self.runtimes, spec.model, spec.workload_id, port, device), env, str(d)

    def _vfio_address(self, gpu: int) -> str:
        """The PCI address of GPU ``gpu`` for ``-device vfio-pci``, checked: bound to vfio-pci, its
        IOMMU group open to QEMU. Otherwise the reason a user needs to fix it."""
        addr = self.vfio.get(gpu)
        if addr is None:
            raise RuntimeError(f"GPU {gpu} is not set up for VM passthrough: bind it to vfio-pci and declare "
                               f"node.vfio {{{gpu}: <PCI address>}}")
        dev = self.sysfs / "bus" / "pci" / "devices" / addr
        if not dev.exists():
            raise RuntimeError(f"GPU {gpu}: no PCI device {addr} on this host (node.vfio)")
        driver = (dev / "driver").resolve().name if (dev / "driver").exists() else "no driver"
        if driver != "vfio-pci":
            raise RuntimeError(f"GPU {gpu} at {addr} is bound to {driver}, not vfio-pci: the VM cannot take it")
        group = (dev / "iommu_group").resolve().name if (dev / "iommu_group").exists() else None
        if group is None or not (self.devfs / "vfio" / group).exists():
            raise RuntimeError(f"GPU {gpu} at {addr}: its IOMMU group is not open to QEMU (/dev/vfio/{group}); "
                               "enable the IOMMU (intel_iommu=on / amd_iommu=on)")
        return addr

    def _claim_gpus(self, count: int) -> list[int]:
        taken = {g for m in self._live_metas() for g in m.get("gpus", [])}
        free = [g for g in self.gpu_indices if g not in taken]
        if len(free) < count:
            raise RuntimeError(f"{count} GPU(s) needed, {len(free)} free on this machine")
        return free[:count]

    def _live_metas(self) -> list[dict[str, Any]]:
        metas = [self._read(d.name) for d in self.root.iterdir()]
        return [m for m in metas if m is not None and m["state"] not in ("stopped", "failed")]

    # -- state ---------------------------------------------------------------------------

    def _refresh(self, meta: dict[str, Any], now: float) -> None:
        exit_code = self._exit_code(meta)
        if exit_code is not None:
            stopped = meta["stop_requested_at"] is not None
            detail = "stopped" if stopped else (
                f"exited with code {exit_code}" if exit_code >= 0 else "the process is gone")
            if not stopped:
                detail += f"; see {self.root / meta['id'] / 'out.log'}"
            meta.update(state="stopped" if stopped else "failed", detail=detail, ended_at=now)
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
        if meta["state"] == "starting" and self._ready(meta):
            meta["state"] = "running"
            self._write(meta)

    def _ready(self, meta: dict[str, Any]) -> bool:
        if meta["kind"] == WorkloadKind.NOTEBOOK.value:
            try:
                r = httpx.get(f"http://127.0.0.1:{meta['port']}/api/status", timeout=PROBE_TIMEOUT_S,
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
        try:  # an endpoint's model server
            r = httpx.get(f"{meta['url']}/models", timeout=PROBE_TIMEOUT_S)
        except httpx.HTTPError:
            return False
        return r.status_code == 200

    def _exit_code(self, meta: dict[str, Any]) -> int | None:
        """None while the process lives; its exit code (or -1 if unknown) once it is gone."""
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
        if meta["pid"] is None or self._exit_code(meta) is not None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(meta["pid"], sig)  # the replica leads its own session and group

    def _read(self, replica_id: str) -> dict[str, Any] | None:
        try:
            data: dict[str, Any] = json.loads((self.root / replica_id / "replica.json").read_text())
            return data
        except (OSError, ValueError):
            return None

    def _write(self, meta: dict[str, Any]) -> None:
        path = self.root / meta["id"] / "replica.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(meta))
        os.replace(tmp, path)

    def _status(self, meta: dict[str, Any]) -> ReplicaStatus:
        return ReplicaStatus(meta["id"], meta["workload_id"], meta["cls"], meta["node"], ReplicaState(meta["state"]),
                             meta["url"], meta["detail"])

    def access(self, replica_id: str) -> dict[str, Any]:
        """What a user needs to reach the replica (notebook URL, VM console and QMP socket)."""
        meta = self._read(replica_id) or {}
        return {k: meta.get(k) for k in ("url", "socket", "pid")} | {
            "log": str(self.root / replica_id / "out.log"),
            "console": str(self.root / replica_id / "console.log") if meta.get("kind") == "vm" else None}


def _proc_start(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (Linux), to tell a reused pid apart."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rpartition(")")[2].split()[19])


def _proc_state(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return None


def _short_socket(d: Path) -> str:
    tag = hashlib.sha256(str(d.resolve()).encode()).hexdigest()[:16]
    return str(Path(tempfile.gettempdir()) / f"tensora-qmp-{tag}.sock")


def _which(name: str) -> str | None:
    import shutil

    return shutil.which(name)


def _importable(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None
