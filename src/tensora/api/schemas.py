"""Shapes of request and response bodies, for validation and for the OpenAPI document."""

from __future__ import annotations

from enum import StrEnum
from typing import TYPE_CHECKING, Annotated, Any, Literal, TypeAlias

from pydantic import BaseModel, ConfigDict, Field, create_model

from tensora.config.quotas import Limits, Quotas
from tensora.keys.apikeys import SCOPES
from tensora.placement.kinds import ReplicaRole, WorkloadKind, WorkloadState


def pattern(enum: type[StrEnum]) -> str:
    """A query parameter's pattern that admits an enum's values (``^(queued|starting|...)$``)."""
    return f"^({'|'.join(enum)})$"


if TYPE_CHECKING:
    Kind: TypeAlias = str
    State: TypeAlias = str
    Role: TypeAlias = str
else:  # a Literal of the values, so the OpenAPI document lists them inline (an enum type would be a component)
    Kind, State, Role = (Literal[tuple(m.value for m in e)] for e in (WorkloadKind, WorkloadState, ReplicaRole))


class ErrorDetail(BaseModel):
    type: str
    message: str
    field: str | None = None


class ErrorOut(BaseModel):
    error: ErrorDetail


class Condition(BaseModel):
    type: Literal["degraded", "moving", "crash_loop"]
    reason: str = Field(description="cpu_fallback, class_fallback, move_back, back_off")
    message: str
    count: int | None = Field(None, description="crash_loop: its replicas' failures in a row (only there)",
                              exclude_if=lambda v: v is None)


class ReplicaOut(BaseModel):
    id: str
    class_: str = Field(alias="class")
    node: str
    state: str
    url: str | None
    role: Role


class WorkloadOut(BaseModel):
    """A workload. ``gpu_class`` (= ``requested_class``) is what was asked for; ``placed_class`` what runs."""

    id: str
    name: str
    kind: Kind
    owner: str
    region: str
    state: State
    gpu_class: str
    requested_class: str
    placed_class: str | None
    fallback: list[str]
    fallback_after_s: float
    placement: Literal["policy", "requested"]
    conditions: list[Condition]
    reason: str = Field(description="why it is in its state, e.g. 'placed on cpu-16c-64g: l40s-48gb unavailable "
                                    "for 10m', 'waiting for l40s-48gb (0 GPU free, 1 needed); ...', "
                                    "'stopped by its owner'")
    fallback_eligible_at: str | None
    restart_available: bool
    restart_reason: str | None
    created_at: str
    updated_at: str
    queued_since: str | None
    warning: str | None = Field(default=None, description="set when a GPU class is asked for and the fallback "
                                                          "list holds a CPU class: what CPU means for the kind "
                                                          "(endpoints: serving roughly 10-50x slower; notebooks "
                                                          "and VMs: no GPU)")
    warnings: list[str] = Field(default_factory=list, description=(
        "the create answer only: what to know now, e.g. 'this region has no l40s-48gb (0 of 0); it waits "
        "until one is added, or add a fallback', and the CPU warning"))
    replicas: list[ReplicaOut] | None = None
    access: dict[str, Any] | None = None
    spec: dict[str, Any] = Field(default_factory=dict, description="kind-specific settings, as given")
    model: str | None = Field(default=None, description="endpoints: the safetensors model")
    model_params: int | None = Field(default=None, description="endpoints: parameters, read from the model")
    fallback_models: list[str] | None = None
    allow_cross_region: bool | None = None
    image: str | None = Field(default=None, description="vms: disk image path")


class WorkloadList(BaseModel):
    data: list[WorkloadOut]
    next: str | None = Field(description="pass as ?after= for the next page")


class EventOut(BaseModel):
    id: int
    at: str
    type: str
    from_state: str | None
    to_state: str | None
    reason: str
    count: int = Field(1, description="times it happened in a row, identically (a crash loop's repeats)")
    last_at: str | None = Field(None, description="when it last happened, if more than once")


class EventList(BaseModel):
    data: list[EventOut]


class RestartBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    placement: Literal["requested", "policy"] = Field(
        default="policy", description="requested: only the requested class (restart on GPU); policy: the class, "
                                      "then its fallback list")


OWNER_PATTERN = r"^[A-Za-z0-9._@-]+$"


class KeyCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(default="key", min_length=1, max_length=128, pattern=r"^[^\x00-\x1f\x7f]+$",
                      description="a label for you; no control characters")
    owner: str | None = Field(default=None, min_length=1, max_length=128, pattern=OWNER_PATTERN,
                              description="admin keys only: create a key for this owner")
    scopes: list[Literal[SCOPES]] | None = Field(  # type: ignore[valid-type]
        default=None, max_length=len(SCOPES),
        description="default: the default scopes (workloads, usage, inference) that the calling key holds")
    requests_per_minute: int | None = Field(
        default=None, ge=1, le=2_000_000_000,
        description="admin keys only: the gateway's limit for this key, under its owner's (which holds across all "
                    "the owner's keys); default: the owner's")
    tokens_per_minute: int | None = Field(
        default=None, ge=1, le=2_000_000_000,
        description="admin keys only: tokens (prompt + max_tokens reserved, settled to what was used) per minute "
                    "at the gateway, under its owner's")


def _patch(model: type[BaseModel], doc: str) -> type[BaseModel]:
    """``model`` with every field optional and the same bounds: a partial override, where null (as opposed to
    absent) returns a field to the server's default."""
    fields: dict[str, Any] = {
        name: (Annotated[f.annotation, *f.metadata] | None, Field(default=None, description=f.description))
        for name, f in model.model_fields.items()}
    strict = ConfigDict(extra="forbid", strict=True)  # a count is a number: not true, not "20"
    patch: type[BaseModel] = create_model(model.__name__ + "Patch", __config__=strict, __doc__=doc, **fields)
    return patch


QuotasPatch = _patch(Quotas, "Quotas to override (absent: unchanged; null: the server's default).")
LimitsPatch = _patch(Limits, "Gateway limits to override (absent: unchanged; null: the server's default).")


class OwnerUpdate(BaseModel):
    """A PUT changes only what it names: a field absent keeps its stored value, a field set to null returns it
    to the server's default (``"quotas": null``: every quota). ``{"trusted": true}`` alone works as before."""

    model_config = ConfigDict(extra="forbid")

    trusted: bool | None = Field(default=None, description="true: this owner's notebook and endpoint pods run "
                                 "without the Kata runtime (Kubernetes driver). Every owner is untrusted (Kata) "
                                 "unless an admin sets this; VMs are isolated either way. New replicas only: a "
                                 "restart moves a running workload. Absent or null: unchanged")
    quotas: QuotasPatch | None = Field(  # type: ignore[valid-type]
        default=None, description="keys, workloads, running_gpus, running_cpu, storage_bytes: any subset")
    limits: LimitsPatch | None = Field(  # type: ignore[valid-type]
        default=None, description="requests_per_minute, tokens_per_minute (the gateway's, across all the owner's "
                                  "keys), creates_per_minute, deletes_per_minute, uploads_per_minute (the control "
                                  "API's): any subset")


class InUse(BaseModel):
    keys: int = Field(description="live API keys")
    workloads: int = Field(description="workloads not deleted")
    storage_bytes: int = Field(description="bytes of its files")


class OwnerOut(BaseModel):
    owner: str
    trusted: bool = Field(description="false (the default for every owner): its pods run under Kata on Kubernetes")
    updated_at: str | None = Field(description="when the operator last set it; null: never (the defaults)")
    quotas: Quotas = Field(description="what it may hold: its overrides over the server's defaults")
    limits: Limits = Field(description="its gateway limits (across all its keys) and control API rates: "
                                       "overrides over the defaults")
    overridden: list[str] = Field(description="the fields an admin set for this owner, e.g. quotas.keys; the "
                                              "rest follow the server's defaults")
    in_use: InUse = Field(description="what it holds now, counted against its quotas")


