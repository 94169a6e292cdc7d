"""What a replica's sandbox is, as values, and the OCI runtime config that says it to runc.

Pure: no I/O. ``oci_config(spec, host)`` renders a :class:`SandboxSpec` (identity, argv, env, mounts,
limits, devices, ports) into the ``config.json`` of an OCI bundle, for a host described by
:class:`HostFacts` (which ``host.detect_host()`` measures). What the config grants, and nothing more:

- the process runs as ``spec.uid:spec.gid`` (never 0), no supplementary groups, no capabilities in any set,
  ``noNewPrivileges``, the seccomp profile of :mod:`tensora.sandbox.seccomp`;
- ``/`` is an empty read-only dir; the host's system dirs (``/usr``, ``/etc``, ``/bin``, ``/lib``...) are
  bound read-only, nosuid, nodev; ``/tmp`` and ``/dev/shm`` are private tmpfs (size-limited, charged to the
  memory limit); then ``spec.mounts`` (the workload's home read-write, the model and the runtime's venv
  read-only). Nothing else of the host, so nothing of Tensora's data dir;
- its own pid, ipc, uts, mount, cgroup and network namespaces;
- cgroup limits: memory (= memory + swap, so no swap), CPU quota, cpuset, pids; a device allow-list of the
  standard character devices plus ``spec.devices`` (a GPU class's ``/dev/nvidiaN`` and control devices,
  a VM's ``/dev/kvm``); a CPU class names none, so it sees no GPU at all.
"""

from __future__ import annotations

import ipaddress
import posixpath
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from tensora.sandbox.seccomp import seccomp_profile

CPU_PERIOD_US = 100_000
"""The CFS period; the quota is ``cpus * CPU_PERIOD_US``."""

SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc")
"""Host dirs bound read-only into every sandbox, those the host has (``HostFacts.system_dirs``)."""

RESERVED_TARGETS = ("/", "/proc", "/dev", "/sys", "/tmp", *SYSTEM_DIRS)
"""Where a caller's mount may not go, nor below: the sandbox provides these itself."""

_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")

# runc's own defaults (``runc spec``) plus Docker's powercap mask (RAPL energy counters leak other tenants' work)
MASKED_PATHS = (
    "/proc/acpi", "/proc/asound", "/proc/kcore", "/proc/keys", "/proc/latency_stats", "/proc/timer_list",
    "/proc/timer_stats", "/proc/sched_debug", "/proc/scsi", "/sys/firmware", "/sys/devices/virtual/powercap",
)
READONLY_PATHS = ("/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys", "/proc/sysrq-trigger")


class CgroupVersion(StrEnum):
    """Which cgroup hierarchy runc drives: v1 (also a hybrid host's) or the unified v2."""

    V1 = "v1"
    V2 = "v2"


@dataclass(frozen=True, slots=True)
class HostFacts:
    """What ``oci_config`` needs to know of the host; measured once by ``host.detect_host()``.

    ``system_dirs`` pairs each sandbox path with the host path bound there: ``("/lib", "/usr/lib")`` on a
    merged-usr host where ``/lib`` is a symlink. ``swap_limit`` is whether the memory+swap limit can be
    set (v1 ``memory.memsw.*`` exists; runc fails otherwise); on v2 runc handles a missing swap file itself.
    ``nofile_max`` is the highest open-files limit runc may set (Tensora's own hard limit: raising past it
    needs CAP_SYS_RESOURCE, which some hosts' root lacks).
    """

    cgroup: CgroupVersion
    arch: str
    system_dirs: tuple[tuple[str, str], ...]
    swap_limit: bool = True
    nofile_max: int = 1 << 20


@dataclass(frozen=True, slots=True)
class Mount:
    """A host path bound into the sandbox: read-only unless ``writable``; always nosuid and nodev."""

    source: str
    target: str
    writable: bool = False


@dataclass(frozen=True, slots=True)
class Device:
    """A character device node created in the sandbox's ``/dev`` and allowed by its device cgroup."""

    path: str
    major: int
    minor: int
    type: str = "c"
    file_mode: int = 0o666


@dataclass(frozen=True, slots=True)
class Limits:
    """The placed class as cgroup limits. ``cpuset`` such as ``"2-5"`` when the node pins cores.

    ``tmp_bytes`` sizes ``/tmp`` and ``/dev/shm`` (tmpfs pages count against ``memory_bytes`` too).
    """

    cpus: float
    memory_bytes: int
    pids: int = 4096
    cpuset: str | None = None
    nofile: int = 65536
    tmp_bytes: int = 1 << 30


