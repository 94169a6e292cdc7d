"""What a local replica runs and what it sees, as values: command, environment, mounts, devices, limits.

Pure: ``notebook``, ``endpoint`` and ``vm`` take a replica's facts (its class, GPUs, port, the host paths of
its home, model and Python environments) and return a :class:`Launch`; ``drivers.runners`` runs it in a sandbox
(``sandbox_spec``) or, where the operator chose ``isolation: none``, as a plain process of Tensora's user.

The environment is built from scratch, never inherited: PATH, HOME, USER, LANG, TMPDIR, CUDA_VISIBLE_DEVICES,
the thread counts, and the workload's own variables (a runtime's, a notebook's token). Nothing of Tensora's
settings, database URL or keys; a secret reaches the process by its environment, never its argv.

In a sandbox every path is fixed, whatever the host's layout:

==================  ===============================================  ==================================
inside              host                                             access
==================  ===============================================  ==================================
``/home/owner``     ``DATA_DIR/workdirs/<workload>`` (a notebook's)   read-write, the owner's uid
``/model``          the endpoint's model (in the owner's storage)     read-only
``/opt/runtime``    the model server's runtime venv                   read-only
``/opt/tensora``    Tensora's own environment (JupyterLab)            read-only
its own path        the Python those venvs were made from             read-only
``/vm``             ``DATA_DIR/replicas/<id>/vm`` (QMP, console,      read-write, the owner's uid
                    the disk's overlay ``disk.qcow2``)
``/image/<i>``      each image of a VM disk's checked backing chain   read-only, each file bound alone
``/opt/nvidia``     a GPU replica's NVIDIA driver: ``lib/<name>``,    read-only, each file bound alone
                    ``bin/<name>`` (``sandbox.host.nvidia_driver``)
``/tmp``            private tmpfs, charged to the memory limit        read-write
==================  ===============================================  ==================================

Nothing else of the host but its system dirs (read-only, see ``tensora.sandbox.spec``): no DATA_DIR, no
other owner's files. Why the driver is bound on its own: the sandbox's ``/usr`` is the host's without what is
mounted below it (a CUDA host's ``/usr/local/nvidia``, as on the H200 hosts Tensora was checked on), and the
host may find the driver by an LD_LIBRARY_PATH the sandbox does not inherit; without ``libcuda.so.1`` a
GPU replica's device nodes are of no use (``cuInit`` fails, torch sees no GPU).

A VM's disk is always its owner's image checked by ``drivers.vmdisk`` (the whole backing chain inside the
owner's files, or inside the one shared root the image lies in) under a copy-on-write overlay of its own:
QEMU gets ``-blockdev`` nodes naming every format and backing node, never ``-drive``. In a sandbox each image
of the chain is bound alone, read-only, at ``/image/<i>``, and the overlay is in ``/vm``: the file's own mode
decides whether the owner's uid reads it (not the owner's 0700 dir), none of the owner's other files is shown,
and once the sandbox is made a later rename over a name (an upload) changes nothing QEMU sees.
"""

from __future__ import annotations

import posixpath
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from tensora.drivers.loopback import Origin
from tensora.drivers.vmdisk import ImageInfo, qemu_disk_args, qemu_sandbox_args
from tensora.models import runtimes
from tensora.placement.catalog import ComputeClass
from tensora.sandbox import SERVER_HOST, Device, Limits, Mount, SandboxSpec
from tensora.sandbox.host import NvidiaDriver
from tensora.sandbox.spec import RESERVED_TARGETS, SYSTEM_DIRS

