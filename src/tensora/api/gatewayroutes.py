"""The control API's side of the gateway: the route document it polls, and the usage batches it sends.

Every gateway polls ``GET /v1/gateway/routes`` every second with If-None-Match. The document (endpoints,
routable replicas, key digests, owners' limits) is built once per change: a poll first reads the store's
cheap marker (``store.routes.route_marker``) and, when it equals the one the cached document was built from,
answers from the cache (304, or the stored bytes) with no rebuild, no serialization and no hashing. The
cache is per process (each worker of ``serve --workers`` has its own); the version is a hash of the
content, so every worker gives the same document the same ETag.
"""

from __future__ import annotations

import hashlib
import threading
from dataclasses import dataclass, field
from typing import Annotated, Any

import orjson
from fastapi import APIRouter, Body, Request
from fastapi.responses import Response

from tensora.api.deps import ERRORS, Admin, Svc
from tensora.api.schemas import UsageBatch, UsageBatchOut
from tensora.api.services import Services
from tensora.config.quotas import effective
from tensora.gateway.routedoc import EndpointDoc, KeyDoc, OwnerDoc, ReplicaDoc, RouteDocument
from tensora.keys import replicakeys
from tensora.placement.fallback import uses_cpu
from tensora.placement.kinds import ReplicaRole, ReplicaState
from tensora.storage import SHARED
from tensora.store import keys as keys_repo
from tensora.store import owners as owners_repo
from tensora.store import routes as routes_repo
from tensora.store import usage as usage_repo
from tensora.store import workloads as workloads_repo
from tensora.store.rows import ReplicaRow, WorkloadRecord

router = APIRouter()


@dataclass(frozen=True)
class Document:
    version: str
    body: bytes  # the JSON answered, serialized once


