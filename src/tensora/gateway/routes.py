"""The route table: what the gateway knows of endpoints, replicas, keys and peers.

It comes from the control API (``GET /v1/gateway/routes``), is kept in memory and written to
disk, and the gateway serves from the last one it has while the control API is down.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from tensora.gateway.routedoc import RouteDocument


@dataclass(frozen=True, slots=True)
class ReplicaRoute:
    id: str
    url: str  # the runtime's OpenAI base URL, ending in /v1
    cls: str
    cpu: bool  # placed on a CPU class
    upstream_model: str | None  # the model id this runtime answers to (None: an endpoint made with no model)
    api_key: str | None = None  # the replica's own key, sent upstream as its Authorization (only the gateway has it)


@dataclass(frozen=True, slots=True)
class EndpointRoute:
    id: str
    name: str
    owner: str
    region: str
    model: str | None  # the model's path: the serverless pool is matched by it
    requested_cpu: bool  # the endpoint asked for a CPU class (its CPU replicas are not a fallback)
    cpu_fallback: bool  # it accepts CPU classes in its fallback list
    fallback_models: tuple[str, ...] = ()
    allow_cross_region: bool = False
    serverless: bool = False  # operator-run, shared by all users
    ttft_s: float | None = None  # time-to-first-token deadline per attempt; None: the gateway's default
    stream_idle_s: float | None = None  # after the first token, the longest gap between events; None: default
    context: int | None = None  # the model's context length (tokens, prompt and answer), when its config says
    replicas: tuple[ReplicaRoute, ...] = ()


@dataclass(frozen=True, slots=True)
class KeyRoute:
    id: str
    owner: str
    scopes: tuple[str, ...]
    rpm: int | None = None
    tpm: int | None = None


@dataclass(frozen=True, slots=True)
class OwnerRoute:
    """An owner's gateway limits, shared by all its keys (effective values: the control API applied the
    defaults). An owner missing from the table gets the gateway's own ``requests_per_minute`` /
    ``tokens_per_minute``, as with a control API from before owners' limits."""

    owner: str
    rpm: int
    tpm: int


@dataclass(frozen=True, slots=True)
class RouteTable:
    version: str = ""
    region: str = ""
    endpoints: tuple[EndpointRoute, ...] = ()
    keys: Mapping[str, KeyRoute] = field(default_factory=dict)  # by key digest
    owners: Mapping[str, OwnerRoute] = field(default_factory=dict)  # by owner
    by_name: Mapping[tuple[str, str], EndpointRoute] = field(default_factory=dict)  # (owner, name)
    serverless: Mapping[str, EndpointRoute] = field(default_factory=dict)  # by public name
    serverless_by_model: Mapping[str, tuple[EndpointRoute, ...]] = field(default_factory=dict)

    def resolve(self, owner: str, name: str) -> EndpointRoute | None:
        """What ``model`` names for this caller: its own endpoint first, then a serverless model."""
        return self.by_name.get((owner, name)) or self.serverless.get(name)

    def visible(self, owner: str) -> list[EndpointRoute]:
        own = [e for e in self.endpoints if e.owner == owner and not e.serverless]
        return own + list(self.serverless.values())


def _context(v: Any) -> int | None:
    """A known context length, or None (an older control API, or nothing usable)."""
    return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None


def table_from_json(data: RouteDocument) -> RouteTable:
    """The table of a route document (``tensora.gateway.routedoc``), read with plain lookups: no validation library
    on the gateway's path; a missing optional key reads as its default."""
    endpoints = tuple(
        EndpointRoute(
            id=e["id"], name=e["name"], owner=e["owner"], region=e["region"], model=e.get("model"),
            requested_cpu=bool(e.get("requested_cpu")), cpu_fallback=bool(e.get("cpu_fallback")),
            fallback_models=tuple(e.get("fallback_models") or ()), allow_cross_region=bool(e.get("allow_cross_region")),
            serverless=bool(e.get("serverless")), ttft_s=e.get("ttft_s"), stream_idle_s=e.get("stream_idle_s"),
            context=_context(e.get("context")),
            replicas=tuple(ReplicaRoute(r["id"], r["url"].rstrip("/"), r["cls"], bool(r["cpu"]), r["upstream_model"],
                                        r.get("api_key"))
                           for r in e.get("replicas") or ()))
        for e in data.get("endpoints") or ())
    keys = {k["digest"]: KeyRoute(k["id"], k["owner"], tuple(k["scopes"]), k.get("rpm"), k.get("tpm"))
            for k in data.get("keys") or ()}
    owners = {o["owner"]: OwnerRoute(o["owner"], _positive(o, "requests_per_minute"), _positive(o, "tokens_per_minute"))
              for o in data.get("owners") or ()}
    serverless = {e.name: e for e in endpoints if e.serverless}
    by_model: dict[str, list[EndpointRoute]] = {}
    for e in serverless.values():
        if e.model:
            by_model.setdefault(e.model, []).append(e)
    return RouteTable(version=str(data.get("version", "")), region=str(data.get("region", "")), endpoints=endpoints,
                      keys=keys, owners=owners, by_name={(e.owner, e.name): e for e in endpoints if not e.serverless},
                      serverless=serverless, serverless_by_model={m: tuple(v) for m, v in by_model.items()})


def _positive(row: Mapping[str, object], name: Literal["requests_per_minute", "tokens_per_minute"]) -> int:
    """``row`` as JSON came, not as an ``OwnerDoc``: compiled (mypyc), a value read as ``int`` is converted on the
    way, a bool to 1, and the check below would never see it."""
    v = row[name]
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise ValueError(f"owners: {name} of {row.get('owner')!r} is {v!r}, not a positive integer")
    return v
