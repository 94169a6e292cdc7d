"""The route document: what ``GET /v1/gateway/routes`` answers, one schema for both of its sides.

The control API builds it (``tensora.api.gatewayroutes``) and the gateway reads it into its
:class:`~tensora.gateway.routes.RouteTable` (``table_from_json``); mypy holds both to these types. They are
TypedDicts, not models: the document is plain JSON on the wire and in the gateway's cache file, and the gateway
reads it with no validation library on its path (a table of thousands of endpoints is read every change).
Keys marked ``NotRequired`` may be missing from a control API older than them; the gateway reads them with a
default. (No ``from __future__ import annotations`` here: TypedDict reads ``NotRequired`` only from real types.)
"""

from typing import NotRequired, TypedDict


class ReplicaDoc(TypedDict):
    id: str
    url: str  # the runtime's OpenAI base URL, ending in /v1
    cls: str
    cpu: bool  # placed on a CPU class
    upstream_model: str | None  # the model id the runtime answers to (None: an endpoint with no model yet)
    api_key: NotRequired[str]  # the replica's own key (local driver), sent upstream; only gateways read this


class EndpointDoc(TypedDict):
    id: str
    name: str
    owner: str
    region: str
    model: str | None  # the shared model's host path: what the serverless pool matches by
    requested_cpu: NotRequired[bool]
    cpu_fallback: NotRequired[bool]  # its fallback list uses CPU (tensora.placement.fallback.uses_cpu)
    fallback_models: NotRequired[list[str]]
    allow_cross_region: NotRequired[bool]
    serverless: NotRequired[bool]
    ttft_s: NotRequired[float | None]
    stream_idle_s: NotRequired[float | None]
    context: NotRequired[int | None]
    replicas: NotRequired[list[ReplicaDoc]]


class KeyDoc(TypedDict):
    id: str
    digest: str  # SHA-256 of the secret: the gateway checks keys without the store, never holding one
    owner: str
    scopes: list[str]
    rpm: int | None
    tpm: int | None


class OwnerDoc(TypedDict):
    owner: str
    requests_per_minute: int
    tokens_per_minute: int


class RouteDocument(TypedDict):
    version: str  # a hash of the rest: the ETag
    region: NotRequired[str]
    endpoints: list[EndpointDoc]
    keys: list[KeyDoc]
    owners: NotRequired[list[OwnerDoc]]
