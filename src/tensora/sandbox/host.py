"""What this host offers a sandbox, measured: cgroup version, machine type, system dirs, device numbers, the
NVIDIA driver's user-space files.

``available()`` answers "can replicas be sandboxed here?" with None (yes) or the reason why not, in words
an operator can act on; ``tensora up`` shows it at start.
"""

from __future__ import annotations

import os
import platform
import resource
import shutil
import stat
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from tensora.sandbox.seccomp import ARCHITECTURES
from tensora.sandbox.spec import SYSTEM_DIRS, CgroupVersion, Device, HostFacts

CGROUP_ROOT = Path("/sys/fs/cgroup")
V1_CONTROLLERS = ("memory", "cpu", "pids", "devices")
V2_CONTROLLERS = ("memory", "cpu", "pids")

NVIDIA_LIBRARIES = (
    "libcuda.so", "libcudadebugger.so", "libnvidia-ml.so", "libnvidia-cfg.so", "libnvidia-ptxjitcompiler.so",
    "libnvidia-nvvm.so", "libnvidia-gpucomp.so", "libnvidia-allocator.so", "libnvidia-opencl.so",
    "libnvidia-pkcs11.so", "libnvidia-pkcs11-openssl3.so",
)
"""The driver's libraries a GPU replica gets (by name prefix): nvidia-container-toolkit's utility and compute sets."""
NVIDIA_BINARIES = ("nvidia-smi", "nvidia-debugdump", "nvidia-cuda-mps-control", "nvidia-cuda-mps-server")
NVIDIA_LIB_DIRS = ("/usr/local/nvidia/lib64", "/usr/local/nvidia/lib", "/usr/lib/x86_64-linux-gnu",
                   "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib64/nvidia",
                   "/usr/lib/x86_64-linux-gnu/nvidia/current", "/usr/lib/aarch64-linux-gnu/nvidia/current")
"""Where drivers put their libraries when ``ldconfig -p`` does not list them (the host finds them by
LD_LIBRARY_PATH, as CUDA images do with ``/usr/local/nvidia``)."""
NVIDIA_BIN_DIRS = ("/usr/local/nvidia/bin", "/usr/bin", "/usr/local/bin")
_LDCONFIG_ARCH = {"x86_64": "x86-64", "aarch64": "AArch64"}


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


@dataclass(frozen=True, slots=True)
class NvidiaDriver:
    """The host's NVIDIA user-space driver: each library and binary by the name programs ask for
    (``libcuda.so.1``), paired with the file that is on the host (links resolved)."""

    libraries: tuple[tuple[str, str], ...] = ()
    binaries: tuple[tuple[str, str], ...] = ()

    @property
    def cuda(self) -> bool:
        """Whether a CUDA program could start: ``libcuda.so.1`` is among the libraries."""
        return any(name == "libcuda.so.1" for name, _ in self.libraries)


def parse_ldconfig(text: str, arch: str) -> list[tuple[str, str]]:
    """The ``(name, path)`` rows of ``ldconfig -p`` for machine type ``arch`` (``x86_64``), in its order,
    which is the loader's: the first row of a name wins."""
    tag = _LDCONFIG_ARCH.get(arch, arch)
    rows = []
    for line in text.splitlines():
        left, sep, path = line.strip().partition(" => ")
        name, _, flags = left.partition(" (")
        if sep and tag in (f.strip() for f in flags.rstrip(")").split(",")):
            rows.append((name.strip(), path.strip()))
    return rows


def nvidia_driver(paths: Sequence[str | Path] = (), *, ldconfig: str | None = None, arch: str | None = None,
                  lib_dirs: Sequence[str | Path] = NVIDIA_LIB_DIRS,
                  bin_dirs: Sequence[str | Path] = NVIDIA_BIN_DIRS) -> NvidiaDriver:
    """The driver's files, found as nvidia-container-toolkit finds them: the libraries ``ldconfig -p`` lists
    (``ldconfig``: its output, else it is run), then those in ``lib_dirs``; the binaries in ``bin_dirs``.
    ``paths`` (the operator's ``node.nvidia_driver``) replaces the search: each a folder (searched for both)
    or a file. A name whose file is gone (a stale loader cache) is skipped."""
    libs: dict[str, str] = {}
    bins: dict[str, str] = {}
    if paths:
        lib_dirs = bin_dirs = [p for p in paths if Path(p).is_dir()]
        for p in (Path(p) for p in paths if not Path(p).is_dir()):
            _take(libs if p.name.startswith(NVIDIA_LIBRARIES) else bins, p.name, p)
    else:
        if ldconfig is None:
            ldconfig = _run_ldconfig()
        for name, path in parse_ldconfig(ldconfig, arch or platform.machine()):
            if name.startswith(NVIDIA_LIBRARIES):
                _take(libs, name, Path(path))
    for d in map(Path, lib_dirs):
        for p in sorted(d.glob("lib*.so*")) if d.is_dir() else ():
            if p.name.startswith(NVIDIA_LIBRARIES):
                _take(libs, p.name, p)
    for d in map(Path, bin_dirs):
        for name in NVIDIA_BINARIES:
            _take(bins, name, d / name)
    return NvidiaDriver(tuple(sorted(libs.items())), tuple(sorted(bins.items())))


def _take(found: dict[str, str], name: str, path: Path) -> None:
    if name not in found and path.is_file():  # is_file follows links: a dangling one is no file
        found[name] = str(path.resolve())


def _run_ldconfig() -> str:
    for ldconfig in ("ldconfig", "/sbin/ldconfig", "/usr/sbin/ldconfig"):
        try:
            return subprocess.run([ldconfig, "-p"], capture_output=True, text=True, timeout=10, check=False).stdout
        except (OSError, subprocess.SubprocessError):
            continue
    return ""
