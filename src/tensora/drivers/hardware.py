"""What this machine has, as the local node's allocatable: CPU cores, memory, GPUs.

NVIDIA GPUs come from NVML (``nvidia-ml-py``, when installed) or ``nvidia-smi``; Apple
Silicon's Metal GPU from the platform. Each GPU is mapped to a catalog GPU model by name and
memory ("NVIDIA A100-SXM4-80GB" -> ``A100-80GB``); one that maps to none is listed as seen
but offers no class. Operators override any of it (``node:`` in the config): reserve cores
and memory for the host, or declare less or more for development.

**How the local node shares a machine.** ``tensora up`` runs on the machine someone works
on, often a small one (2 cores, 24 GiB), where the quick start's endpoint, a notebook and a
VM should all run at once. Most of the time they idle: a notebook waits for its user, a
model server for a request. So the local node *overcommits CPU*: it offers ``cores x
cpu_overcommit`` vCPUs (default 4; 1 = none) and its replicas share the cores, each sized
to its class (threads, QEMU's vCPUs; a cgroup CPU quota per replica is to come). A CPU
class never gets more vCPUs than the cores its node shares (label ``tensora.io/cores``,
applied by ``capacity``): a cpu-4c-16g on 2 cores could not get its 4 cores even alone,
and a fallback to ``cpu`` (the classes nearest the requested GPU class first) would
otherwise take 16 GiB of the 21.5 and leave too little for the next workload. Memory is
never overcommitted: a replica that runs out of memory is killed, one that runs short of
CPU only runs slower. A machine of 4 cores or fewer keeps no core back for the host (it
keeps 2 GiB of memory): a whole core is half of such a machine, and Tensora's own
processes share the cores as the replicas do. Explicit settings win.
"""

from __future__ import annotations

import os
import platform
import shutil
import socket
import subprocess
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from tensora.placement.capacity import CORES_LABEL, Node
from tensora.placement.catalog import Catalog
from tensora.units import format_memory, parse_memory

MIB = 2**20
SMALL_MACHINE_CORES = 4  # at most this many cores: no core is kept back for the host by default


@dataclass(frozen=True, slots=True)
class Gpu:
    index: int
    name: str
    memory: int
    model: str | None
    """The catalog's GPU model this maps to, or None (seen, but no class runs on it)."""


@dataclass(frozen=True, slots=True)
class Hardware:
    cpu: int
    memory: int
    gpus: tuple[Gpu, ...] = ()
    source: str = ""
    notes: tuple[str, ...] = field(default_factory=tuple)


class NodeOverrides(BaseModel):
    """``node:`` in the config: what to declare instead of (or keep back from) what is detected."""

    model_config = ConfigDict(extra="forbid")

    name: str | None = Field(default=None, pattern=r"^[a-z0-9]([a-z0-9.-]{0,251}[a-z0-9])?$",
                             description="the node's name (default: this machine's host name)")
    cpu: float | None = Field(default=None, gt=0, description="declare this many cores instead")
    cpu_overcommit: float = Field(default=4.0, ge=1, le=64, description="vCPUs offered per core: replicas share "
                                  "the cores (1 = no overcommit)")
    memory: str | int | None = Field(default=None, description="declare this much memory instead, e.g. 16Gi")
    reserve_cpu: float | None = Field(default=None, ge=0, description="cores kept for the host and Tensora "
                                      f"itself (default: 0 on a machine of {SMALL_MACHINE_CORES} cores or fewer, "
                                      "else 1)")
    reserve_memory: str | int = Field(default="2Gi", description="memory kept for the host")
    gpus: dict[str, int] | None = Field(default=None, description="declare GPUs by catalog model, e.g. {L40S: 1}")
    vfio: dict[int, str] = Field(default_factory=dict, description="VM GPU passthrough: GPU index -> the PCI "
                                 "address of that GPU bound to vfio-pci, e.g. {0: '0000:65:00.0'} (a GPU bound "
                                 "to vfio-pci is invisible to nvidia-smi: declare it in gpus too)")
    nvidia_driver: list[str] = Field(default_factory=list, description="the NVIDIA driver's user-space files "
                                     "a sandboxed GPU replica gets, as folders or files, e.g. "
                                     "[/usr/local/nvidia/lib64, /usr/local/nvidia/bin] (default: found as "
                                     "nvidia-container-toolkit finds them: ldconfig -p, then the usual folders)")


