"""The control API's routes. Handlers parse, check the caller, and call ``workloads``/``repo``
in one transaction; the controller does the rest (it is woken at once).

Every POST takes ``Idempotency-Key`` (see ``idempotency``). Owners see and touch only their
own workloads and keys: anyone else's is a 404, as if it did not exist.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable
from dataclasses import asdict
from typing import Annotated, Any

from fastapi import APIRouter, Body, Depends, Header, Path, Query, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse, Response

from tensora import quotas, workloads
from tensora.api.auth import Principal, create_key
from tensora.api.errors import QUOTA_EXCEEDED, ApiError
from tensora.api.schemas import (
    OWNER_PATTERN,
    CatalogOut,
    ErrorOut,
    EventList,
    KeyCreate,
    KeyList,
    KeyOut,
    OwnerList,
    OwnerOut,
    OwnerUpdate,
    RestartBody,
    TokenUsageOut,
    UsageOut,
    WorkloadList,
    WorkloadOut,
)
from tensora.api.services import Services
from tensora.apikeys import DEFAULT_SCOPES, allows
from tensora.capacity import Capacity, Placed
from tensora.spec import WorkloadSpec
from tensora.store import repo
from tensora.units import format_memory
from tensora.usage import summarize

router = APIRouter()

ERRORS: dict[int | str, dict[str, Any]] = {
    s: {"model": ErrorOut} for s in (401, 403, 404, 409, 413, 422, 503)
}
IdemKey = Annotated[str | None, Header(alias="Idempotency-Key", description=(
    "makes the POST safe to retry: the same key and body replay the first response (24 h)"),
    # documented only: ``idempotency`` checks the key itself, with its own message
    json_schema_extra={"minLength": 1, "maxLength": 255, "pattern": r"^[\x21-\x7e]([\x20-\x7e]*[\x21-\x7e])?$"})]


# Dependencies are ``async def`` on purpose: FastAPI runs a plain ``def`` dependency in the
# thread pool, one hop per dependency per request. They do no I/O on the event loop: a key
# found in the cache is checked there, and only a miss (once per key every 2 s) goes to a
# thread to read the store, so a database that hangs never blocks the loop.
def _services(request: Request) -> Services:
    svc: Services = request.app.state.services
    return svc


async def services(request: Request) -> Services:
    return _services(request)


def caller(scope: str) -> Callable[..., Any]:
    async def dependency(request: Request) -> Principal:
        keys = _services(request).keys
        p = keys.cached(request)
        if p is None:
            p = await run_in_threadpool(keys.check, request)
        p.require(scope)
        return p

    return dependency


Svc = Annotated[Services, Depends(services)]
Reader = Annotated[Principal, Depends(caller("workloads:read"))]
Writer = Annotated[Principal, Depends(caller("workloads:write"))]
UsageReader = Annotated[Principal, Depends(caller("usage:read"))]
KeyAdmin = Annotated[Principal, Depends(caller("keys:write"))]


def iso(ts: float | None) -> str | None:
    if ts is None:
        return None
    return dt.datetime.fromtimestamp(ts, dt.UTC).isoformat().replace("+00:00", "Z")


def _out(w: dict[str, Any], replicas: list[dict[str, Any]], svc: Services) -> dict[str, Any]:
    v = workloads.view(w, replicas, svc.catalog)
    for k in ("created_at", "updated_at", "queued_since", "fallback_eligible_at"):
        v[k] = iso(v[k])
    return v


def _stopper(p: Principal, w: dict[str, Any]) -> workloads.StoppedBy:
    """Who the reason of a stopped workload names: its owner, or an admin acting on it."""
    return workloads.StoppedBy.OWNER if w["owner"] == p.owner else workloads.StoppedBy.ADMIN


def _own(conn: Any, p: Principal, workload_id: str) -> dict[str, Any]:
    w = repo.get_workload(conn, workload_id, p.owner_filter())
    if w is None:
        raise ApiError(404, f"no workload {workload_id!r}")
    return w


# -- workloads ------------------------------------------------------------------------

@router.post("/v1/workloads", status_code=201, response_model=WorkloadOut, responses=ERRORS, tags=["workloads"],
             summary="Create a notebook, VM or endpoint",
             description=("Queued for ``gpu_class``; after ``fallback_after`` the ``fallback`` list is tried in "
                          "order (opt-in: empty means wait). A CPU entry means no GPU while on CPU: endpoints "
                          "serve roughly 10-50x slower, notebooks and VMs run without one; ``warning`` says "
                          "which for the kind."))
def create_workload(svc: Svc, p: Writer, body: Annotated[WorkloadSpec, Body()], idem: IdemKey = None) -> Response:
    fields = body.model_fields_set
    if "owner" in fields and body.owner != p.owner and not p.is_admin:
        raise ApiError(403, "only admin keys may create workloads for another owner", field="owner")
    owner = body.owner if "owner" in fields else p.owner
    if "region" not in fields:
        body = body.model_copy(update={"region": svc.region})
    elif body.region != svc.region:
        raise ApiError(422, f"this server serves region {svc.region!r}", field="region")
    if body.spec.get("serverless") and not p.is_admin:
        raise ApiError(403, "only admin keys may run serverless (shared) endpoints", field="spec.serverless")
    if svc.isolation == "admin-only" and not (p.is_admin and owner == p.owner):
        raise ApiError(403, f"this host cannot sandbox workloads ({svc.isolation_reason}), so it runs the admin "
                            "owner's only; its operator may set isolation: none to run every owner's unsandboxed")
    checked = workloads.validate(body, svc.catalog, owner, svc.storage)

    def action(conn: Any) -> tuple[int, dict[str, Any]]:
        _check_quota(conn, svc, owner, "workloads")
        row = workloads.create(conn, checked, svc.clock.now())
        return 201, _out(row, [], svc)

    return svc.idempotency.run(p.key_id, "POST", "/v1/workloads", idem, body.model_dump(mode="json"), action,
                               svc.wake)


@router.get("/v1/workloads", response_model=WorkloadList, responses=ERRORS, tags=["workloads"],
            description="Your workloads (every owner's for admin keys), oldest first: ids sort in the order they "
                        "were made. ``next`` is the cursor for ``after`` while more remain.")
def list_workloads(svc: Svc, p: Reader,
                   kind: Annotated[str | None, Query(pattern="^(notebook|vm|endpoint)$")] = None,
                   state: Annotated[str | None, Query(
                       pattern="^(queued|starting|running|stopping|stopped|failed)$")] = None,
                   limit: Annotated[int, Query(ge=1, le=500)] = 100,
                   after: Annotated[str | None, Query(max_length=64)] = None) -> dict[str, Any]:
    with svc.db.read() as conn:
        rows = repo.list_workloads(conn, p.owner_filter(), kind, state, limit + 1, after)
        page = rows[:limit]
        replicas = repo.replicas_of(conn, [w["id"] for w in page])
    by: dict[str, list[dict[str, Any]]] = {}
    for r in replicas:
        by.setdefault(r["workload_id"], []).append(r)
    return {"data": [_out(w, by.get(w["id"], []), svc) for w in page],
            "next": page[-1]["id"] if len(rows) > limit else None}


@router.get("/v1/workloads/{workload_id}", response_model=WorkloadOut, responses=ERRORS, tags=["workloads"])
def get_workload(workload_id: str, svc: Svc, p: Reader) -> dict[str, Any]:
    with svc.db.read() as conn:
        w = _own(conn, p, workload_id)
        return _out(w, repo.replicas_of(conn, [w["id"]]), svc)


@router.get("/v1/workloads/{workload_id}/events", response_model=EventList, responses=ERRORS, tags=["workloads"])
def workload_events(workload_id: str, svc: Svc, p: Reader,
                    ) -> dict[str, Any]:
    with svc.db.read() as conn:
        _own(conn, p, workload_id)
        events = repo.list_events(conn, workload_id)
    return {"data": [{**asdict(e), "at": iso(e.at), "workload_id": None} for e in events]}


@router.post("/v1/workloads/{workload_id}/stop", response_model=WorkloadOut, responses=ERRORS,
             tags=["workloads"])
def stop_workload(workload_id: str, svc: Svc, p: Writer, idem: IdemKey = None,
                  ) -> Response:
    def action(conn: Any) -> tuple[int, dict[str, Any]]:
        w = _own(conn, p, workload_id)
        try:
            w = workloads.stop(conn, w, svc.clock.now(), _stopper(p, w))
        except workloads.InvalidState as exc:
            raise ApiError(409, str(exc), retry_after=1) from None
        return 200, _out(w, repo.replicas_of(conn, [w["id"]]), svc)

    return svc.idempotency.run(p.key_id, "POST", f"/v1/workloads/{workload_id}/stop", idem, {}, action, svc.wake)


@router.post("/v1/workloads/{workload_id}/restart", response_model=WorkloadOut, responses=ERRORS,
             tags=["workloads"],
             description=("Stop and queue again. ``placement: requested`` asks for the requested class only: "
                          "the 'restart on GPU' offered while ``restart_available`` is true."))
def restart_workload(workload_id: str, svc: Svc, p: Writer, body: Annotated[RestartBody | None, Body()] = None,
                     idem: IdemKey = None) -> Response:
    placement = (body or RestartBody()).placement

    def action(conn: Any) -> tuple[int, dict[str, Any]]:
        w = _own(conn, p, workload_id)
        try:
            w = workloads.restart(conn, w, svc.clock.now(), placement)
        except workloads.InvalidState as exc:
            raise ApiError(409, str(exc), retry_after=2) from None
        return 200, _out(w, repo.replicas_of(conn, [w["id"]]), svc)

    return svc.idempotency.run(p.key_id, "POST", f"/v1/workloads/{workload_id}/restart", idem,
                               {"placement": placement}, action, svc.wake)


@router.delete("/v1/workloads/{workload_id}", status_code=204, responses=ERRORS, tags=["workloads"],
               description="Stops the workload if it runs and removes it from listings; once its replicas have "
                           "stopped, a notebook's files (its home dir) are deleted too. Its usage stays.")
def delete_workload(workload_id: str, svc: Svc, p: Writer) -> Response:
    with svc.db.write() as conn:
        w = _own(conn, p, workload_id)
        workloads.delete(conn, w, svc.clock.now(), _stopper(p, w))
    svc.wake()
    return Response(status_code=204)


# -- catalog and usage ----------------------------------------------------------------

@router.get("/v1/catalog", response_model=CatalogOut, responses=ERRORS, tags=["catalog"])
def catalog(svc: Svc, _: Reader) -> dict[str, Any]:
    with svc.db.read() as conn:
        node_rows = repo.nodes_in(conn, svc.region)
        placed = [Placed(r.node, r.cls, r.workload_id) for r in repo.active_replicas(conn, svc.region)]
    nodes = [n.node() for n in node_rows]
    free = {c.cls: c.fits for c in Capacity(nodes, placed, svc.catalog, svc.reserves).summary(svc.region)}
    total = {c.cls: c.fits for c in Capacity(nodes, [], svc.catalog, svc.reserves).summary(svc.region)}
    data = []
    for cls in svc.catalog.values():
        gpu = ({"model": cls.gpu_model, "count": cls.gpu_count, "memory": format_memory(cls.gpu_memory)}
               if cls.gpu_model else None)
        data.append({"name": cls.name, "kind": cls.kind.value, "cpu": cls.cpu, "memory": format_memory(cls.memory),
                     "gpu": gpu, "capacity": {svc.region: {"free": free.get(cls.name, 0),
                                                           "total": total.get(cls.name, 0)}}})
    return {"region": svc.region, "data": data, "isolation": svc.isolation,
            "note": "cpu classes have no GPU: endpoints on them serve roughly 10-50x slower than on a GPU "
                    "class, notebooks and VMs run without one; 'cpu' in a fallback list means the cpu class "
                    "nearest the requested size that has room"}


@router.get("/v1/usage", response_model=UsageOut, responses=ERRORS, tags=["usage"],
            description="Accounted time (no prices: Tensora is free), summed by placed_class, and by owner, "
                        "kind and UTC day on request (group_by=placed_class,owner,day).")
def usage(svc: Svc, p: UsageReader,
          group_by: Annotated[str, Query(pattern=r"^(placed_class|owner|day|kind)(,(placed_class|owner|day|kind))*$")]
          = "placed_class",
          since: Annotated[float | None, Query(ge=0, le=1e11, description="epoch seconds")] = None,
          until: Annotated[float | None, Query(ge=0, le=1e11, description="epoch seconds")] = None,
          owner: Annotated[str | None, Query(max_length=128, description="admin keys only")] = None,
          ) -> dict[str, Any]:
    now = svc.clock.now()
    start, end = since or 0.0, min(until or now, now)
    if owner is not None and owner != p.owner and not p.is_admin:
        raise ApiError(403, "only admin keys may read another owner's usage", field="owner")
    who = owner if owner is not None else p.owner_filter()
    keys = list(dict.fromkeys(group_by.split(",")))
    with svc.db.read() as conn:
        segments = repo.segments(conn, who, start, end)
    rows = summarize(segments, keys, start, end)
    return {"since": iso(start), "until": iso(end), "group_by": keys, "data": rows,
            "total_seconds": round(sum(r["seconds"] for r in rows), 3)}


# -- keys -----------------------------------------------------------------------------

def _key_out(row: dict[str, Any], secret: str | None = None) -> dict[str, Any]:
    return {"id": row["id"], "name": row["name"], "owner": row["owner"], "scopes": row["scopes"],
            "hint": row["hint"], "created_at": iso(row["created_at"]), "key": secret,
            "requests_per_minute": row.get("rpm"), "tokens_per_minute": row.get("tpm"), "secret_withheld": False}


def _withheld(payload: dict[str, Any]) -> dict[str, Any]:
    """What a key creation's Idempotency-Key record keeps for replays: everything but the secret."""
    return {**payload, "key": None, "secret_withheld": True}