OWNER = "owner"
"""The user name a replica's environment gives (its uid is the owner's sandbox uid, which has no name)."""
HOME = f"/home/{OWNER}"
TENSORA_ENV = "/opt/tensora"
VM_DIR = "/vm"
IMAGE = "/image"
DISK = "disk.qcow2"
"""A VM's copy-on-write overlay in its VM dir: everything its guest writes, kept across restarts of the replica."""
SYSTEM_PATH = ("/usr/local/bin", "/usr/bin", "/bin")
PIDS = 4096
"""Processes and threads per replica (a fork bomb stops here, not at the host's limit)."""
GPU_CONTROL_DEVICES = ("nvidiactl", "nvidia-uvm", "nvidia-uvm-tools", "nvidia-modeset")
"""NVIDIA's shared device nodes a GPU class needs beside its own ``/dev/nvidiaN`` (those the host has)."""
NVIDIA_DIR = "/opt/nvidia"
TENSORAS = Origin(SERVER_HOST, SERVER_HOST)
"""127.0.0.1, Tensora's own servers' host: the default of the pure builders below, never what the local driver
gives a replica (``drivers.loopback``)."""
"""Where a sandboxed GPU replica sees the host's NVIDIA driver: ``lib/`` and ``bin/``, first on its paths."""


class LaunchError(ValueError):
    """The replica cannot be launched as asked; the message says why, for its owner or operator.
    ``permanent``: retrying cannot fix it (nothing missing comes back by itself), so the controller fails
    the workload at once rather than placing it again."""

    def __init__(self, message: str, *, permanent: bool = False) -> None:
        super().__init__(message)
        self.permanent = permanent


@dataclass(frozen=True, slots=True)
class PythonEnv:
    """A Python environment on the host: ``prefix`` (a venv, or an installation), ``base`` (the installation
    a venv was made from; = prefix otherwise), its interpreter ``python`` (under ``prefix``) and its
    ``version`` (``3.11``)."""

    prefix: str
    base: str
    python: str
    version: str = "3"


@dataclass(frozen=True, slots=True)
class Launch:
    """A replica's process: what to run, with what environment, where, and what it sees besides the system.

    ``port`` is the server's port, the same number inside the sandbox and on the host's ``address`` (the
    replica's own loopback address, ``drivers.loopback``: published there, or bound there by a process that is
    not sandboxed); ``devices`` are host device nodes the sandbox gets; ``served_model`` is the name its server
    answers to.
    """

    argv: tuple[str, ...]
    env: Mapping[str, str]
    cwd: str
    mounts: tuple[Mount, ...] = ()
    devices: tuple[str, ...] = ()
    port: int | None = None
    served_model: str | None = None
    address: str = SERVER_HOST


