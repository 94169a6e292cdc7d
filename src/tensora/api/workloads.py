"""Workloads: create, list, read, events, stop, restart, delete."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict
from typing import Annotated, Any

from fastapi import APIRouter, Body, Query
from fastapi.responses import Response

from tensora.api import rates
from tensora.api.deps import ERRORS, RATED, IdemKey, Reader, Svc, Writer, iso
from tensora.api.errors import NAME_TAKEN, ApiError
from tensora.api.owners import check_quota
from tensora.api.principal import Principal
from tensora.api.schemas import EventList, RestartBody, WorkloadList, WorkloadOut, pattern
from tensora.api.services import Services
from tensora.control import workloads
from tensora.control.spec import WorkloadSpec
from tensora.placement.kinds import WorkloadKind, WorkloadState
from tensora.store import events as events_repo
from tensora.store import nodes as nodes_repo
from tensora.store import workloads as workloads_repo
from tensora.store.rows import ReplicaRow, WorkloadRecord

router = APIRouter()


def _out(w: WorkloadRecord, replicas: Sequence[ReplicaRow], svc: Services) -> dict[str, Any]:
    v: dict[str, Any] = dict(workloads.view(w, replicas, svc.catalog))
    for k in ("created_at", "updated_at", "queued_since", "fallback_eligible_at"):
        v[k] = iso(v[k])
    return v


def _stopper(p: Principal, w: WorkloadRecord) -> workloads.StoppedBy:
    """Who the reason of a stopped workload names: its owner, or an admin acting on it."""
    return workloads.StoppedBy.OWNER if w.owner == p.owner else workloads.StoppedBy.ADMIN


def _retry_of(p: Principal, path: str, idem: str | None) -> dict[str, str] | None:
    """The idempotency record a POST with Idempotency-Key ``idem`` claims (its rate counts it once)."""
    return None if idem is None else {"key_id": p.key_id, "method": "POST", "path": path, "key": idem}


def _own(conn: Any, p: Principal, workload_id: str) -> WorkloadRecord:
    w = workloads_repo.get_workload(conn, workload_id, p.owner_filter())
    if w is None:
        raise ApiError(404, f"no workload {workload_id!r}")
    return w


@router.post("/v1/workloads", status_code=201, response_model=WorkloadOut, responses=RATED, tags=["workloads"],
             summary="Create a notebook, VM or endpoint",
             description=("Queued for ``gpu_class``; after ``fallback_after`` the ``fallback`` list is tried in "
                          "order (opt-in: empty means wait). A CPU entry means no GPU while on CPU: endpoints "
                          "serve roughly 10-50x slower, notebooks and VMs run without one; ``warning`` says "
                          "which for the kind. ``name`` is unique among the owner's workloads not deleted: "
                          "409 ``name_taken`` names the workload that has it. ``warnings`` (this answer only) lists "
                          "what to know now: that warning, and a class the region has none of at all."))
def create_workload(svc: Svc, p: Writer, body: Annotated[WorkloadSpec, Body()], idem: IdemKey = None) -> Response:
    caller = workloads.Caller(p.owner, p.is_admin, svc.region, svc.isolation, svc.isolation_reason)
    try:
        body, owner = workloads.authorize_create(body, body.model_fields_set, caller)
    except workloads.NotAllowed as exc:
        raise ApiError(403, str(exc), field=exc.field) from None
    rates.take(svc, p.owner, rates.Action.CREATE, _retry_of(p, "/v1/workloads", idem))  # before the model is read
    checked = workloads.validate(body, svc.catalog, owner, svc.storage, runs_models=svc.runs_models)

    def action(conn: Any) -> tuple[int, dict[str, Any]]:
        check_quota(conn, svc, owner, "workloads")
        try:
            row = workloads.create(conn, checked, svc.clock.now())
        except workloads.NameTaken as exc:
            raise ApiError(409, str(exc), field="name", type_=NAME_TAKEN) from None
        out = _out(row, [], svc)
        out["warnings"] = workloads.create_warnings(
            row, [n.node() for n in nodes_repo.nodes_in(conn, row.region)], svc.catalog)
        return 201, out

    return svc.idempotency.run(p.key_id, "POST", "/v1/workloads", idem, body.model_dump(mode="json"), action,
                               svc.wake)


@router.get("/v1/workloads", response_model=WorkloadList, responses=ERRORS, tags=["workloads"],
            description="Your workloads (every owner's for admin keys), oldest first: ids sort in the order they "
                        "were made. ``next`` is the cursor for ``after`` while more remain.")
def list_workloads(svc: Svc, p: Reader,
                   kind: Annotated[str | None, Query(pattern=pattern(WorkloadKind))] = None,
                   state: Annotated[str | None, Query(pattern=pattern(WorkloadState))] = None,
                   limit: Annotated[int, Query(ge=1, le=500)] = 100,
                   after: Annotated[str | None, Query(max_length=64)] = None) -> dict[str, Any]:
    with svc.db.read() as conn:
        rows = workloads_repo.list_workloads(conn, p.owner_filter(), kind, state, limit + 1, after)
        page = rows[:limit]
        replicas = workloads_repo.replicas_of(conn, [w.id for w in page])
    by: dict[str, list[ReplicaRow]] = {}
    for r in replicas:
        by.setdefault(r.workload_id, []).append(r)
    return {"data": [_out(w, by.get(w.id, []), svc) for w in page],
            "next": page[-1].id if len(rows) > limit else None}


@router.get("/v1/workloads/{workload_id}", response_model=WorkloadOut, responses=ERRORS, tags=["workloads"])
def get_workload(workload_id: str, svc: Svc, p: Reader) -> dict[str, Any]:
    with svc.db.read() as conn:
        w = _own(conn, p, workload_id)
        return _out(w, workloads_repo.replicas_of(conn, [w.id]), svc)


@router.get("/v1/workloads/{workload_id}/events", response_model=EventList, responses=ERRORS, tags=["workloads"])
def workload_events(workload_id: str, svc: Svc, p: Reader,
                    ) -> dict[str, Any]:
    with svc.db.read() as conn:
        _own(conn, p, workload_id)
        events = events_repo.list_events(conn, workload_id)
    return {"data": [{**asdict(e), "at": iso(e.at), "last_at": None if e.last_at is None else iso(e.last_at),
                      "workload_id": None} for e in events]}


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
        return 200, _out(w, workloads_repo.replicas_of(conn, [w.id]), svc)

    return svc.idempotency.run(p.key_id, "POST", f"/v1/workloads/{workload_id}/stop", idem, {}, action, svc.wake)


@router.post("/v1/workloads/{workload_id}/restart", response_model=WorkloadOut, responses=RATED,
             tags=["workloads"],
             description=("Stop and queue again. ``placement: requested`` asks for the requested class only: "
                          "the 'restart on GPU' offered while ``restart_available`` is true."))
def restart_workload(workload_id: str, svc: Svc, p: Writer, body: Annotated[RestartBody | None, Body()] = None,
                     idem: IdemKey = None) -> Response:
    placement = (body or RestartBody()).placement
    rates.take(svc, p.owner, rates.Action.CREATE,  # a restart starts the workload anew
               _retry_of(p, f"/v1/workloads/{workload_id}/restart", idem))

    def action(conn: Any) -> tuple[int, dict[str, Any]]:
        w = _own(conn, p, workload_id)
        try:
            w = workloads.restart(conn, w, svc.clock.now(), placement)
        except workloads.InvalidState as exc:
            raise ApiError(409, str(exc), retry_after=2) from None
        return 200, _out(w, workloads_repo.replicas_of(conn, [w.id]), svc)

    return svc.idempotency.run(p.key_id, "POST", f"/v1/workloads/{workload_id}/restart", idem,
                               {"placement": placement}, action, svc.wake)


@router.delete("/v1/workloads/{workload_id}", status_code=204, responses=RATED, tags=["workloads"],
               description="Stops the workload if it runs and removes it from listings; once its replicas have "
                           "stopped, a notebook's files (its home dir) are deleted too. Its usage stays.")
def delete_workload(workload_id: str, svc: Svc, p: Writer) -> Response:
    rates.take(svc, p.owner, rates.Action.DELETE)
    with svc.db.write() as conn:
        w = _own(conn, p, workload_id)
        workloads.delete(conn, w, svc.clock.now(), _stopper(p, w))
    svc.wake()
    return Response(status_code=204)