@router.post("/v1/keys", status_code=201, response_model=KeyOut, responses=ERRORS, tags=["keys"],
             description="The secret ``key`` is in this response only; only its SHA-256 is stored. A replay (the "
                         "same Idempotency-Key and body, from the same key) answers the same status and body "
                         "except ``key: null`` and ``secret_withheld: true``: the key exists, its secret was "
                         "shown once and is kept nowhere (if that first response was lost, revoke the key and "
                         "create another). Past the owner's ``keys`` quota: 403 ``quota_exceeded``. "
                         "``requests_per_minute`` / ``tokens_per_minute``: admin keys only.")
def create_api_key(svc: Svc, p: KeyAdmin, body: Annotated[KeyCreate | None, Body()] = None,
                   idem: IdemKey = None) -> Response:
    body = body or KeyCreate()
    owner = body.owner or p.owner
    if owner != p.owner and not p.is_admin:
        raise ApiError(403, "only admin keys may create keys for another owner", field="owner")
    for limit in ("requests_per_minute", "tokens_per_minute"):
        if getattr(body, limit) is not None and not p.is_admin:
            raise ApiError(403, f"only admin keys may set {limit} (the owner's limits hold across its keys)",
                           field=limit)
    # no scopes given: the defaults this caller may grant (a key never grants what it lacks)
    scopes = list(body.scopes) if body.scopes is not None else [s for s in DEFAULT_SCOPES if allows(p.scopes, s)]
    for s in scopes:
        if not allows(p.scopes, s):
            raise ApiError(403, f"a key cannot grant the {s!r} scope it lacks", field="scopes")

    def action(conn: Any) -> tuple[int, dict[str, Any]]:
        _check_quota(conn, svc, owner, "keys")
        secret, row = create_key(conn, owner, body.name, scopes, svc.clock.now(), rpm=body.requests_per_minute,
                                 tpm=body.tokens_per_minute)
        return 201, _key_out(row, secret)

    return svc.idempotency.run(p.key_id, "POST", "/v1/keys", idem, body.model_dump(mode="json"), action,
                               replay=_withheld)


