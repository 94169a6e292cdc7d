"""What this host offers a sandbox, measured: cgroup version, machine type, system dirs, device numbers.

``available()`` answers "can replicas be sandboxed here?" with None (yes) or the reason why not, in words
an operator can act on; ``tensora up`` shows it at start.
"""

from __future__ import annotations

import os
import platform
import resource
import shutil
import stat
import sys
from pathlib import Path

from tensora.sandbox.seccomp import ARCHITECTURES
from tensora.sandbox.spec import SYSTEM_DIRS, CgroupVersion, Device, HostFacts

CGROUP_ROOT = Path("/sys/fs/cgroup")
V1_CONTROLLERS = ("memory", "cpu", "pids", "devices")
V2_CONTROLLERS = ("memory", "cpu", "pids")


def cgroup_version(root: Path = CGROUP_ROOT) -> CgroupVersion:
    """V2 when ``root`` is the unified hierarchy; V1 otherwise, which includes a hybrid host
    (v1 controllers plus an empty cgroup2 at ``root/unified``), where runc drives the v1 controllers."""
    return CgroupVersion.V2 if (root / "cgroup.controllers").is_file() else CgroupVersion.V1


def detect_host(root: Path = CGROUP_ROOT, fs_root: Path = Path("/")) -> HostFacts:
    """The facts ``oci_config`` renders from, measured on this host."""
    version = cgroup_version(root)
    dirs: list[tuple[str, str]] = []
    for target in SYSTEM_DIRS:
        path = fs_root / target.lstrip("/")
        if not path.exists():
            continue
        # a merged-usr symlink (/lib -> usr/lib) is bound from where it points
        dirs.append((target, "/" + str(path.resolve().relative_to(fs_root.resolve()))))
    swap = version is CgroupVersion.V2 or (root / "memory" / "memory.memsw.limit_in_bytes").exists()
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    return HostFacts(cgroup=version, arch=platform.machine(), system_dirs=tuple(dirs), swap_limit=swap,
                     nofile_max=hard if hard != resource.RLIM_INFINITY else 1 << 20)


def memory_cgroup_dir(sandbox_id: str, version: CgroupVersion, root: Path = CGROUP_ROOT) -> Path:
    """Where a sandbox's memory cgroup lives (its ``cgroupsPath`` is ``/tensora/<id>``)."""
    base = root if version is CgroupVersion.V2 else root / "memory"
    return base / "tensora" / sandbox_id


def host_device(path: str) -> Device:
    """The :class:`Device` for a host character device (``/dev/nvidia0``, ``/dev/kvm``); OSError if absent."""
    st = os.stat(path)
    if not stat.S_ISCHR(st.st_mode):
        raise OSError(f"{path} is not a character device")
    return Device(path=path, major=os.major(st.st_rdev), minor=os.minor(st.st_rdev))


def missing_controllers(version: CgroupVersion, root: Path = CGROUP_ROOT) -> list[str]:
    """The controllers a sandbox needs that this host's cgroups lack."""
    if version is CgroupVersion.V2:
        try:
            have = set((root / "cgroup.controllers").read_text().split())
        except OSError:
            have = set()
        return [c for c in V2_CONTROLLERS if c not in have]
    return [c for c in V1_CONTROLLERS if not (root / c / "cgroup.procs").exists()]


def available(runtime: str = "runc", root: Path = CGROUP_ROOT) -> str | None:
    """None when replicas can be sandboxed here with ``runtime``; else why not."""
    if sys.platform != "linux":
        return f"sandboxes need Linux (this is {sys.platform})"
    if platform.machine() not in ARCHITECTURES:
        return f"no seccomp profile for {platform.machine()} (only {', '.join(ARCHITECTURES)})"
    if os.geteuid() != 0:
        return "sandboxes need Tensora to run as root (rootless runc is not supported)"
    if shutil.which(runtime) is None:
        return f"no {runtime} on PATH (Debian: apt-get install {runtime})"
    version = cgroup_version(root)
    if runtime.endswith("crun") and version is CgroupVersion.V1:
        return "crun needs cgroup v2 (this host has v1 or hybrid cgroups): use runc"
    missing = missing_controllers(version, root)
    if missing:
        return f"no usable cgroup {version} controllers: {', '.join(missing)} missing"
    for tool, package in (("pasta", "passt"), ("unshare", "util-linux")):
        if shutil.which(tool) is None:
            return f"no {tool} on PATH for the sandbox's network (Debian: apt-get install {package})"
    return None
