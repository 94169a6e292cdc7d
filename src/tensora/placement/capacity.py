"""Nodes, their allocatable resources, and what still fits where.

A node has allocatable vCPUs, memory and GPUs by model. What is already placed on
it is subtracted to give its free resources. GPU classes fit only where their GPU
model is. CPU classes fit on CPU nodes and on the idle CPU of GPU nodes, but never
in the vCPUs and memory held back for that node's free GPUs (the *GPU reserve*, per
GPU model), so that a free GPU always stays usable.

A node may hold a limited number of replicas (:attr:`Node.pods`: a Kubernetes node's allocatable pods): each
replica placed there takes one, and a node whose pods are all taken fits nothing more, whatever vCPUs it has
left. None (the local and simulated nodes): no limit but its resources.

A node whose vCPUs are overcommitted (``tensora up`` on a small machine) says how many
cores they share (:attr:`Node.cores`): a CPU class with more vCPUs than that never runs
there, since no share of those cores gives it what the class promises.

:class:`Capacity` is the working set admission consumes during one decision cycle:
it only ever shrinks (``take``), which is what lets ``find`` keep a monotone
first-fit cursor per (region, class) and stay linear over a whole cycle.
Pure: no I/O and no clock.
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from tensora.placement.catalog import Catalog, ComputeClass

CORES_LABEL = "tensora.io/cores"
PODS_LABEL = "tensora.io/pods"
UNLIMITED_PODS = 1_000_000_000
"""The free pods a node without a pod limit counts: more than any region places, small enough that a region's
sum stays a machine integer (the compiled hot path)."""


@dataclass(frozen=True, slots=True)
class Node:
    """A machine that workloads can be placed on."""

    name: str
    region: str
    cpu: float
    memory: int
    gpus: Mapping[str, int] = field(default_factory=dict)
    labels: Mapping[str, str] = field(default_factory=dict)
    schedulable: bool = True
    pods: int | None = None
    """How many replicas (pods) it can hold; None: no limit but its resources."""

    @property
    def has_gpus(self) -> bool:
        return any(count > 0 for count in self.gpus.values())

    @property
    def cores(self) -> float | None:
        """The cores its ``cpu`` vCPUs share, where the node says (label ``tensora.io/cores``: the local
        node); None: no limit but ``cpu``.

        A label rather than a field: labels go wherever a node goes (the store's nodes table, and so
        the API's catalog), so every reader of the node applies the same limit without a migration."""
        raw = self.labels.get(CORES_LABEL)
        try:
            return float(raw) if raw is not None else None
        except ValueError:
            return None


@dataclass(frozen=True, slots=True)
class Placed:
    """An instance of a class already running (or starting) on a node."""

    node: str
    cls: str
    workload: str = ""


@dataclass(frozen=True, slots=True)
class GpuReserve:
    """Host vCPUs and memory held back, per free GPU, from CPU classes on a GPU node."""

    cpu: float
    memory: int


def default_reserves(catalog: Catalog) -> dict[str, GpuReserve]:
    """Per GPU model, the most host vCPU and memory per GPU that any class of that model needs."""
    out: dict[str, GpuReserve] = {}
    for cls in catalog.values():
        if cls.gpu_model is None or cls.gpu_count <= 0:
            continue
        per_cpu, per_mem = cls.cpu / cls.gpu_count, cls.memory // cls.gpu_count
        old = out.get(cls.gpu_model)
        if old is None:
            out[cls.gpu_model] = GpuReserve(per_cpu, per_mem)
        else:
            out[cls.gpu_model] = GpuReserve(max(old.cpu, per_cpu), max(old.memory, per_mem))
    return out


@dataclass(frozen=True, slots=True)
class Free:
    """How much of the resource a class is short of is free in a region (``unit``: ``GPU``, ``vCPU``,
    ``memory``, in bytes, or ``pods``); see :meth:`Capacity.free`."""

    free: float
    need: float
    unit: str


@dataclass(frozen=True, slots=True)
class ClassCapacity:
    """How many instances of a class fit in a region now, and on which nodes."""

    cls: str
    kind: str
    fits: int
    nodes: Mapping[str, int]


class Capacity:
    """Free resources of every node after what is placed; see the module docstring."""

    def __init__(
        self,
        nodes: Iterable[Node],
        placed: Iterable[Placed],
        catalog: Catalog,
        reserves: Mapping[str, GpuReserve] | None = None,
    ) -> None:
        self.catalog = catalog
        self.nodes: list[Node] = sorted(nodes, key=lambda n: n.name)
        self.reserves: dict[str, GpuReserve] = dict(default_reserves(catalog))
        if reserves:
            self.reserves.update(reserves)
        self.index: dict[str, int] = {}
        for i, node in enumerate(self.nodes):
            if node.name in self.index:
                raise ValueError(f"duplicate node name {node.name!r}")
            self.index[node.name] = i
        self.free_cpu: list[float] = [n.cpu for n in self.nodes]
        self.free_mem: list[int] = [n.memory for n in self.nodes]
        self.free_gpus: list[dict[str, int]] = [dict(n.gpus) for n in self.nodes]
        self.free_pods: list[int] = [_pods(n) for n in self.nodes]
        self.excluded: set[int] = set()
        self._cursor: dict[tuple[str, str], int] = {}
        self._scan: dict[tuple[str, str], int] = {}  # this cycle's, past held nodes too
        self._candidates: dict[tuple[str, str], list[int]] = {}
        self._room: dict[str, list[tuple[int, float, int, float | None]]] = {}  # for CPU classes' candidates
        self._unhostable: dict[tuple[str, str], bool] = {}
        self._pos: dict[tuple[str, str], dict[int, int]] = {}  # a candidate's position, for _grew
        self._best: dict[tuple[str, str], list[tuple[float, float, str, int]]] = {}  # for hold
        self._journal: dict[int, tuple[float, int, dict[str, int], float, int, int]] | None = None
        self._totals: tuple[dict[tuple[str, str], int], dict[str, float], dict[str, int], dict[str, int]] = (
            {}, {}, {}, {})
        self._by_region: dict[str, list[int]] = {}
        for i, node in enumerate(self.nodes):
            self._by_region.setdefault(node.region, []).append(i)
        for p in placed:
            at = self.index.get(p.node)
            cls = catalog.get(p.cls)
            if at is not None and cls is not None:
                self._subtract(at, cls)
        self.reserved_cpu: list[float] = [self._reserve_cpu(i) for i in range(len(self.nodes))]
        self.reserved_mem: list[int] = [self._reserve_mem(i) for i in range(len(self.nodes))]
        self._region_gpus: dict[tuple[str, str], int] = {}
        self._region_cpu: dict[str, float] = {}
        self._region_mem: dict[str, int] = {}  # memory usable by CPU classes, like _region_cpu
        self._region_pods: dict[str, int] = {}
        self._none_of: dict[tuple[str, str], tuple[bool, bool]] = {}  # _gpu_nodes
        for i, node in enumerate(self.nodes):
            if not node.schedulable:
                continue
            for model, count in self.free_gpus[i].items():
                key = (node.region, model)
                self._region_gpus[key] = self._region_gpus.get(key, 0) + max(0, count)
            self._region_cpu[node.region] = self._region_cpu.get(node.region, 0.0) + self._cpu_usable(i)
            self._region_mem[node.region] = self._region_mem.get(node.region, 0) + self._mem_usable(i)
            self._region_pods[node.region] = self._region_pods.get(node.region, 0) + max(0, self.free_pods[i])

    # -- derived per-node figures -------------------------------------------------

    def _reserve_cpu(self, i: int) -> float:
        return sum(max(0, c) * self.reserves[m].cpu for m, c in self.free_gpus[i].items() if m in self.reserves)

    def _reserve_mem(self, i: int) -> int:
        return sum(max(0, c) * self.reserves[m].memory for m, c in self.free_gpus[i].items() if m in self.reserves)

    def _cpu_usable(self, i: int) -> float:
        return max(0.0, self.free_cpu[i] - self.reserved_cpu[i])

    def _mem_usable(self, i: int) -> int:
        return max(0, self.free_mem[i] - self.reserved_mem[i])

    def _subtract(self, i: int, cls: ComputeClass) -> None:
        self.free_cpu[i] -= cls.cpu
        self.free_mem[i] -= cls.memory
        self.free_pods[i] -= 1
        if cls.gpu_model is not None:
            gpus = self.free_gpus[i]
            gpus[cls.gpu_model] = gpus.get(cls.gpu_model, 0) - cls.gpu_count

    # -- queries ------------------------------------------------------------------

    def fits(self, i: int, cls: ComputeClass) -> int:
        """How many instances of ``cls`` fit on node ``i`` now (0 if unschedulable)."""
        node = self.nodes[i]
        if not node.schedulable or self.free_pods[i] <= 0:
            return 0
        if cls.gpu_model is None:
            if node.cores is not None and cls.cpu > node.cores:
                return 0
            cpu = self.free_cpu[i] - self.reserved_cpu[i]
            mem = self.free_mem[i] - self.reserved_mem[i]
            counts = [cpu // cls.cpu, mem // cls.memory, self.free_pods[i]]
        else:
            gpus = self.free_gpus[i].get(cls.gpu_model, 0)
            counts = [gpus // cls.gpu_count, self.free_cpu[i] // cls.cpu, self.free_mem[i] // cls.memory,
                      self.free_pods[i]]
        return max(0, int(min(counts)))

    def _could_ever_host(self, node: Node, cls: ComputeClass) -> bool:
        """For a GPU class (a CPU class: :meth:`_cpu_room`)."""
        return node.schedulable and (
            node.gpus.get(cls.gpu_model or "", 0) >= cls.gpu_count and node.cpu >= cls.cpu and node.memory >= cls.memory
        )

    def unhostable(self, region: str, cls: ComputeClass) -> bool:
        """A CPU class that no node of a non-empty ``region`` could ever host (more vCPUs than a node's
        cores or allocatable, or more memory): waiting cannot help, and the word ``cpu`` skips it."""
        if cls.gpu_model is not None:
            return False
        key = (region, cls.name)
        found = self._unhostable.get(key)
        if found is None:
            found = self._unhostable[key] = bool(self._by_region.get(region)) and not self.candidates(region, cls)
        return found

    def candidates(self, region: str, cls: ComputeClass) -> list[int]:
        """Nodes of ``region`` that could ever host ``cls``, in the order they are filled.

        GPU classes: by node name. CPU classes: CPU-only nodes first, then GPU nodes'
        idle CPU, each by name, so GPU servers' CPU is used once CPU nodes are full.
        """
        key = (region, cls.name)
        found = self._candidates.get(key)
        if found is None:
            nodes = self.nodes
            if cls.gpu_model is None:
                found = [i for i, cpu, mem, cores in self._cpu_room(region)
                         if cpu >= cls.cpu and mem >= cls.memory and (cores is None or cls.cpu <= cores)]
            else:
                found = [i for i in self._by_region.get(region, ()) if self._could_ever_host(nodes[i], cls)]
            self._candidates[key] = found
        return found

    def _cpu_room(self, region: str) -> list[tuple[int, float, int, float | None]]:
        """Each schedulable node of ``region`` as (index, vCPUs and memory CPU classes could ever use there,
        its cores): what :meth:`_could_ever_host` asks of a CPU class, worked out once for all of them; in the
        order CPU classes fill them (so each class's candidates are these, filtered)."""
        room = self._room.get(region)
        if room is None:
            room = self._room[region] = []
            for i in self._by_region.get(region, ()):
                node = self.nodes[i]
                if node.schedulable:
                    gpus = [(c, self.reserves[m]) for m, c in node.gpus.items() if m in self.reserves]
                    room.append((i, node.cpu - sum(c * r.cpu for c, r in gpus),
                                 node.memory - sum(c * r.memory for c, r in gpus), node.cores))
            nodes = self.nodes
            room.sort(key=lambda r: (nodes[r[0]].has_gpus, nodes[r[0]].name))
        return room

    def find(self, region: str, cls: ComputeClass) -> int | None:
        """The first node (in :meth:`candidates` order) where one ``cls`` fits, else None.

        Two cursors per (region, class) keep this linear over a cycle: capacity only shrinks within one, so
        a node passed over never fits again in it. The cycle's own (``_scan``) also passes over held nodes
        (``excluded``); the lasting one (``_cursor``) marks the first node where ``cls`` fits by its
        resources, held or not, and is moved back only where capacity grew (:meth:`change`), so a state
        kept across cycles starts each one there, not at its region's first node.
        """
        key = (region, cls.name)
        cands = self._candidates.get(key)
        if cands is None:
            cands = self.candidates(region, cls)
        pos = self._scan.get(key)
        fresh = pos is None
        if pos is None:
            pos = self._cursor.get(key, 0)
        first = -1
        n = len(cands)
        free_cpu, free_mem, free_pods, excluded = self.free_cpu, self.free_mem, self.free_pods, self.excluded
        if cls.gpu_model is None:
            rcpu, rmem = self.reserved_cpu, self.reserved_mem
            need_cpu, need_mem = cls.cpu, cls.memory
            while pos < n:
                i = cands[pos]
                if free_cpu[i] - rcpu[i] >= need_cpu and free_mem[i] - rmem[i] >= need_mem and free_pods[i] > 0:
                    if first < 0:
                        first = pos
                    if i not in excluded:
                        break
                pos += 1
        else:
            model, count, free_gpus = cls.gpu_model, cls.gpu_count, self.free_gpus
            while pos < n:
                i = cands[pos]
                if free_gpus[i].get(model, 0) >= count and free_cpu[i] >= cls.cpu and free_mem[i] >= cls.memory \
                        and free_pods[i] > 0:
                    if first < 0:
                        first = pos
                    if i not in excluded:
                        break
                pos += 1
        self._scan[key] = pos
        if fresh:
            self._cursor[key] = first if first >= 0 else n
        return cands[pos] if pos < n else None

    def no_room(self, region: str, cls: ComputeClass) -> bool:
        """Whether no node of ``region`` fits one ``cls`` now (:meth:`find` found none). Where the lasting
        cursor is past every candidate, that is known without a look: it is moved back wherever capacity grew."""
        at = self._cursor.get((region, cls.name))
        if at is not None and at >= len(self.candidates(region, cls)):
            return True
        return self.find(region, cls) is None

    def free(self, region: str, cls: ComputeClass) -> Free:
        """What is free in a region of the first resource ``cls`` is short of there: GPUs of its model, vCPUs,
        memory, pods (that order). None short, only spread over nodes: its GPUs (a GPU class) or usable vCPUs.

        A CPU class counts what CPU classes may use (outside the GPU reserve) and the free pods of the region's
        schedulable nodes; a GPU class, the host vCPUs, memory and pods of the nodes that have its GPUs free."""
        if cls.gpu_model is None:
            cpu = self._region_cpu.get(region, 0.0)
            if cpu >= cls.cpu:
                mem = self._region_mem.get(region, 0)
                if mem < cls.memory:
                    return Free(mem, cls.memory, "memory")
                pods = self._region_pods.get(region, 0)
                if pods < 1:
                    return Free(pods, 1, "pods")
            return Free(cpu, cls.cpu, "vCPU")
        gpus = self._region_gpus.get((region, cls.gpu_model), 0)
        if gpus >= cls.gpu_count:
            host_cpu, host_mem, host_pods = 0.0, 0, 0
            for i in self.candidates(region, cls):
                if self.free_gpus[i].get(cls.gpu_model, 0) >= cls.gpu_count:
                    host_cpu += max(0.0, self.free_cpu[i])
                    host_mem += max(0, self.free_mem[i])
                    host_pods += max(0, self.free_pods[i])
            if host_cpu < cls.cpu:
                return Free(host_cpu, cls.cpu, "vCPU")
            if host_mem < cls.memory:
                return Free(host_mem, cls.memory, "memory")
            if host_pods < 1:
                return Free(host_pods, 1, "pods")
        return Free(gpus, cls.gpu_count, "GPU")

    def none_in_region(self, region: str, cls: ComputeClass) -> bool:
        """A GPU class whose GPU model no node of ``region`` has at all: it is not busy, it is not there. (A
        node of the model that is cordoned still counts: it comes back.)"""
        return cls.gpu_model is not None and not self._gpu_nodes(region, cls)[0]

    def too_small(self, region: str, cls: ComputeClass) -> bool:
        """A GPU class whose GPU model nodes of ``region`` have, none of them with the GPUs, vCPUs and memory
        of one instance: no wait helps, a bigger node must join."""
        return cls.gpu_model is not None and self._gpu_nodes(region, cls) == (True, False)

    def _gpu_nodes(self, region: str, cls: ComputeClass) -> tuple[bool, bool]:
        """(some node of ``region`` has the class's GPU model, some node could hold one instance), cordoned or not."""
        key = (region, cls.name)
        found = self._none_of.get(key)
        if found is None:
            model = cls.gpu_model or ""
            nodes = [self.nodes[i] for i in self._by_region.get(region, ()) if self.nodes[i].gpus.get(model, 0) > 0]
            found = self._none_of[key] = (bool(nodes), any(
                n.gpus.get(model, 0) >= cls.gpu_count and n.cpu >= cls.cpu and n.memory >= cls.memory for n in nodes))
        return found

    def amount(self, region: str, cls: ComputeClass, unit: str) -> float:
        """What :meth:`free` would count free of ``unit`` for ``cls``, without building a ``Free``: asked once
        per waiting workload, to see whether a shared attempt's figure still holds."""
        if cls.gpu_model is None:
            if unit == "pods":
                return self._region_pods.get(region, 0)
            return self._region_mem.get(region, 0) if unit == "memory" else self._region_cpu.get(region, 0.0)
        if unit == "GPU":
            return self._region_gpus.get((region, cls.gpu_model), 0)
        return self.free(region, cls).free  # a GPU class short of host vCPUs or memory (rare): counted anew

    def free_amount(self, region: str, cls: ComputeClass) -> float:
        """``free(region, cls).free`` alone: asked once per waiting workload, where a ``Free`` is not needed."""
        if cls.gpu_model is None:
            return self._region_cpu.get(region, 0.0)
        return self._region_gpus.get((region, cls.gpu_model), 0)

    def summary(self, region: str) -> list[ClassCapacity]:
        """For every class in the catalog: how many instances fit in ``region`` now, per node."""
        out = []
        for cls in self.catalog.values():
            per_node = {}
            for i in self.candidates(region, cls):
                n = self.fits(i, cls)
                if n:
                    per_node[self.nodes[i].name] = n
            out.append(ClassCapacity(cls.name, cls.kind.value, sum(per_node.values()), per_node))
        return out

    # -- changes (only shrinking) ---------------------------------------------------

    def take(self, i: int, cls: ComputeClass) -> None:
        """Place one instance of ``cls`` on node ``i``."""
        if self._journal is not None and i not in self._journal:
            self._journal[i] = (self.free_cpu[i], self.free_mem[i], dict(self.free_gpus[i]), self.reserved_cpu[i],
                                self.reserved_mem[i], self.free_pods[i])
        region = self.nodes[i].region
        before, before_mem = self._cpu_usable(i), self._mem_usable(i)
        if self.free_pods[i] > 0:
            self._region_pods[region] = self._region_pods.get(region, 0) - 1
        self._subtract(i, cls)
        if cls.gpu_model is not None and cls.gpu_model in self.reserves:
            reserve = self.reserves[cls.gpu_model]
            self.reserved_cpu[i] -= reserve.cpu * cls.gpu_count
            self.reserved_mem[i] -= reserve.memory * cls.gpu_count
        if cls.gpu_model is not None:
            key = (region, cls.gpu_model)
            self._region_gpus[key] = self._region_gpus.get(key, 0) - cls.gpu_count
        self._region_cpu[region] = self._region_cpu.get(region, 0.0) + self._cpu_usable(i) - before
        self._region_mem[region] = self._region_mem.get(region, 0) + self._mem_usable(i) - before_mem

    def hold(self, region: str, cls: ComputeClass) -> int | None:
        """Hold back, for the rest of the cycle, the node where ``cls`` will fit soonest.

        Used for a starving queue head: nothing else is placed there, so capacity
        freed on it accumulates until the head fits. Returns the node held, if any.

        The soonest is the most free (GPUs of its model, then vCPUs; for a CPU class, usable vCPUs, then
        memory), then the name: kept in a heap per (region, class), so a state kept across cycles finds it
        without going over the region's nodes each cycle. An entry that shrank since it was pushed is
        corrected when it comes to the top; a node that grew is pushed again (:meth:`_grew`).
        """
        key = (region, cls.name)
        heap = self._best.get(key)
        if heap is None or len(heap) > 2 * len(self.candidates(region, cls)) + 16:
            heap = self._best[key] = [self._hold_key(i, cls) for i in self.candidates(region, cls)]
            heapq.heapify(heap)
        aside = []
        chosen = None
        while heap:
            top = heap[0]
            i = top[3]
            current = self._hold_key(i, cls)
            if current != top:
                heapq.heapreplace(heap, current)
            elif i in self.excluded:
                aside.append(heapq.heappop(heap))
            else:
                chosen = i
                break
        for entry in aside:
            heapq.heappush(heap, entry)
        if chosen is not None:
            self.excluded.add(chosen)
        return chosen

    def _hold_key(self, i: int, cls: ComputeClass) -> tuple[float, float, str, int]:
        if cls.gpu_model is None:
            return (-(self.free_cpu[i] - self.reserved_cpu[i]), -float(self.free_mem[i] - self.reserved_mem[i]),
                    self.nodes[i].name, i)
        return (-float(self.free_gpus[i].get(cls.gpu_model, 0)), -self.free_cpu[i], self.nodes[i].name, i)

    # -- deltas (a state kept across cycles: tensora.admission_state) ----------------------
    # Each leaves the figures exactly as a Capacity rebuilt from the same nodes and placed would have them.

    def change(self, i: int, cls: ComputeClass, sign: int) -> None:
        """Count one more (``sign`` 1) or one fewer (-1) instance of ``cls`` placed on node ``i``."""
        self._account(i, -1)
        self.free_cpu[i] -= sign * cls.cpu
        self.free_mem[i] -= sign * cls.memory
        self.free_pods[i] -= sign
        if cls.gpu_model is not None:
            gpus = self.free_gpus[i]
            gpus[cls.gpu_model] = gpus.get(cls.gpu_model, 0) - sign * cls.gpu_count
        self.reserved_cpu[i], self.reserved_mem[i] = self._reserve_cpu(i), self._reserve_mem(i)
        self._account(i, 1)
        if sign < 0:
            self._grew(i)

    def _grew(self, i: int) -> None:
        """Node ``i`` has more room: a cursor past it moves back to it; where holds look, it is pushed again."""
        region = self.nodes[i].region
        for key, at in self._cursor.items():
            if key[0] != region:
                continue
            pos = self._positions(key).get(i)
            if pos is not None and pos < at:
                self._cursor[key] = pos
        for key, heap in self._best.items():
            cls = self.catalog.get(key[1])
            if key[0] == region and cls is not None and i in self._positions(key):
                heapq.heappush(heap, self._hold_key(i, cls))

    def _positions(self, key: tuple[str, str]) -> dict[int, int]:
        found = self._pos.get(key)
        if found is None:
            cls = self.catalog.get(key[1])
            cands = self.candidates(key[0], cls) if cls is not None else []
            found = self._pos[key] = {i: pos for pos, i in enumerate(cands)}
        return found

    def checkpoint(self) -> None:
        """Record from now on what :meth:`take` changes, for :meth:`rollback` (a state kept across cycles
        that decides part of a queue, then finds it must decide more: the same cycle again, over more)."""
        self._journal = {}
        self._totals = (dict(self._region_gpus), dict(self._region_cpu), dict(self._region_mem),
                        dict(self._region_pods))

    def rollback(self) -> None:
        """Undo every take since :meth:`checkpoint`, and the holds."""
        assert self._journal is not None
        for i, (cpu, mem, gpus, rcpu, rmem, pods) in self._journal.items():
            self.free_cpu[i], self.free_mem[i], self.free_gpus[i], self.free_pods[i] = cpu, mem, gpus, pods
            self.reserved_cpu[i], self.reserved_mem[i] = rcpu, rmem
            self._grew(i)
        self._region_gpus, self._region_cpu, self._region_mem, self._region_pods = self._totals
        self._journal = None
        self.excluded = set()
        self._scan = {}

    def commit(self) -> None:
        """Keep what was taken since :meth:`checkpoint`; the holds go."""
        self._journal = None
        self.excluded = set()
        self._scan = {}

    @property
    def regions(self) -> set[str]:
        """The regions that have nodes."""
        return {r for r, members in self._by_region.items() if members}

    def add_node(self, node: Node, placed: Iterable[ComputeClass] = ()) -> int:
        """Add ``node`` (with what is already placed on it); returns its index. Indices never move:
        a removed node keeps its slot, so the order of a region's nodes comes from their names."""
        if node.name in self.index:
            raise ValueError(f"duplicate node name {node.name!r}")
        i = len(self.nodes)
        self.nodes = [*self.nodes, node]  # copies made earlier share the old list
        self.index = {**self.index, node.name: i}
        self.free_cpu.append(node.cpu)
        self.free_mem.append(node.memory)
        self.free_gpus.append(dict(node.gpus))
        self.free_pods.append(_pods(node))
        for cls in placed:
            self._subtract(i, cls)
        self.reserved_cpu.append(self._reserve_cpu(i))
        self.reserved_mem.append(self._reserve_mem(i))
        self._account(i, 1)
        members = self._by_region.setdefault(node.region, [])
        names = [self.nodes[j].name for j in members]
        members.insert(bisect.bisect(names, node.name), i)
        self._forget(node.region)
        return i

    def remove_node(self, name: str) -> None:
        """Drop a node (its slot stays, unreachable)."""
        i = self.index[name]
        self._account(i, -1)
        self.index = {k: v for k, v in self.index.items() if k != name}
        self._by_region[self.nodes[i].region].remove(i)
        self._forget(self.nodes[i].region)

    def _account(self, i: int, sign: int) -> None:
        """Add (1) or withdraw (-1) node ``i``'s free GPUs, usable vCPUs and memory, and free pods to its region's
        totals."""
        node = self.nodes[i]
        if not node.schedulable:
            return
        for model, count in self.free_gpus[i].items():
            key = (node.region, model)
            self._region_gpus[key] = self._region_gpus.get(key, 0) + sign * max(0, count)
        self._region_cpu[node.region] = self._region_cpu.get(node.region, 0.0) + sign * self._cpu_usable(i)
        self._region_mem[node.region] = self._region_mem.get(node.region, 0) + sign * self._mem_usable(i)
        self._region_pods[node.region] = self._region_pods.get(node.region, 0) + sign * max(0, self.free_pods[i])

    def _forget(self, region: str) -> None:
        self._cursor = {k: v for k, v in self._cursor.items() if k[0] != region}
        self._scan = {k: v for k, v in self._scan.items() if k[0] != region}
        self._pos = {k: v for k, v in self._pos.items() if k[0] != region}
        self._best = {k: v for k, v in self._best.items() if k[0] != region}
        self._candidates = {k: v for k, v in self._candidates.items() if k[0] != region}
        self._room = {k: v for k, v in self._room.items() if k != region}
        self._unhostable = {k: v for k, v in self._unhostable.items() if k[0] != region}
        self._none_of = {k: v for k, v in self._none_of.items() if k[0] != region}

    def copy(self) -> Capacity:
        """An independent working copy (admission never changes the caller's)."""
        other = Capacity((), (), self.catalog)  # then made a copy: compiled (tensora.native), no object.__new__
        other.nodes = self.nodes
        other.reserves = self.reserves
        other.index = self.index
        other.free_cpu = list(self.free_cpu)
        other.free_mem = list(self.free_mem)
        other.free_gpus = [dict(g) for g in self.free_gpus]
        other.free_pods = list(self.free_pods)
        other.excluded = set(self.excluded)
        other._cursor = {}
        other._scan = {}
        other._candidates = self._candidates
        other._room = self._room
        other._unhostable = self._unhostable
        other._pos = self._pos
        other._best = {}
        other._journal = None
        other._totals = ({}, {}, {}, {})
        other._by_region = self._by_region
        other.reserved_cpu = list(self.reserved_cpu)
        other.reserved_mem = list(self.reserved_mem)
        other._region_gpus = dict(self._region_gpus)
        other._region_cpu = dict(self._region_cpu)
        other._region_mem = dict(self._region_mem)
        other._region_pods = dict(self._region_pods)
        other._none_of = self._none_of
        return other


def _pods(node: Node) -> int:
    """A node's free pods before anything is placed (:data:`UNLIMITED_PODS` where it has no limit)."""
    return UNLIMITED_PODS if node.pods is None else node.pods