@router.get("/v1/keys", response_model=KeyList, responses=ERRORS, tags=["keys"])
def list_api_keys(svc: Svc, p: KeyAdmin) -> dict[str, Any]:
    with svc.db.read() as conn:
        return {"data": [_key_out(r) for r in repo.list_keys(conn, p.owner_filter())]}


@router.delete("/v1/keys/{key_id}", status_code=204, responses=ERRORS, tags=["keys"])
def revoke_api_key(key_id: str, svc: Svc, p: KeyAdmin) -> Response:
    with svc.db.write() as conn:
        if not repo.revoke_key(conn, key_id, p.owner_filter(), svc.clock.now()):
            raise ApiError(404, f"no key {key_id!r}")
    svc.keys.forget(key_id)
    return Response(status_code=204)


# -- owners ---------------------------------------------------------------------------

Admin = Annotated[Principal, Depends(caller("admin"))]
OwnerName = Annotated[str, Path(min_length=1, max_length=128, pattern=OWNER_PATTERN)]


def owner_settings(conn: Any, svc: Services, owner: str) -> quotas.OwnerSettings:
    """The owner's effective quotas and limits: its stored overrides over the server's defaults."""
    row = repo.get_owner(conn, owner)
    return quotas.effective(svc.owner_defaults, row and row["quotas"], row and row["limits"])