@dataclass(frozen=True, slots=True)
class SandboxSpec:
    """One replica's sandbox.

    ``env`` is the whole environment (the caller builds it from scratch: PATH, HOME, LANG, the runtime's own
    variables, CUDA_VISIBLE_DEVICES); nothing of Tensora's is inherited. ``publish`` pairs a host port on
    ``publish_address`` (a loopback address: the replica's own) with the sandbox port it reaches;
    ``allow_host_ports`` pairs a port of the sandbox's 127.0.0.1 with the host loopback port it reaches
    (Tensora's API and gateway, on their sandbox listeners): every other host loopback service stays unreachable.
    """

    id: str
    argv: tuple[str, ...]
    uid: int
    gid: int
    limits: Limits
    env: Mapping[str, str] = field(default_factory=dict)
    cwd: str = "/"
    mounts: tuple[Mount, ...] = ()
    devices: tuple[Device, ...] = ()
    publish: tuple[tuple[int, int], ...] = ()
    allow_host_ports: tuple[tuple[int, int], ...] = ()
    hostname: str = "sandbox"
    publish_address: str = "127.0.0.1"


# the character devices every sandbox has (the OCI runtime's defaults): (path, major, minor)
STANDARD_DEVICES = (
    ("/dev/null", 1, 3), ("/dev/zero", 1, 5), ("/dev/full", 1, 7), ("/dev/random", 1, 8),
    ("/dev/urandom", 1, 9), ("/dev/tty", 5, 0),
)


def validate(spec: SandboxSpec) -> None:
    """Raise ValueError naming the first field that would weaken the sandbox or that runc would refuse."""
    if not _ID.fullmatch(spec.id):
        raise ValueError(f"id: {spec.id!r} is not [A-Za-z0-9][A-Za-z0-9_.-]*, at most 128 characters")
    if spec.uid <= 0 or spec.gid <= 0:
        raise ValueError(f"uid/gid: a sandbox never runs as root or group 0, got {spec.uid}:{spec.gid}")
    if not spec.argv:
        raise ValueError("argv: empty")
    for name, value in spec.env.items():
        if not _ENV_NAME.fullmatch(name) or "\0" in value:
            raise ValueError(f"env: {name!r} is not a valid variable")
    _absolute("cwd", spec.cwd)
    limits = spec.limits
    if not limits.cpus > 0:
        raise ValueError(f"limits.cpus: must be > 0, got {limits.cpus}")
    if limits.memory_bytes < (8 << 20):
        raise ValueError(f"limits.memory_bytes: at least 8 MiB, got {limits.memory_bytes}")
    if limits.pids < 1 or limits.nofile < 64 or limits.tmp_bytes < (1 << 20):
        raise ValueError("limits: pids >= 1, nofile >= 64, tmp_bytes >= 1 MiB")
    if limits.cpuset is not None and not re.fullmatch(r"\d+(-\d+)?(,\d+(-\d+)?)*", limits.cpuset):
        raise ValueError(f"limits.cpuset: {limits.cpuset!r} is not a cpu list such as 0-3,6")
    targets = set()
    for m in spec.mounts:
        _absolute("mounts.source", m.source)
        target = _absolute("mounts.target", m.target)
        if any(target == r or (r != "/" and target.startswith(r + "/")) for r in RESERVED_TARGETS):
            raise ValueError(f"mounts.target: {target} is or is inside a dir the sandbox itself provides")
        if target in targets:
            raise ValueError(f"mounts.target: {target} twice")
        targets.add(target)
    for d in spec.devices:
        if d.type != "c" or not d.path.startswith("/dev/") or _absolute("devices.path", d.path) != d.path:
            raise ValueError(f"devices: {d.path} must be a character device under /dev")
        if d.major < 0 or d.minor < 0:
            raise ValueError(f"devices: {d.path} has a negative number")
    ports = [p for pair in (*spec.publish, *spec.allow_host_ports) for p in pair]
    if any(not 0 < p < 65536 for p in ports):
        raise ValueError("publish/allow_host_ports: ports are 1-65535")
    if len({c for _, c in spec.publish}) != len(spec.publish) or len({h for h, _ in spec.publish}) != len(spec.publish):
        raise ValueError("publish: a port twice")
    if len({c for c, _ in spec.allow_host_ports}) != len(spec.allow_host_ports):
        raise ValueError("allow_host_ports: a sandbox port twice")
    if {c for _, c in spec.publish} & {c for c, _ in spec.allow_host_ports}:
        raise ValueError("publish/allow_host_ports: a sandbox port cannot be both a server and a forward")
    try:
        loopback = ipaddress.IPv4Address(spec.publish_address).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        raise ValueError(f"publish_address: {spec.publish_address!r} is not an IPv4 loopback address (127.0.0.0/8)")


def _absolute(name: str, path: str) -> str:
    if path != "/" and (path.startswith("//") or "\0" in path or posixpath.normpath(path) != path
                        or not path.startswith("/")):
        raise ValueError(f"{name}: {path!r} must be an absolute, normalized path")
    return path


