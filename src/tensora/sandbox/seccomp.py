"""The sandbox's seccomp profile: Tensora's own, documented here, since runc ships no default.

Shape: default ALLOW, and ``EPERM`` for the system calls that Docker's default profile keeps from a container
without capabilities, because they reach the kernel's most attacked or host-global surfaces. Most of them
already fail for lack of a capability; the filter is the second wall, and it also closes the few that need
none: creating user namespaces (``unshare``, ``clone`` with a ``CLONE_NEW*`` flag), which is where
unprivileged kernel exploits usually start, ``userfaultfd``, ``bpf``, ``perf_event_open``, ``io_uring``,
the kernel keyring, and ``open_by_handle_at``/``name_to_handle_at``.

Decided differently from Docker, and why:

- ``ptrace``, ``process_vm_readv/writev``, ``kcmp``: allowed. Since Linux 4.8 ptrace cannot bypass seccomp;
  a sandbox's pid namespace and single uid leave only its own processes to trace, and debuggers and
  profilers (gdb, py-spy, strace) are what a notebook user legitimately runs.
- ``mbind``, ``set_mempolicy``, ``get_mempolicy``, ``move_pages``: allowed (NUMA placement used by ML
  libraries); the cpuset still bounds the memory nodes.
- ``personality``: allowed with any flags. Its unsafe flags (``ADDR_NO_RANDOMIZE``, ``READ_IMPLIES_EXEC``)
  weaken only the caller's own process, and a masked-argument rule would also refuse the common
  ``personality(0xffffffff)`` query.
- ``socket(AF_VSOCK, ...)``: ``EPERM``, as in Docker. A vsock reaches the hypervisor's host side (and what
  listens there for its guests), which no workload of a sandbox needs; every other family is left to the
  network namespace.
- ``clone3``: ``ENOSYS`` rather than ``EPERM``, as in Docker: its flags live in memory a filter cannot read,
  and ENOSYS makes glibc fall back to ``clone``, whose flags the filter does check.
"""

from __future__ import annotations

from typing import Any

EPERM = 1
ENOSYS = 38

ARCHITECTURES = {
    "x86_64": ["SCMP_ARCH_X86_64", "SCMP_ARCH_X86", "SCMP_ARCH_X32"],
    "aarch64": ["SCMP_ARCH_AARCH64", "SCMP_ARCH_ARM"],
}
"""The filter covers the native ABI and the compat ones the kernel also accepts."""

DENIED = (
    # mounts and the root: the sandbox's filesystem view is fixed by runc
    "mount", "umount", "umount2", "pivot_root", "chroot", "mount_setattr", "move_mount", "open_tree",
    "fsopen", "fsconfig", "fsmount", "fspick",
    # namespaces: no new ones (user namespaces need no capability), no joining others
    "unshare", "setns",
    # the kernel itself: modules, kexec, reboot, swap, accounting, quotas
    "init_module", "finit_module", "delete_module", "create_module", "get_kernel_syms", "query_module",
    "kexec_load", "kexec_file_load", "reboot", "swapon", "swapoff", "acct", "quotactl", "quotactl_fd",
    "nfsservctl", "sysfs", "_sysctl", "uselib", "ustat", "vhangup", "syslog", "lookup_dcookie",
    # time is the host's
    "settimeofday", "stime", "clock_settime", "clock_adjtime",
    # raw hardware access
    "iopl", "ioperm", "vm86", "vm86old",
    # large kernel attack surfaces an ML workload does not need
    "bpf", "perf_event_open", "userfaultfd", "io_uring_setup", "io_uring_enter", "io_uring_register",
    "keyctl", "add_key", "request_key",
    # file handles bypass the mount namespace's view of paths
    "open_by_handle_at", "name_to_handle_at",
)
"""System calls that fail with EPERM whatever their arguments."""

CLONE_NAMESPACE_FLAGS = {
    "CLONE_NEWNS": 0x00020000,
    "CLONE_NEWCGROUP": 0x02000000,
    "CLONE_NEWUTS": 0x04000000,
    "CLONE_NEWIPC": 0x08000000,
    "CLONE_NEWUSER": 0x10000000,
    "CLONE_NEWPID": 0x20000000,
    "CLONE_NEWNET": 0x40000000,
}
"""``clone`` fails with EPERM when its flags (argument 0 on x86_64 and aarch64) carry any of these."""

AF_VSOCK = 40
"""``socket`` fails with EPERM for this address family (argument 0)."""


def seccomp_profile(arch: str) -> dict[str, Any]:
    """The ``linux.seccomp`` section of the OCI config for a host of machine type ``arch``."""
    if arch not in ARCHITECTURES:
        raise ValueError(f"no seccomp profile for {arch!r}: only {', '.join(ARCHITECTURES)}")
    syscalls: list[dict[str, Any]] = [
        {"names": list(DENIED), "action": "SCMP_ACT_ERRNO", "errnoRet": EPERM},
        {"names": ["clone3"], "action": "SCMP_ACT_ERRNO", "errnoRet": ENOSYS},
    ]
    # one rule per flag: a filter compares (arg & mask) == value, so "any of these bits" is an OR of rules
    syscalls += [
        {"names": ["clone"], "action": "SCMP_ACT_ERRNO", "errnoRet": EPERM,
         "args": [{"index": 0, "value": bit, "valueTwo": bit, "op": "SCMP_CMP_MASKED_EQ"}]}
        for bit in CLONE_NAMESPACE_FLAGS.values()
    ]
    syscalls.append({"names": ["socket"], "action": "SCMP_ACT_ERRNO", "errnoRet": EPERM,
                     "args": [{"index": 0, "value": AF_VSOCK, "op": "SCMP_CMP_EQ"}]})
    return {"defaultAction": "SCMP_ACT_ALLOW", "architectures": list(ARCHITECTURES[arch]), "syscalls": syscalls}