def parse_nvidia_smi(text: str) -> list[tuple[int, str, int]]:
    """Rows of ``nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader,nounits``."""
    rows = []
    for line in text.strip().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 3 or not parts[0].isdigit():
            continue
        try:
            mib = int(float(parts[2]))
        except ValueError:
            continue
        rows.append((int(parts[0]), parts[1], mib * MIB))
    return rows


def gpu_model_for(name: str, memory: int, catalog: Catalog) -> str | None:
    """The catalog GPU model for a device name and memory, or None.

    A model matches when its first token ("A100" of "A100-80GB") is a word of the name; among
    several, the one whose memory is nearest the device's wins (A100 40GB vs 80GB)."""
    words = set(name.upper().replace("-", " ").replace("_", " ").split())
    best: tuple[float, str] | None = None
    for cls in catalog.values():
        if not cls.gpu_model or not cls.gpu_memory:
            continue
        base = cls.gpu_model.upper().split("-")[0]
        if base not in words:
            continue
        distance = abs(cls.gpu_memory - memory) / cls.gpu_memory
        if distance > 0.25:  # a 40 GB A100 is not an 80 GB one
            continue
        if best is None or distance < best[0]:
            best = (distance, cls.gpu_model)
    return best[1] if best else None


def _nvidia(catalog: Catalog) -> tuple[list[Gpu], str]:
    try:
        import pynvml  # type: ignore[import-not-found]

        pynvml.nvmlInit()
        try:
            out = []
            for i in range(pynvml.nvmlDeviceGetCount()):
                h = pynvml.nvmlDeviceGetHandleByIndex(i)
                name = pynvml.nvmlDeviceGetName(h)
                name = name.decode() if isinstance(name, bytes) else str(name)
                mem = int(pynvml.nvmlDeviceGetMemoryInfo(h).total)
                out.append(Gpu(i, name, mem, gpu_model_for(name, mem, catalog)))
            return out, "nvml"
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # not installed, or no driver: try nvidia-smi
        pass
    smi = shutil.which("nvidia-smi")
    if not smi:
        return [], ""
    try:
        text = subprocess.run([smi, "--query-gpu=index,name,memory.total", "--format=csv,noheader,nounits"],
                              capture_output=True, text=True, timeout=10, check=True).stdout
    except (subprocess.SubprocessError, OSError):
        return [], ""
    return [Gpu(i, n, m, gpu_model_for(n, m, catalog)) for i, n, m in parse_nvidia_smi(text)], "nvidia-smi"


def _memory() -> int:
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 0


def detect(catalog: Catalog) -> Hardware:
    """This machine's cores (those this process may use), memory and GPUs."""
    try:
        cpu = len(os.sched_getaffinity(0))
    except AttributeError:  # macOS
        cpu = os.cpu_count() or 1
    memory = _memory()
    gpus, source = _nvidia(catalog)
    notes = [f"GPU {g.index} ({g.name}) matches no catalog class" for g in gpus if g.model is None]
    if not gpus and platform.system() == "Darwin" and platform.machine() == "arm64":
        metal = next((c.gpu_model for c in catalog.values() if c.gpu_model and "METAL" in c.gpu_model.upper()), None)
        gpus, source = [Gpu(0, "Apple Silicon GPU (Metal)", memory, metal)], "metal"
    return Hardware(cpu, memory, tuple(gpus), source or "none", tuple(notes))


def reserve_cpu(cores: float, overrides: NodeOverrides) -> float:
    """The cores kept for the host: the operator's figure, else none on a small machine, else 1."""
    if overrides.reserve_cpu is not None:
        return overrides.reserve_cpu
    return 0.0 if cores <= SMALL_MACHINE_CORES else 1.0