def oci_config(spec: SandboxSpec, host: HostFacts, *, netns: str | None = None) -> dict[str, Any]:
    """The bundle's ``config.json`` for ``spec``; ``netns`` is a network namespace file to join (the one
    the network helper serves), else the sandbox gets a fresh one with loopback only."""
    validate(spec)
    limits = spec.limits
    nofile = min(limits.nofile, host.nofile_max)
    return {
        "ociVersion": "1.0.2",
        "process": {
            "terminal": False,
            "user": {"uid": spec.uid, "gid": spec.gid, "additionalGids": []},
            "args": list(spec.argv),
            "env": [f"{k}={v}" for k, v in spec.env.items()],
            "cwd": spec.cwd,
            "capabilities": {k: [] for k in ("bounding", "effective", "inheritable", "permitted", "ambient")},
            "rlimits": [
                {"type": "RLIMIT_NOFILE", "hard": nofile, "soft": nofile},
                {"type": "RLIMIT_CORE", "hard": 0, "soft": 0},
            ],
            "noNewPrivileges": True,
        },
        "root": {"path": "rootfs", "readonly": True},
        "hostname": spec.hostname,
        "mounts": _mounts(spec, host),
        "linux": {
            "namespaces": [
                {"type": "pid"}, {"type": "ipc"}, {"type": "uts"}, {"type": "mount"}, {"type": "cgroup"},
                {"type": "network", "path": netns} if netns else {"type": "network"},
            ],
            "cgroupsPath": f"/tensora/{spec.id}",
            "resources": _resources(spec, host),
            "devices": [
                {"path": d.path, "type": d.type, "major": d.major, "minor": d.minor, "fileMode": d.file_mode,
                 "uid": 0, "gid": 0}
                for d in spec.devices
            ],
            "maskedPaths": list(MASKED_PATHS),
            "readonlyPaths": list(READONLY_PATHS),
            "seccomp": seccomp_profile(host.arch),
        },
    }


def _mounts(spec: SandboxSpec, host: HostFacts) -> list[dict[str, Any]]:
    tmp = str(spec.limits.tmp_bytes)
    out: list[dict[str, Any]] = [
        {"destination": "/proc", "type": "proc", "source": "proc", "options": ["nosuid", "noexec", "nodev"]},
        {"destination": "/dev", "type": "tmpfs", "source": "tmpfs",
         "options": ["nosuid", "strictatime", "mode=755", "size=65536k"]},
        {"destination": "/dev/pts", "type": "devpts", "source": "devpts",
         "options": ["nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620"]},
        {"destination": "/dev/shm", "type": "tmpfs", "source": "shm",
         "options": ["nosuid", "noexec", "nodev", "mode=1777", f"size={tmp}"]},
        {"destination": "/dev/mqueue", "type": "mqueue", "source": "mqueue", "options": ["nosuid", "noexec", "nodev"]},
        {"destination": "/sys", "type": "sysfs", "source": "sysfs", "options": ["nosuid", "noexec", "nodev", "ro"]},
        {"destination": "/sys/fs/cgroup", "type": "cgroup", "source": "cgroup",
         "options": ["nosuid", "noexec", "nodev", "relatime", "ro"]},
    ]
    out += [_bind(source, target, writable=False) for target, source in host.system_dirs]
    out.append({"destination": "/tmp", "type": "tmpfs", "source": "tmpfs",
                "options": ["nosuid", "nodev", "mode=1777", f"size={tmp}"]})
    out += [_bind(m.source, m.target, writable=m.writable) for m in spec.mounts]
    return out


def _bind(source: str, target: str, *, writable: bool) -> dict[str, Any]:
    # "bind", not "rbind": mounts below the source stay out (and runc 1.1 would leave them writable)
    return {"destination": target, "type": "bind", "source": source,
            "options": ["bind", "rw" if writable else "ro", "nosuid", "nodev"]}


def _resources(spec: SandboxSpec, host: HostFacts) -> dict[str, Any]:
    limits = spec.limits
    memory: dict[str, int] = {"limit": limits.memory_bytes}
    if host.swap_limit:
        memory["swap"] = limits.memory_bytes
    cpu: dict[str, Any] = {"quota": max(1000, round(limits.cpus * CPU_PERIOD_US)), "period": CPU_PERIOD_US}
    if limits.cpuset is not None:
        cpu["cpus"] = limits.cpuset
    rules: list[dict[str, Any]] = [{"allow": False, "access": "rwm"}]
    rules += [{"allow": True, "type": "c", "major": major, "minor": minor, "access": "rwm"}
              for _, major, minor in STANDARD_DEVICES]
    rules += [{"allow": True, "type": "c", "major": 5, "minor": 2, "access": "rwm"},  # /dev/ptmx
              {"allow": True, "type": "c", "major": 136, "access": "rwm"}]  # /dev/pts/*: any minor
    rules += [{"allow": True, "type": d.type, "major": d.major, "minor": d.minor, "access": "rwm"}
              for d in spec.devices]
    return {"memory": memory, "cpu": cpu, "pids": {"limit": limits.pids}, "devices": rules}