@dataclass
class RouteCache:
    """The last document built in this process, with the marker it was built at."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    marker: Any = None
    doc: Document | None = None
    builds: int = 0

    def get(self, conn: Any, svc: Services) -> Document:
        """Under the lock, so that a change is built once however many gateways poll at that moment. The
        marker is read first, the document after it in the same transaction: the document is never older
        than its marker (at worst newer, and the next poll builds once more)."""
        with self.lock:
            marker = (svc.region, svc.replica_secret, svc.owner_defaults, id(svc.catalog),
                      routes_repo.route_marker(conn, svc.region))
            if self.doc is None or marker != self.marker:
                table = routes_table(conn, svc)
                self.doc = Document(table["version"], orjson.dumps(table))
                self.marker = marker
                self.builds += 1
            return self.doc


def route_cache(svc: Services) -> RouteCache:
    cache: RouteCache = svc.extra.setdefault("gateway_routes", RouteCache())
    return cache


@router.get("/v1/gateway/routes", responses=ERRORS, tags=["gateway"],
            description="What the region's gateways route by: serving endpoints and their ready replicas, the "
                        "digests (never secrets) of live keys, and the effective gateway limits of their owners. "
                        "Admin keys only. Send If-None-Match with the last ETag: 304 when nothing changed.")
def gateway_routes(request: Request, svc: Svc, _: Admin) -> Response:
    with svc.db.read() as conn:
        doc = route_cache(svc).get(conn, svc)
    etag = f'"{doc.version}"'
    if request.headers.get("if-none-match") == etag:
        return Response(status_code=304, headers={"ETag": etag})
    return Response(doc.body, media_type="application/json", headers={"ETag": etag})


@router.post("/v1/gateway/usage", response_model=UsageBatchOut, responses=ERRORS, tags=["gateway"],
             description="Token usage metered by a gateway, in batches. Record ids are the gateway's own "
                         "(random); a record whose id was seen before is not counted again (a gateway resends a "
                         "batch it is not sure arrived). ``client_request_id`` is the caller's X-Request-Id, "
                         "stored only.")
def gateway_usage(svc: Svc, _: Admin, body: Annotated[UsageBatch, Body()]) -> dict[str, Any]:
    rows = [r.model_dump() for r in body.records]
    with svc.db.write() as conn:
        new = usage_repo.insert_token_usage(conn, rows)
    return {"received": len(rows), "new": new}


def routes_table(conn: Any, svc: Services) -> RouteDocument:
    """The gateway's route table, built whole: endpoints serving in this region with their routable
    replicas, live keys, and the effective limits of every owner with a live key."""
    endpoints = routes_repo.serving_endpoints(conn, svc.region)
    replicas = workloads_repo.replicas_of(conn, [w.id for w in endpoints])
    by_w: dict[str, list[tuple[ReplicaRow, str]]] = {}  # a routable replica and its url
    for r in replicas:
        if r.state == ReplicaState.RUNNING and r.role == ReplicaRole.PRIMARY and r.url:
            by_w.setdefault(r.workload_id, []).append((r, r.url))

    def is_cpu(cls: str) -> bool:
        return cls in svc.catalog and svc.catalog[cls].is_cpu

    out: list[EndpointDoc] = []
    for w in endpoints:
        spec = w.spec or {}
        kind_spec = spec.get("kind_spec") or {}
        # what the model server answers to: the host path it was started with (a row made before names: its model)
        upstream = spec.get("model_path") or w.model
        out.append(EndpointDoc({
            "id": w.id, "name": w.name, "owner": w.owner, "region": w.region, "model": _pool_key(w),
            "requested_cpu": is_cpu(w.requested_class),
            "cpu_fallback": uses_cpu(w.fallback, svc.catalog),
            "fallback_models": spec.get("fallback_models") or [],
            "allow_cross_region": bool(spec.get("allow_cross_region")),
            "serverless": bool(kind_spec.get("serverless")), "ttft_s": kind_spec.get("ttft_deadline_s"),
            "stream_idle_s": kind_spec.get("stream_idle_s"), "context": spec.get("context"),
            "replicas": [_replica(svc, r, url, is_cpu(r.cls), r.served_model or upstream)
                         for r, url in sorted(by_w.get(w.id, []), key=_slot)]}))
    keys = [KeyDoc(id=k.id, digest=k.digest, owner=k.owner, scopes=k.scopes, rpm=k.rpm, tpm=k.tpm)
            for k in keys_repo.gateway_keys(conn)]
    overrides = owners_repo.owner_limits(conn)
    owners: list[OwnerDoc] = []
    for owner in sorted({k["owner"] for k in keys}):
        limits = effective(svc.owner_defaults, None, overrides.get(owner)).limits
        owners.append(OwnerDoc(owner=owner, requests_per_minute=limits.requests_per_minute,
                               tokens_per_minute=limits.tokens_per_minute))
    body = {"region": svc.region, "endpoints": out, "keys": keys, "owners": owners}
    version = hashlib.sha256(orjson.dumps(body, option=orjson.OPT_SORT_KEYS)).hexdigest()[:16]
    return RouteDocument(version=version, region=svc.region, endpoints=out, keys=keys, owners=owners)


def _pool_key(w: WorkloadRecord) -> str | None:
    """What the gateway matches an endpoint to the serverless pool by: the host path of a shared model
    (``shared/<root>/...``), the same file whoever names it. An owner's own files match nothing: two
    owners' ``tiny`` are different models."""
    path = (w.spec or {}).get("model_path")
    return path if path and (w.model or "").startswith(f"{SHARED}/") else None


def _replica(svc: Services, r: ReplicaRow, url: str, cpu: bool, upstream_model: str | None) -> ReplicaDoc:
    """A routable replica; with its API key for the gateway to send upstream, on the local driver. The store does
    not know a replica's runtime, so every replica's is there: a server that takes no key ignores the header."""
    doc = ReplicaDoc(id=r.id, url=url, cls=r.cls, cpu=cpu, upstream_model=upstream_model)
    if svc.replica_secret:
        doc["api_key"] = replicakeys.derive(svc.replica_secret, r.id)
    return doc


def _slot(routable: tuple[ReplicaRow, str]) -> tuple[int, str]:
    return routable[0].slot, routable[0].id