def _check_quota(conn: Any, svc: Services, owner: str, what: str) -> None:
    """403 quota_exceeded when ``owner`` already holds its quota of ``what`` (keys, workloads). Counted in
    the transaction that inserts, under the owner's quota lock: two creates cannot both take the last slot."""
    repo.lock_owner_quota(conn, owner)
    quota = getattr(owner_settings(conn, svc, owner).quotas, what)
    held = repo.count_keys(conn, owner) if what == "keys" else repo.count_workloads(conn, owner)
    if held >= quota:
        raise ApiError(403, f"owner quota: {held} of {quota} {what} in use", type_=QUOTA_EXCEEDED)


def _owner_out(svc: Services, owner: str, row: dict[str, Any] | None, held: dict[str, int]) -> dict[str, Any]:
    """An owner never set is untrusted, has the defaults and no ``updated_at``."""
    row = row or {"trusted": False, "updated_at": None, "quotas": None, "limits": None}
    eff = quotas.effective(svc.owner_defaults, row["quotas"], row["limits"])
    return {"owner": owner, "trusted": bool(row["trusted"]), "updated_at": iso(row["updated_at"]),
            "quotas": eff.quotas.model_dump(), "limits": eff.limits.model_dump(),
            "overridden": quotas.overridden(row["quotas"], row["limits"]), "in_use": held}


