"""The create-workload body, shared by the control API and the simulated fleet's workloads.yaml.

Validation names the field. A spec is checked against a catalog by :func:`check_against`:
``gpu_class`` must be a class, each ``fallback`` entry a class or the word ``cpu``.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from tensora.admission import WorkloadKind
from tensora.catalog import CPU_WORD, Catalog
from tensora.errors import SpecError
from tensora.units import parse_duration, parse_params

_NAME = r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$"


def _duration(value: object) -> float:
    return parse_duration(value)


def _params(value: object) -> int:
    return parse_params(value)


Duration = Annotated[float, BeforeValidator(_duration)]
Params = Annotated[int, BeforeValidator(_params)]


class WorkloadSpec(BaseModel):
    """What a user asks for. ``fallback_after`` (``"10m"``, ``"90s"``, ``0``) sets ``fallback_after_s``."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    kind: WorkloadKind
    name: str = Field(pattern=_NAME)
    owner: str = Field(default="default", min_length=1, max_length=128)
    region: str = Field(default="local", pattern=_NAME)
    gpu_class: str = Field(min_length=1)
    fallback: list[str] = Field(default_factory=list, max_length=16)
    fallback_after_s: Duration = 0.0
    model: str | None = Field(default=None, description=(
        "endpoints: a safetensors model (file or directory) by its name in your files (tensora files upload), "
        "such as tiny, or an operator's shared model as shared/<root>/<path>; never a path on the server"))
    model_params: Params | None = Field(default=None, ge=0, description="endpoints: parameter count, e.g. 7B")
    model_bytes: int | None = Field(default=None, ge=0)
    fallback_models: list[str] = Field(default_factory=list, max_length=16)
    allow_cross_region: bool = False
    image: str | None = Field(default=None, description=(
        "vms: the disk image (qcow2 or raw) to boot, by its name in your files or as shared/<root>/<path>"))

    @model_validator(mode="before")
    @classmethod
    def _fallback_after(cls, data: Any) -> Any:
        if isinstance(data, dict) and "fallback_after" in data:
            data = dict(data)
            if "fallback_after_s" in data:
                raise ValueError("give fallback_after or fallback_after_s, not both")
            data["fallback_after_s"] = data.pop("fallback_after")
        return data

    replicas: int = Field(default=1, ge=1, le=16, description="endpoints: how many replicas to run")
    spec: dict[str, Any] = Field(default_factory=dict, description="kind-specific settings (kept as given)")

    @field_validator("fallback")
    @classmethod
    def _fallback_list(cls, value: list[str], info: ValidationInfo) -> list[str]:
        if len(set(value)) != len(value):
            raise ValueError("fallback lists a class twice")
        if info.data.get("gpu_class") in value:
            raise ValueError("fallback must not repeat gpu_class")
        return value

    @field_validator("model", "model_params", "model_bytes", "fallback_models", "allow_cross_region", "replicas")
    @classmethod
    def _endpoint_only(cls, value: Any, info: ValidationInfo) -> Any:
        defaults: dict[str, Any] = {"fallback_models": [], "allow_cross_region": False, "replicas": 1}
        kind = info.data.get("kind")
        if kind is not None and kind != WorkloadKind.ENDPOINT and value != defaults.get(str(info.field_name)):
            raise ValueError(f"{info.field_name} is for endpoints only")
        return value

    @field_validator("image")
    @classmethod
    def _vm_only(cls, value: str | None, info: ValidationInfo) -> str | None:
        kind = info.data.get("kind")
        if kind is not None and kind != WorkloadKind.VM and value is not None:
            raise ValueError("image is for vms only")
        return value

    @model_validator(mode="after")
    def _check(self) -> WorkloadSpec:
        if self.model_params is not None and self.model_bytes is None:
            self.model_bytes = self.model_params * 2  # 16-bit weights unless told otherwise
        return self


def parse_spec(data: object, source: str = "<request>") -> WorkloadSpec:
    """Validate a create body; a SpecError names the first bad field."""
    try:
        return WorkloadSpec.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        field = ".".join(str(p) for p in first["loc"]) or None
        message = "unknown field" if first["type"] == "extra_forbidden" else first["msg"]
        raise SpecError(message, source=source, field=field) from None


def check_against(spec: WorkloadSpec, catalog: Catalog) -> list[tuple[str, str]]:
    """Problems of ``spec`` with respect to ``catalog`` as (field, message); empty when fine."""
    problems = []
    if spec.gpu_class not in catalog:
        problems.append(("gpu_class", f"unknown class {spec.gpu_class!r}; see the catalog"))
    for i, entry in enumerate(spec.fallback):
        if entry != CPU_WORD and entry not in catalog:
            problems.append((f"fallback[{i}]", f"unknown class {entry!r}: use a class name or 'cpu'"))
    return problems