def base_env(home: str, cls: ComputeClass, gpus: Sequence[int], path: Sequence[str] = ()) -> dict[str, str]:
    """The environment every replica starts from. CPU placement hides every GPU (an empty
    CUDA_VISIBLE_DEVICES); GPU placement shows only its own; threads follow the class's vCPUs."""
    threads = str(max(1, int(cls.cpu)))
    # USER and LOGNAME: the sandbox's uid has no passwd entry, and getpass.getuser() (torch's caches) asks
    return {"PATH": ":".join([*path, *SYSTEM_PATH]), "HOME": home, "USER": OWNER, "LOGNAME": OWNER,
            "LANG": "C.UTF-8", "TMPDIR": "/tmp",
            "CUDA_VISIBLE_DEVICES": ",".join(str(g) for g in gpus),
            "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads}


def shown_by_system(path: str) -> bool:
    """Whether a sandbox already shows ``path`` read-only (it is under a host system dir)."""
    return any(path == d or path.startswith(d + "/") for d in SYSTEM_DIRS)


def python_mounts(env: PythonEnv, target: str) -> tuple[tuple[Mount, ...], str]:
    """Mount a Python environment read-only: a venv at ``target`` and its base installation at the base's own
    path (the venv's ``pyvenv.cfg`` names it); an installation that is no venv at its own path. Returns the
    mounts and the interpreter's path inside."""
    mounts: list[Mount] = []
    if env.prefix == env.base:
        python = env.python
    else:
        mounts.append(Mount(env.prefix, target))
        python = posixpath.join(target, posixpath.relpath(env.python, env.prefix))
    if not shown_by_system(env.base):
        if any(env.base == r or env.base.startswith(r.rstrip("/") + "/") for r in RESERVED_TARGETS if r != "/"):
            raise LaunchError(f"the Python at {env.base} is under a dir every sandbox has of its own (such as "
                              "/tmp): install the Python that Tensora and its runtimes use elsewhere")
        mounts.append(Mount(env.base, env.base))
    return tuple(mounts), python


def notebook(tensora: PythonEnv, home: Path, private: Path, port: int, token: str, cls: ComputeClass,
             gpus: Sequence[int], *, sandboxed: bool, as_root: bool = False, origin: Origin = TENSORAS) -> Launch:
    """JupyterLab from Tensora's own environment on ``port`` of ``origin`` (the replica's own host), its token
    in ``JUPYTER_TOKEN``. It binds 127.0.0.1 in its sandbox (published on the origin's address), the origin's
    address where not sandboxed; a named origin (``r-<hex>.localhost``) is added to Jupyter's local host names,
    whose Host check lets loopback addresses through but no name other than ``localhost``.

    Sandboxed: the home at ``/home/owner`` (Jupyter's config and data dirs in it, kept across restarts),
    runtime files in the private /tmp, ``pip install`` into ``~/.local`` (the environment is read-only).
    Not sandboxed: the home is the host dir and Jupyter's dirs are in ``private`` (the replica's dir)."""
    if sandboxed:
        mounts, python = python_mounts(tensora, TENSORA_ENV)
        mounts = (*mounts, Mount(str(home), HOME, writable=True))
        where = HOME
        site = f"{HOME}/.local/lib/python{tensora.version}/site-packages"
        extra = {"JUPYTER_RUNTIME_DIR": "/tmp/jupyter-runtime", "PIP_PREFIX": f"{HOME}/.local",
                 "PYTHONPATH": site}
    else:
        mounts, python, where = (), tensora.python, str(home)
        extra = {"JUPYTER_CONFIG_DIR": str(private / "jupyter" / "config"),
                 "JUPYTER_DATA_DIR": str(private / "jupyter" / "data"),
                 "JUPYTER_RUNTIME_DIR": str(private / "jupyter" / "runtime")}
    env = base_env(where, cls, gpus, [posixpath.dirname(python)]) | extra | {"JUPYTER_TOKEN": token}
    bind = SERVER_HOST if sandboxed else origin.address
    argv = [python, "-m", "jupyterlab", "--no-browser", f"--ServerApp.ip={bind}",
            f"--ServerApp.port={port}", "--ServerApp.port_retries=0", f"--ServerApp.root_dir={where}"]
    if origin.host != origin.address:
        argv += ["--ServerApp.local_hostnames=localhost", f"--ServerApp.local_hostnames={origin.host}"]
    if as_root and not sandboxed:
        argv.append("--allow-root")
    return Launch(tuple(argv), env, where, mounts, port=port, address=origin.address)


def endpoint(runtime: runtimes.Runtime, venv: PythonEnv, model: str, name: str, port: int, kind: str,
             cls: ComputeClass, gpus: Sequence[int], private: Path, *, sandboxed: bool,
             api_key: str | None = None, address: str = SERVER_HOST) -> Launch:
    """The runtime's model server on ``port`` of ``address`` (the replica's own loopback address: bound there
    unsandboxed, published there from the sandbox's 127.0.0.1). Sandboxed, it sees its model read-only at ``/model``
    and answers to that name; its HOME (caches) is the private /tmp. ``api_key`` (the replica's, which only the
    gateway holds) goes in the runtime's ``api_key_env`` where it takes one, never on argv."""
    device = {"cpu": "cpu", "metal": "mps", "gpu": "cuda"}[kind]
    if sandboxed:
        mounts, _ = python_mounts(venv, runtimes.ENV_PATH)
        mounts = (*mounts, Mount(model, runtimes.MODEL_PATH))
        env_path, served, home = runtimes.ENV_PATH, runtimes.MODEL_PATH, "/tmp"
    else:
        mounts, env_path, served, home = (), venv.prefix, model, str(private)
    argv = runtimes.command(runtime, env_path, served, name, port, device, SERVER_HOST if sandboxed else address)
    env = base_env(home, cls, gpus, [f"{env_path}/bin"]) | runtime.env
    if api_key and runtime.api_key_env:
        env[runtime.api_key_env] = api_key
    return Launch(tuple(argv), env, home, mounts, port=port, served_model=served, address=address)


def with_nvidia_driver(launch: Launch, driver: NvidiaDriver) -> Launch:
    """A sandboxed GPU replica's launch with the host's NVIDIA driver shown read-only: each library at
    ``/opt/nvidia/lib/<name>`` and each binary at ``/opt/nvidia/bin/<name>`` (a link's name bound from the
    file it points to), those dirs first on LD_LIBRARY_PATH and PATH. Raises LaunchError when the driver has
    no ``libcuda.so.1``: such a replica would start and see no GPU."""
    if not driver.cuda:
        raise LaunchError("no NVIDIA driver library (libcuda.so.1) was found on this host, so a GPU replica "
                          "could not use its GPU: name the driver's folders in the config, e.g. node: {nvidia_driver: "
                          "[/usr/local/nvidia/lib64, /usr/local/nvidia/bin]}")
    mounts = [Mount(path, f"{NVIDIA_DIR}/lib/{name}") for name, path in driver.libraries]
    mounts += [Mount(path, f"{NVIDIA_DIR}/bin/{name}") for name, path in driver.binaries]
    env = dict(launch.env)
    for var, path in (("LD_LIBRARY_PATH", f"{NVIDIA_DIR}/lib"), ("PATH", f"{NVIDIA_DIR}/bin")):
        env[var] = ":".join(p for p in (path, env.get(var)) if p)
    return replace(launch, env=env, mounts=(*launch.mounts, *mounts))


def vm(qemu: str, name: str, cls: ComputeClass, accel: str, passthrough: Sequence[str], vm_dir: Path,
       socket: str, disk: ImageInfo | None, *, sandboxed: bool, vfio_groups: Sequence[str] = ()) -> Launch:
    """QEMU with QMP on ``socket`` and the serial console in the VM dir (appended to, so the driver can cut it
    back in place, ``drivers.logcap``); ``disk`` (checked by
    ``vmdisk.inspect``) under its overlay ``vm_dir/disk.qcow2`` (made by ``vmdisk.overlay``), attached as
    ``-blockdev`` nodes that name every format and backing node. Sandboxed: the VM dir at ``/vm`` (the owner's,
    so QEMU creates the socket there and the host reaches it through the mount), each image of the chain alone
    read-only at ``/image/<i>``, only ``/dev/kvm`` (and a passthrough's VFIO group devices) added, QEMU's own
    ``-sandbox`` on. Unsandboxed the same disk nodes at host paths, without ``-sandbox`` (QEMU's seccomp is
    Linux-only, and hosts that cannot sandbox include macOS)."""
    where = VM_DIR if sandboxed else str(vm_dir)
    # the guest gets 7/8 of the class's memory: QEMU itself (its block caches too) lives in the same limit
    memory_mib = max(64, (cls.memory - max(cls.memory // 8, 256 << 20)) // 2**20)
    argv = [qemu, "-name", f"tensora-{name}", "-machine", "q35", "-accel", accel,
            "-m", str(memory_mib), "-smp", str(max(1, int(cls.cpu))), "-nodefaults", "-no-user-config",
            "-display", "none", "-chardev", f"file,id=console,path={where.replace(',', ',,')}/console.log,append=on",
            "-serial", "chardev:console",
            "-qmp", f"unix:{socket},server=on,wait=off"]
    for address in passthrough:
        argv += ["-device", f"vfio-pci,host={address}"]
    mounts: tuple[Mount, ...] = ()
    devices: list[str] = []
    if sandboxed:
        argv += qemu_sandbox_args()
        mounts = (Mount(str(vm_dir), VM_DIR, writable=True),)
        if accel == "kvm":
            devices.append("/dev/kvm")
        if passthrough:
            devices += ["/dev/vfio/vfio", *(f"/dev/vfio/{g}" for g in vfio_groups)]
    if disk is not None:
        seen = vm_disk_mounts(disk, vm_dir) if sandboxed else None
        if seen is not None:
            mounts = (*mounts, *(Mount(str(host), str(inside)) for host, inside in seen.items() if host != vm_dir))
        argv += qemu_disk_args(vm_dir / DISK, disk, mounts=seen)
    env = base_env(where, cls, [])
    return Launch(tuple(argv), env, where, mounts, tuple(devices))


def vm_disk_mounts(disk: ImageInfo, vm_dir: Path) -> dict[Path, Path]:
    """Where a sandboxed QEMU sees its disk, host path to sandbox path: the VM dir (the overlay in it) at
    ``/vm``, and each image of the checked chain as a file of its own at ``/image/<i>`` (0 the owner's image,
    each next its backing file)."""
    return {vm_dir: Path(VM_DIR), **{layer.path: Path(f"{IMAGE}/{i}") for i, layer in enumerate(disk.chain)}}


def image_root(image: Path, roots: Sequence[Path]) -> Path | None:
    """The root among ``roots`` (the owner's files, the operator's shared roots; all resolved) that holds
    ``image`` (resolved), the deepest where roots nest: the only dir its backing chain may use. None: in none
    of them. Pure."""
    inside = [r for r in roots if image != r and image.is_relative_to(r)]
    return max(inside, key=lambda r: len(r.parts)) if inside else None


def limits(cls: ComputeClass, cpuset: Sequence[int] = ()) -> Limits:
    """The placed class as cgroup limits: its vCPUs as a CPU quota, its memory (no swap), a pids limit, and
    its own cores where the node pins them."""
    return Limits(cpus=cls.cpu, memory_bytes=cls.memory, pids=PIDS,
                  cpuset=",".join(str(c) for c in cpuset) or None)


def choose_cpuset(cores: Sequence[int], taken: set[int], want: float, *, overcommitted: bool) -> list[int]:
    """Cores of its own for a replica of ``want`` vCPUs: only on a node that does not overcommit its cores,
    for a whole number of them, when that many are free (else none: the quota alone bounds it). The highest
    free cores first (the host's own work tends to run on the first)."""
    if overcommitted or want < 1 or want != int(want):
        return []
    free = [c for c in sorted(cores) if c not in taken]
    return free[-int(want):] if len(free) >= want else []


def sandbox_spec(launch: Launch, sandbox_id: str, uid: int, gid: int, limits_: Limits,
                 devices: Sequence[Device], allow_host_ports: Sequence[tuple[int, int]]) -> SandboxSpec:
    """The launch as a sandbox: the owner's uid, its port published on the launch's own loopback address (never
    Tensora's 127.0.0.1), and the host loopback ports (Tensora's API and gateway) it may reach, as (port inside,
    host port) pairs."""
    publish = ((launch.port, launch.port),) if launch.port else ()
    allowed = tuple(sorted({(p, h) for p, h in allow_host_ports if p and h and p != launch.port}))
    return SandboxSpec(id=sandbox_id, argv=launch.argv, uid=uid, gid=gid, limits=limits_, env=dict(launch.env),
                       cwd=launch.cwd, mounts=launch.mounts, devices=tuple(devices), publish=publish,
                       allow_host_ports=allowed, publish_address=launch.address)