@router.get("/v1/owners", response_model=OwnerList, responses=ERRORS, tags=["owners"],
            description="The owners an operator has set something on (flags, quotas, limits), with their "
                        "effective quotas and limits and what they hold. Admin keys only.")
def list_owners(svc: Svc, _: Admin) -> dict[str, Any]:
    with svc.db.read() as conn:
        rows = repo.list_owners(conn)
        held = repo.holdings(conn, [r["owner"] for r in rows])
    return {"data": [_owner_out(svc, r["owner"], r, held[r["owner"]]) for r in rows]}


@router.get("/v1/owners/{owner}", response_model=OwnerOut, responses=ERRORS, tags=["owners"],
            description="An owner's flags, effective quotas and limits (the server's defaults with an admin's "
                        "overrides, named in ``overridden``) and what it holds now (``in_use``): any owner may "
                        "read its own; admin keys anyone's.")
def get_owner(owner: OwnerName, svc: Svc, p: Reader) -> dict[str, Any]:
    if owner != p.owner and not p.is_admin:
        raise ApiError(404, f"no owner {owner!r}")
    with svc.db.read() as conn:
        return _owner_out(svc, owner, repo.get_owner(conn, owner), repo.holdings(conn, [owner])[owner])


@router.put("/v1/owners/{owner}", response_model=OwnerOut, responses=ERRORS, tags=["owners"],
            description="Set an owner's flags, quotas and limits (admin keys only). Only the fields named "
                        "change: an absent field keeps its value, a field set to null returns to the server's "
                        "default (``\"quotas\": null``: every quota). Every owner's new notebook and endpoint "
                        "replicas run under ``runtimeClassName: kata`` on Kubernetes unless ``trusted`` is true. "
                        "A lower quota refuses new creates past it and removes nothing. Idempotent as PUT is.")
def set_owner(owner: OwnerName, svc: Svc, _: Admin, body: Annotated[OwnerUpdate, Body()]) -> dict[str, Any]:
    if not body.model_fields_set:
        raise ApiError(422, "nothing to set: give trusted, quotas or limits")
    now = svc.clock.now()
    with svc.db.write() as conn:
        row = repo.owner_for_update(conn, owner, now)
        values: dict[str, Any] = {"updated_at": now}
        if body.trusted is not None:
            values["trusted"] = body.trusted
        for part in ("quotas", "limits"):
            if part in body.model_fields_set:
                patch = getattr(body, part)
                values[part] = (None if patch is None else
                                quotas.overlay(row[part], {f: getattr(patch, f) for f in patch.model_fields_set}))
        repo.write_owner(conn, owner, values)
        return _owner_out(svc, owner, {**row, **values}, repo.holdings(conn, [owner])[owner])


# -- the gateway's side (its routes and usage batches: ``gatewayroutes``) -------------


@router.get("/v1/usage/tokens", response_model=TokenUsageOut, responses=ERRORS, tags=["usage"],
            description="Tokens the gateway served, by endpoint, product (the endpoint's own replicas, the "
                        "serverless pool, a fallback model, another region), model that answered and served_by.")
def usage_tokens(svc: Svc, p: UsageReader,
                 since: Annotated[float | None, Query(ge=0, le=1e11, description="epoch seconds")] = None,
                 until: Annotated[float | None, Query(ge=0, le=1e11, description="epoch seconds")] = None,
                 ) -> dict[str, Any]:
    now = svc.clock.now()
    start = since or 0.0
    with svc.db.read() as conn:  # no until: everything metered so far (a gateway's clock may run ahead)
        rows = repo.token_usage(conn, p.owner_filter(), start, until)
    return {"since": iso(start), "until": iso(until if until is not None else now), "data": rows}


# -- health ---------------------------------------------------------------------------

@router.get("/healthz", tags=["health"], description="The process is up.")
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/readyz", tags=["health"], responses={503: {"model": ErrorOut}},
            description="The database answers and the server is not shutting down.")
def readyz(svc: Svc) -> JSONResponse:
    svc.db.ping()
    return JSONResponse({"status": "ready", "region": svc.region,
                         "controller": svc.controller_state()})
