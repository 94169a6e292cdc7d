"""Compute classes: what a workload can ask for and be placed on.

A class is a GPU class (``kind: gpu``: a GPU model and count, with host vCPUs and
memory) or a CPU class (``kind: cpu``: vCPUs and memory only). The default catalog
ships beside this module; an operator file overrides classes by name and adds new
ones (``replace: true`` at its top drops the defaults instead). Errors name the
file, the line, the class and the field.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from enum import StrEnum
from importlib import resources
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, model_validator

from tensora.config import yamlsource
from tensora.errors import CatalogError
from tensora.names import NAME_PATTERN
from tensora.units import format_memory, parse_memory

CPU_WORD = "cpu"
"""In a fallback list, ``cpu`` stands for a concrete CPU class chosen to fit the workload."""

_NAME = re.compile(NAME_PATTERN)


class Kind(StrEnum):
    GPU = "gpu"
    CPU = "cpu"


@dataclass(frozen=True, slots=True)
class ComputeClass:
    """One compute class. ``gpu_model`` and ``gpu_count`` are set only for GPU classes."""

    name: str
    kind: Kind
    cpu: float
    memory: int
    gpu_model: str | None = None
    gpu_count: int = 0
    gpu_memory: int = 0

    @property
    def is_cpu(self) -> bool:
        return self.kind is Kind.CPU

    def describe(self) -> str:
        host = f"{self.cpu:g} vCPU, {format_memory(self.memory)}"
        if self.kind is Kind.GPU:
            return f"{self.gpu_count}x {self.gpu_model} ({format_memory(self.gpu_memory)}), {host}"
        return host


def _memory(value: object) -> int:
    try:
        return parse_memory(value)
    except ValueError as exc:
        raise ValueError(str(exc)) from None


Memory = Annotated[int, BeforeValidator(_memory)]


class _GpuSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=False)
    model: str = Field(min_length=1, max_length=64)
    count: int = Field(ge=1, le=64)
    memory: Memory = Field(gt=0)


class _ClassSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    kind: Literal["gpu", "cpu"]
    cpu: float = Field(gt=0, le=4096)
    memory: Memory = Field(gt=0)
    gpu: _GpuSpec | None = None

    @model_validator(mode="after")
    def _check(self) -> _ClassSpec:
        if not _NAME.match(self.name):
            raise ValueError(f"name {self.name!r} must be lower-case letters, digits and dashes")
        if self.name == CPU_WORD:
            raise ValueError("'cpu' is reserved: in a fallback list it means any fitting CPU class")
        if self.kind == "gpu" and self.gpu is None:
            raise ValueError("a gpu class needs a gpu: {model, count, memory}")
        if self.kind == "cpu" and self.gpu is not None:
            raise ValueError("a cpu class has no gpu field")
        return self

    def build(self) -> ComputeClass:
        if self.gpu is None:
            return ComputeClass(self.name, Kind.CPU, self.cpu, self.memory)
        return ComputeClass(
            self.name, Kind.GPU, self.cpu, self.memory, self.gpu.model, self.gpu.count, self.gpu.memory
        )


class _CatalogFile(BaseModel):
    model_config = ConfigDict(extra="forbid")
    replace: bool = False
    classes: list[_ClassSpec]


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

    def __iter__(self) -> Iterator[str]:
        return iter(self._classes)

    def __len__(self) -> int:
        return len(self._classes)

    def check_entry(self, entry: str) -> None:
        """Raise KeyError unless ``entry`` is a class name or the word ``cpu``."""
        if entry != CPU_WORD and entry not in self._classes:
            raise KeyError(entry)


def _parse(text: str, source: str) -> _CatalogFile:
    data, lines = yamlsource.load_text(text, source, CatalogError)
    if not isinstance(data, dict):
        raise CatalogError("expected a mapping with a 'classes' list", source=source, line=1)
    names: dict[str, int] = {}
    for i, item in enumerate(data.get("classes") or []):
        name = item.get("name") if isinstance(item, dict) else None
        if isinstance(name, str):
            if name in names:
                raise CatalogError(
                    f"duplicate class name {name!r} (first at line {names[name]})",
                    source=source, line=lines.line(("classes", i, "name")), field=f"classes[{i}].name",
                )
            names[name] = lines.line(("classes", i, "name")) or 0

    def describe(path: tuple[str | int, ...]) -> str:
        if len(path) >= 2 and path[0] == "classes" and isinstance(path[1], int):
            items = data.get("classes") or []
            item: Any = items[path[1]] if path[1] < len(items) else None
            if isinstance(item, dict) and isinstance(item.get("name"), str):
                return f"class {item['name']}"
        return ""

    try:
        return _CatalogFile.model_validate(data)
    except ValidationError as exc:
        raise yamlsource.validation_error(
            exc, source=source, lines=lines, error=CatalogError, describe=describe
        ) from None


def default_catalog() -> Catalog:
    """The catalog shipped with Tensora."""
    text = resources.files("tensora").joinpath("default_catalog.yaml").read_text(encoding="utf-8")
    return Catalog(spec.build() for spec in _parse(text, "<default catalog>").classes)


def load_catalog(path: Path | str | None = None) -> Catalog:
    """The default catalog, overridden by the operator's file at ``path`` when given."""
    base = default_catalog()
    if path is None:
        return base
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise CatalogError(f"cannot read catalog: {exc.strerror or exc}", source=str(path)) from None
    parsed = _parse(text, str(path))
    merged: dict[str, ComputeClass] = {} if parsed.replace else dict(base.items())
    for spec in parsed.classes:
        merged[spec.name] = spec.build()
    return Catalog(merged.values())