class OwnerList(BaseModel):
    data: list[OwnerOut]


class CurrentKeyOut(BaseModel):
    id: str = Field(description="the key's id (key_...), or the dashboard session's key")
    owner: str
    scopes: list[str]
    admin: bool = Field(description="whether the key holds the admin scope: it sees and manages every owner's")


class KeyOut(BaseModel):
    id: str
    name: str
    owner: str
    scopes: list[str]
    hint: str
    created_at: str
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    key: str | None = Field(default=None, description="the secret: shown once, in the response that creates it")
    secret_withheld: bool = Field(default=False, description="true in a replay of a create (the same "
                                  "Idempotency-Key): the key exists, its secret was shown once, in the first "
                                  "response, and is stored nowhere; if that response was lost, revoke the key")


class KeyList(BaseModel):
    data: list[KeyOut]


class ClassOut(BaseModel):
    name: str
    kind: Literal["gpu", "cpu"]
    cpu: float
    memory: str
    disk: str = Field(description="the largest virtual size of a VM's disk image on this class")
    gpu: dict[str, Any] | None
    capacity: dict[str, dict[str, int]] = Field(description="per region: free and total instances that fit")
    short: dict[str, str] = Field(default_factory=dict, description=(
        "per region where none fits now: what is short, with its figures, e.g. '1.5Gi memory free, 8Gi "
        "needed', '0 GPU free, 1 needed', 'this region has none'"))


class CatalogOut(BaseModel):
    region: str
    data: list[ClassOut]
    note: str
    isolation: Literal["sandbox", "none", "admin-only"] | None = Field(
        default=None, description="how this server's local driver isolates replicas: 'sandbox' (each in its own "
        "sandbox), 'none' (the operator chose to run them unsandboxed), 'admin-only' (this host cannot sandbox: "
        "only the admin owner's workloads run); null for other drivers")


class UsageRow(BaseModel):
    placed_class: str | None = None
    owner: str | None = None
    day: str | None = None
    kind: str | None = None
    seconds: float
    hours: float


class UsageOut(BaseModel):
    since: str
    until: str
    group_by: list[str]
    data: list[UsageRow]
    total_seconds: float


class TokenUsageRow(BaseModel):
    owner: str
    endpoint: str = Field(description="the endpoint the requests named")
    product: str = Field(description="endpoint (its own replicas), serverless, fallback-model or cross-region")
    model: str = Field(description="the model that answered")
    served_by: str
    requests: int
    prompt_tokens: int
    completion_tokens: int


class TokenUsageOut(BaseModel):
    since: str
    until: str
    data: list[TokenUsageRow]


class UsageRecord(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9._-]+$",
                    description="made by the gateway (random): a record sent twice is counted once")
    client_request_id: str | None = Field(default=None, min_length=1, max_length=64, pattern=r"^[A-Za-z0-9._-]+$",
                                          description="the X-Request-Id the client was answered with: stored, "
                                          "never used to deduplicate")
    at: float = Field(ge=0, le=1e11, description="epoch seconds")
    owner: str = Field(max_length=128)
    key_id: str = Field(max_length=32)
    endpoint: str = Field(max_length=63)
    endpoint_id: str | None = Field(default=None, max_length=32)
    product: Literal["endpoint", "serverless", "fallback-model", "cross-region"]
    answered_by: str | None = Field(default=None, max_length=32)
    model: str = Field(max_length=128)
    served_by: str = Field(max_length=32)
    region: str = Field(max_length=63)
    prompt_tokens: int = Field(ge=0, le=2_000_000_000)
    completion_tokens: int = Field(ge=0, le=2_000_000_000)
    status: int = Field(ge=100, le=599)


class UsageBatch(BaseModel):
    model_config = ConfigDict(extra="forbid")

    records: list[UsageRecord] = Field(max_length=1000, description="at most 1000 a batch (under the 1 MiB "
                                       "body limit)")


class UsageBatchOut(BaseModel):
    received: int
    new: int
