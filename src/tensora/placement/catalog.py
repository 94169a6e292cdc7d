"""Compute classes: what a workload can ask for and be placed on.

A class is a GPU class (``kind: gpu``: a GPU model and count, with host vCPUs and
memory) or a CPU class (``kind: cpu``: vCPUs and memory only). These are the values;
the catalog files people write (and the default one) are read by ``tensora.config.catalog``.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from enum import StrEnum

from tensora.errors import CatalogError
from tensora.units import format_memory

DEFAULT_DISK = 50 * 2**30
"""A class's disk cap where its catalog entry names none: the largest virtual size of a VM's disk image."""
CPU_WORD = "cpu"
"""In a fallback list, ``cpu`` stands for a concrete CPU class chosen to fit the workload."""


class Kind(StrEnum):
    GPU = "gpu"
    CPU = "cpu"


@dataclass(frozen=True, slots=True)
class ComputeClass:
    """One compute class. ``gpu_model`` and ``gpu_count`` are set only for GPU classes. ``disk``: the largest
    virtual size of a VM's disk on it (its overlay grows up to that)."""

    name: str
    kind: Kind
    cpu: float
    memory: int
    gpu_model: str | None = None
    gpu_count: int = 0
    gpu_memory: int = 0
    disk: int = DEFAULT_DISK

    @property
    def is_cpu(self) -> bool:
        return self.kind is Kind.CPU

    def describe(self) -> str:
        host = f"{self.cpu:g} vCPU, {format_memory(self.memory)}"
        if self.kind is Kind.GPU:
            return f"{self.gpu_count}x {self.gpu_model} ({format_memory(self.gpu_memory)}), {host}"
        return host


class Catalog(Mapping[str, ComputeClass]):
    """Classes by name, in catalog order; CPU classes also listed smallest first."""

    def __init__(self, classes: Iterable[ComputeClass]) -> None:
        self._classes: dict[str, ComputeClass] = {}
        for cls in classes:
            if cls.name in self._classes:
                raise CatalogError("duplicate class name", field=cls.name)
            self._classes[cls.name] = cls
        self.cpu_classes: tuple[ComputeClass, ...] = tuple(
            sorted((c for c in self._classes.values() if c.is_cpu), key=lambda c: (c.cpu, c.memory, c.name))
        )
        self.gpu_models: frozenset[str] = frozenset(
            c.gpu_model for c in self._classes.values() if c.gpu_model is not None
        )

    def __getitem__(self, name: str) -> ComputeClass:
        return self._classes[name]

    def get(self, name: str, default: ComputeClass | None = None) -> ComputeClass | None:  # type: ignore[override]
        """The dict's own lookup: Mapping's ``get`` goes through ``__getitem__`` and a try, and
        admission asks once or more per workload."""
        return self._classes.get(name, default)

    def __contains__(self, name: object) -> bool:
        return name in self._classes

    def __iter__(self) -> Iterator[str]:
        return iter(self._classes)

    def __len__(self) -> int:
        return len(self._classes)

    def check_entry(self, entry: str) -> None:
        """Raise KeyError unless ``entry`` is a class name or the word ``cpu``."""
        if entry != CPU_WORD and entry not in self._classes:
            raise KeyError(entry)


def entry_classes(entry: str, catalog: Catalog) -> tuple[ComputeClass, ...]:
    """The classes a fallback-list entry stands for: every CPU class (smallest first) for the word ``cpu``,
    else the class it names (none where the catalog has no such class)."""
    if entry == CPU_WORD:
        return catalog.cpu_classes
    cls = catalog.get(entry)
    return () if cls is None else (cls,)
