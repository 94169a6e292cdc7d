"""The create-workload body, shared by the control API and the simulated fleet's workloads.yaml.

Validation names the field. Every field is bounded (a body is every owner's to send, and the controller
and gateway read what it stores): names are DNS labels, lists are short, and ``spec`` is at most
:data:`SPEC_MAX_BYTES` of JSON holding only the keys its kind uses (:data:`KIND_SPECS`). A spec is
checked against a catalog by :func:`check_against`: ``gpu_class`` must be a class, each ``fallback``
entry a class or the word ``cpu``, and ``spec`` keys the kind's.
"""

from __future__ import annotations

from typing import Annotated, Any

import orjson
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

from tensora.config.wording import in_words
from tensora.errors import SpecError
from tensora.names import NAME_PATTERN
from tensora.placement.catalog import CPU_WORD, Catalog
from tensora.placement.kinds import WorkloadKind
from tensora.units import format_memory, parse_duration, parse_params

_NAME = NAME_PATTERN
SPEC_MAX_BYTES = 16 * 1024

KindSettings = dict[str, object]
"""A kind's own settings (a workload's ``spec``), a JSON object kept as given: ``KIND_SPECS`` names its keys."""
"""The most ``spec`` may hold, as compact JSON: the controller and gateway read it back."""
Label = Annotated[str, Field(pattern=_NAME)]
"""A DNS label: a class, a region, an endpoint's name."""


class EndpointSpec(BaseModel):
    """The ``spec`` keys of an endpoint (the gateway reads them from the route table)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    serverless: bool = Field(default=False, description="admin keys only: a shared endpoint of the serverless "
                                                        "pool, which every owner's requests for its model may reach")
    ttft_deadline_s: float | None = Field(default=None, gt=0, le=600, description=(
        "seconds to the first token before the gateway tries the next backend"))
    stream_idle_s: float | None = Field(default=None, gt=0, le=600, description=(
        "seconds a stream may go without an event after its first token before the gateway ends it with "
        "an error event (the gateway's default: 30)"))


class NoSpec(BaseModel):
    """Notebooks and VMs take no ``spec`` keys (their settings are the top-level fields)."""

    model_config = ConfigDict(extra="forbid", strict=True)


KIND_SPECS: dict[WorkloadKind, type[BaseModel]] = {
    WorkloadKind.ENDPOINT: EndpointSpec, WorkloadKind.NOTEBOOK: NoSpec, WorkloadKind.VM: NoSpec}
_A_KIND = {WorkloadKind.ENDPOINT: "an endpoint", WorkloadKind.NOTEBOOK: "a notebook", WorkloadKind.VM: "a vm"}


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
    gpu_class: Label
    fallback: list[Label] = Field(default_factory=list, max_length=8)
    fallback_after_s: Duration = Field(default=0.0, ge=0, le=30 * 86400)
    model: str | None = Field(default=None, max_length=512, description=(
        "endpoints: a safetensors model (file or directory) by its name in your files (tensora files upload), "
        "such as tiny, or an operator's shared model as shared/<root>/<path>; never a path on the server"))
    model_params: Params | None = Field(default=None, ge=0, le=10**14,
                                        description="endpoints: parameter count, e.g. 7B")
    model_bytes: int | None = Field(default=None, ge=0, le=2**50)
    fallback_models: list[Label] = Field(default_factory=list, max_length=4, description=(
        "endpoints: the names of other endpoints of yours (or serverless models) to try, in order"))
    allow_cross_region: bool = False
    image: str | None = Field(default=None, max_length=512, description=(
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
    spec: KindSettings = Field(default_factory=dict, description=(
        "kind-specific settings (kept as given), at most 16 KiB of JSON: endpoints take serverless, "
        "ttft_deadline_s and stream_idle_s; notebooks and vms take none"))

    @field_validator("spec")
    @classmethod
    def _spec_size(cls, value: KindSettings) -> KindSettings:
        try:
            size = len(orjson.dumps(value))
        except orjson.JSONEncodeError:  # JSON parses integers of any size; the store keeps 64 bits: refused here
            raise ValueError("holds a number that is not a 64-bit integer or a float") from None
        if size > SPEC_MAX_BYTES:
            raise ValueError(f"at most {SPEC_MAX_BYTES} bytes of JSON ({format_memory(SPEC_MAX_BYTES)}); this one is "
                             f"{size}")
        return value

    @field_validator("fallback_models")
    @classmethod
    def _fallback_models(cls, value: list[str]) -> list[str]:
        if len(set(value)) != len(value):
            raise ValueError("fallback_models lists a model twice")
        return value

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
        defaults: dict[str, object] = {"fallback_models": [], "allow_cross_region": False, "replicas": 1}
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
        raise SpecError(in_words(first), source=source, field=field) from None


def check_against(spec: WorkloadSpec, catalog: Catalog) -> list[tuple[str, str]]:
    """Problems of ``spec`` with respect to ``catalog`` as (field, message); empty when fine."""
    problems = []
    if spec.gpu_class not in catalog:
        problems.append(("gpu_class", f"unknown class {spec.gpu_class!r}; see the catalog"))
    for i, entry in enumerate(spec.fallback):
        if entry != CPU_WORD and entry not in catalog:
            problems.append((f"fallback[{i}]", f"unknown class {entry!r}: use a class name or 'cpu'"))
    return problems + check_kind_spec(spec.kind, spec.spec)


def check_kind_spec(kind: WorkloadKind, spec: KindSettings) -> list[tuple[str, str]]:
    """Problems of a ``spec`` for ``kind`` as (field, message): ``spec.foo: unknown field for an endpoint``."""
    try:
        KIND_SPECS[kind].model_validate(spec)
    except ValidationError as exc:
        keys = ", ".join(KIND_SPECS[kind].model_fields)
        known = f"its spec keys: {keys}" if keys else f"{_A_KIND[kind]} takes no spec keys"
        problems = []
        for e in exc.errors():
            field = "spec." + ".".join(str(p) for p in e["loc"])
            if e["type"] == "extra_forbidden":
                problems.append((field, f"unknown field for {_A_KIND[kind]} ({known})"))
            else:
                problems.append((field, e["msg"]))
        return problems
    return []
