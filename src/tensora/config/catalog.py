"""Catalog files: the default catalog (``default_catalog.yaml`` beside this module) and an operator's file, read
into :class:`~tensora.placement.catalog.Catalog`. An operator file overrides classes by name and adds new ones
(``replace: true`` at its top drops the defaults instead). Errors name the file, the line, the class and the field.
"""

from __future__ import annotations

import re
from importlib import resources
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, model_validator

from tensora.config import yamlsource
from tensora.errors import CatalogError
from tensora.names import NAME_PATTERN
from tensora.placement.catalog import CPU_WORD, DEFAULT_DISK, Catalog, ComputeClass, Kind
from tensora.units import parse_memory

_NAME = re.compile(NAME_PATTERN)


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
    disk: Memory = Field(default=DEFAULT_DISK, gt=0, description="the largest virtual size of a VM's disk image")
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
            return ComputeClass(self.name, Kind.CPU, self.cpu, self.memory, disk=self.disk)
        return ComputeClass(
            self.name, Kind.GPU, self.cpu, self.memory, self.gpu.model, self.gpu.count, self.gpu.memory, self.disk
        )


class _CatalogFile(BaseModel):
    model_config = ConfigDict(extra="forbid")
    replace: bool = False
    classes: list[_ClassSpec]


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
    text = resources.files("tensora.config").joinpath("default_catalog.yaml").read_text(encoding="utf-8")
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
