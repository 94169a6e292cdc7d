"""Per-replica sandboxes: an OCI container (runc) with the owner's uid, a read-only host, the placed class's
cgroup limits, only its devices and its own network namespace. See ``spec`` (what), ``runc`` (how),
``network`` (pasta) and ``seccomp`` (the profile)."""

from tensora.sandbox.host import available, detect_host, host_device
from tensora.sandbox.network import SERVER_HOST, NetworkError
from tensora.sandbox.runc import Runc, SandboxError, SandboxHandle, SandboxState
from tensora.sandbox.spec import CgroupVersion, Device, HostFacts, Limits, Mount, SandboxSpec, oci_config

__all__ = [
    "SERVER_HOST",
    "CgroupVersion",
    "Device",
    "HostFacts",
    "Limits",
    "Mount",
    "NetworkError",
    "Runc",
    "SandboxError",
    "SandboxHandle",
    "SandboxSpec",
    "SandboxState",
    "available",
    "detect_host",
    "host_device",
    "oci_config",
]