def local_node(hw: Hardware, overrides: NodeOverrides, region: str) -> Node:
    """The node the local driver offers: detected (or declared) minus the host's reserve, its cores
    overcommitted (see the module docstring)."""
    cores = overrides.cpu if overrides.cpu is not None else float(hw.cpu)
    shared = max(cores - reserve_cpu(cores, overrides), 0.0)
    memory = parse_memory(overrides.memory) if overrides.memory is not None else hw.memory
    reserve_mem = parse_memory(overrides.reserve_memory)
    gpus: dict[str, int] = {}
    if overrides.gpus is not None:
        gpus = dict(overrides.gpus)
    else:
        for g in hw.gpus:
            if g.model:
                gpus[g.model] = gpus.get(g.model, 0) + 1
    name = overrides.name or _hostname()
    return Node(name, region, shared * overrides.cpu_overcommit, max(memory - reserve_mem, 0), gpus,
                {"tensora.io/profile": "local", CORES_LABEL: f"{shared:g}"})


def _hostname() -> str:
    raw = socket.gethostname().split(".")[0].lower()
    cleaned = "".join(c if c.isalnum() or c == "-" else "-" for c in raw).strip("-")
    return cleaned or "local"


def offered(node: Node) -> str:
    """The node in one phrase, as ``tensora up`` and ``tensora node`` say it:
    ``2 cores offered as 8 vCPU (overcommit 4x: ...), 21.5Gi, no GPUs``."""
    gpus = ", ".join(f"{n}x {m}" for m, n in node.gpus.items()) or "no GPUs"
    cores = node.cores
    if cores is None or cores <= 0 or node.cpu <= cores:
        cpu = _cores(node.cpu)
    else:
        cpu = (f"{_cores(cores)} offered as {node.cpu:g} vCPU (overcommit {node.cpu / cores:g}x: replicas share "
               f"the cores; CPU classes up to {cores:g} vCPU)")
    return f"{cpu}, {format_memory(node.memory)}, {gpus}"


def gpu_notes(node: Node, catalog: Catalog) -> list[str]:
    """Why a GPU the node offers would never run anything: no class of its model in the catalog, or none that
    fits the node (a one-H200 machine of 128 GiB under the default h200-141gb's 240 GiB, seen on such a host).
    Without the note the GPU shows as offered while every workload asking for it waits."""
    notes = []
    for model, count in node.gpus.items():
        classes = [c for c in catalog.values() if c.gpu_model == model]
        if count <= 0 or any(c.gpu_count <= count and c.cpu <= node.cpu and c.memory <= node.memory
                             for c in classes):
            continue
        if not classes:
            notes.append(f"{count}x {model} offered, but no catalog class uses it")
            continue
        need = "; ".join(f"{c.name} needs {c.gpu_count} GPU, {c.cpu:g} vCPU, {format_memory(c.memory)}"
                         for c in classes)
        notes.append(f"{count}x {model} offered, but no class of it fits this node ({node.cpu:g} vCPU, "
                     f"{format_memory(node.memory)}): {need}. Use a catalog with a class that fits, or declare "
                     "node: memory")
    return notes


def _cores(n: float) -> str:
    return f"{n:g} core" if n == 1 else f"{n:g} cores"


def describe(hw: Hardware, node: Node) -> dict[str, Any]:
    """What ``tensora node`` shows: detected and offered (``cores``: the cores its vCPUs share)."""
    return {
        "detected": {"cpu": hw.cpu, "memory": hw.memory, "source": hw.source,
                     "gpus": [{"index": g.index, "name": g.name, "memory": g.memory, "model": g.model}
                              for g in hw.gpus], "notes": list(hw.notes)},
        "node": {"name": node.name, "region": node.region, "cpu": node.cpu, "cores": node.cores,
                 "memory": node.memory, "gpus": dict(node.gpus)},
    }
