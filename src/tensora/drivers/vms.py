"""A VM replica of the local driver: QEMU, its QMP socket, its console and its disk.

QEMU runs with QMP on a unix socket in the VM's dir (shared with the host); KVM when ``/dev/kvm`` opens, else
TCG; ready when QMP ``query-status`` says running. Stop = ``system_powerdown``, then ``quit``, then (the
driver's) SIGKILL. An optional disk image is checked by ``drivers.vmdisk`` inside the root that holds it (an
owner's files or a shared root) before anything opens it; the guest writes only to an overlay,
``replicas/<id>/vm/disk.qcow2`` (the owner's uid, 0600), kept when the same replica starts again and removed by
``release`` once the workload is deleted. GPUs are passed through by VFIO.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import stat
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

from tensora.drivers import launch, vmdisk
from tensora.drivers.base import ReplicaSpec
from tensora.drivers.launch import DISK, VM_DIR, Launch, LaunchError
from tensora.drivers.launcher import PROBE_TIMEOUT_S, LogFile, private_dir, readable_by_others
from tensora.drivers.qmp import qmp
from tensora.drivers.record import Records, ReplicaRecord
from tensora.drivers.vmdisk import ImageRefused
from tensora.placement.catalog import ComputeClass
from tensora.storage import owner_dir

VM_POWERDOWN_S = 3.0
"""How long a VM has to power down (``system_powerdown``) before QMP ``quit`` ends it."""


def kvm_usable() -> bool:
    try:
        fd = os.open("/dev/kvm", os.O_RDWR)
    except OSError:
        return False
    os.close(fd)
    return True


def overlay_path(replica_dir: Path) -> Path:
    """A VM replica's disk overlay: what its guest wrote."""
    return replica_dir / "vm" / DISK


class VmLauncher:
    """QEMU for a VM replica. ``files_root`` and ``shared_models`` are owners' storage and the operator's shared
    roots (as ``tensora.storage`` has them): the only places a VM's disk and its backing files may be. ``vfio``
    maps a GPU index to the PCI address bound to vfio-pci; ``sysfs`` and ``devfs`` are the host's (tests')."""

    def __init__(self, records: Records, files_root: Path, shared_models: Mapping[str, Path],
                 vfio: Mapping[int, str], sysfs: Path, devfs: Path) -> None:
        self.records = records
        self.files_root = files_root
        self.shared_models = dict(shared_models)
        self.vfio = dict(vfio)
        self.sysfs, self.devfs = sysfs, devfs

    def launch(self, spec: ReplicaSpec, record: ReplicaRecord, cls: ComputeClass) -> Launch:
        sandboxed = record.sandbox
        qemu = shutil.which("qemu-system-x86_64")
        if qemu is None:
            raise LaunchError("QEMU is not installed: apt-get install qemu-system-x86", permanent=True)
        vfio = [self._vfio(g) for g in record.gpus]
        accel = "kvm" if kvm_usable() else "tcg"
        if vfio and accel != "kvm":
            raise LaunchError("GPU passthrough needs KVM (/dev/kvm), which this host does not offer", permanent=True)
        vm_dir = private_dir(self.records.dir(spec.id)) / "vm"
        vm_dir.mkdir(mode=0o700, exist_ok=True)
        # the disk first: checked before anything opens it, its overlay made, or the replica fails here
        disk = self._disk(spec, cls, vm_dir, sandboxed) if spec.image else None
        if sandboxed:  # QEMU (the owner's uid) makes its socket and console here; the host reaches them
            assert spec.uid is not None and spec.gid is not None
            os.chown(vm_dir, spec.uid, spec.gid)
            host_socket, inner_socket = str(vm_dir / "qmp.sock"), f"{VM_DIR}/qmp.sock"
        else:
            host_socket = inner_socket = _short_socket(self.records.dir(spec.id))
        launched = launch.vm(qemu, spec.id, cls, accel, [a for a, _ in vfio], vm_dir, inner_socket, disk,
                             sandboxed=sandboxed, vfio_groups=[g for _, g in vfio])
        # no url: its socket is a host path, which its owner is never shown
        record.socket, record.url, record.detail = host_socket, None, f"accel {accel}"
        record.console = str(vm_dir / "console.log")
        return launched

    def ready(self, record: ReplicaRecord) -> bool:
        try:
            status = qmp(record.socket or "", {"execute": "query-status"}, timeout=PROBE_TIMEOUT_S)[0]
        except (OSError, ValueError):
            return False
        return bool(status.get("running"))

    def ask_to_stop(self, record: ReplicaRecord) -> bool:
        """ACPI power-down: the guest's OS shuts down (a VM without a socket yet is signalled)."""
        if not record.socket:
            return False
        with contextlib.suppress(OSError, ValueError):
            qmp(record.socket, {"execute": "system_powerdown"})
        return True

    def urge_to_stop(self, record: ReplicaRecord, waited: float) -> None:
        """QEMU quits once the guest had ``VM_POWERDOWN_S`` to power down."""
        if waited > VM_POWERDOWN_S and record.socket:
            with contextlib.suppress(OSError, ValueError):
                qmp(record.socket, {"execute": "quit"})

    def logs(self, record: ReplicaRecord) -> Sequence[LogFile]:
        d = self.records.dir(record.id)
        return (LogFile(d / "vm" / "console.log", d / "console.log.1"),)

    def over_bound(self, record: ReplicaRecord, now: float) -> str | None:
        return None

    def release(self, workload_id: str, ended: Sequence[ReplicaRecord]) -> None:
        """The disk overlays of its ended replicas (what their guests wrote)."""
        for record in ended:
            with contextlib.suppress(FileNotFoundError):
                overlay_path(self.records.dir(record.id)).unlink()

    def _disk(self, spec: ReplicaSpec, cls: ComputeClass, vm_dir: Path, sandboxed: bool) -> vmdisk.ImageInfo:
        """The VM's disk: the owner's image and its backing chain checked inside the root that holds it
        (``vmdisk.inspect``, which opens nothing outside it), then its overlay in the VM dir, the owner's
        (``vmdisk.overlay``: an existing one is kept). ImageRefused or LaunchError say why not."""
        assert spec.image is not None
        image = Path(spec.image)
        roots = [owner_dir(self.files_root, spec.owner), *self.shared_models.values()]
        root = launch.image_root(image.resolve(), [r.resolve() for r in roots])
        if root is None:  # a row from before owners' files, or a path the server never resolved
            raise ImageRefused(image.name, "not in your files")
        info = vmdisk.inspect(image, root, vmdisk.DiskCap(cls.disk, f"class {cls.name}"))
        if sandboxed:  # each file is bound alone into the sandbox: its own mode decides
            for layer in info.chain:
                readable_by_others(layer.path, "the disk image")
        overlay = vmdisk.overlay(info, vm_dir / DISK)
        if sandboxed:
            assert spec.uid is not None and spec.gid is not None
            _own(overlay, spec.uid, spec.gid)
        return info

    def _vfio(self, gpu: int) -> tuple[str, str]:
        """The PCI address of GPU ``gpu`` for ``-device vfio-pci`` and its IOMMU group, checked: bound to
        vfio-pci, its group open to QEMU. Otherwise the reason a user needs to fix it."""
        addr = self.vfio.get(gpu)
        if addr is None:
            raise LaunchError(f"GPU {gpu} is not set up for VM passthrough: bind it to vfio-pci and declare "
                              f"node.vfio {{{gpu}: <PCI address>}}")
        dev = self.sysfs / "bus" / "pci" / "devices" / addr
        if not dev.exists():
            raise LaunchError(f"GPU {gpu}: no PCI device {addr} on this host (node.vfio)")
        driver = (dev / "driver").resolve().name if (dev / "driver").exists() else "no driver"
        if driver != "vfio-pci":
            raise LaunchError(f"GPU {gpu} at {addr} is bound to {driver}, not vfio-pci: the VM cannot take it")
        group = (dev / "iommu_group").resolve().name if (dev / "iommu_group").exists() else None
        if group is None or not (self.devfs / "vfio" / group).exists():
            raise LaunchError(f"GPU {gpu} at {addr}: its IOMMU group is not open to QEMU "
                              f"(/dev/vfio/{group}); enable the IOMMU (intel_iommu=on / amd_iommu=on)")
        return addr, group


def _own(path: Path, uid: int, gid: int) -> None:
    """Give a regular file in a replica's dir to the owner's uid, 0600: opened without following a link and
    without blocking on a FIFO, so nothing planted there redirects the chown."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise LaunchError(f"{path.name} in the VM's dir is not a regular file")
        os.fchown(fd, uid, gid)
        os.fchmod(fd, 0o600)
    finally:
        os.close(fd)


def _short_socket(d: Path) -> str:
    """A QMP socket for an unsandboxed VM: in the temp dir, its name drawn from the replica's dir (a socket's
    path is short)."""
    tag = hashlib.sha256(str(d.resolve()).encode()).hexdigest()[:16]
    return str(Path(tempfile.gettempdir()) / f"tensora-qmp-{tag}.sock")
