"""Owners: their flags, quotas and limits (admins set them), and what each holds; the quota check of creates."""

from __future__ import annotations

from dataclasses import asdict, replace
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Body

from tensora.api.deps import ERRORS, Admin, OwnerName, Reader, Svc, iso
from tensora.api.errors import QUOTA_EXCEEDED, ApiError
from tensora.api.schemas import OwnerList, OwnerOut, OwnerUpdate
from tensora.api.services import Services
from tensora.config import quotas
from tensora.control import owners
from tensora.store import owners as owners_repo
from tensora.store.owners import Holdings
from tensora.store.rows import OwnerRow

router = APIRouter()


def owner_settings(conn: Any, svc: Services, owner: str) -> quotas.OwnerSettings:
    """The owner's effective quotas and limits (``tensora.control.owners``)."""
    return owners.settings(conn, svc.owner_defaults, owner)


def check_quota(conn: Any, svc: Services, owner: str, what: Literal["keys", "workloads"]) -> None:
    """403 quota_exceeded when ``owner`` already holds its quota of ``what`` (the rule: ``tensora.control.owners``);
    an ApiError, so that an Idempotency-Key replays it."""
    try:
        owners.check_quota(conn, svc.owner_defaults, owner, what)
    except owners.QuotaExceeded as exc:
        raise ApiError(403, str(exc), type_=QUOTA_EXCEEDED) from None


def _owner_out(svc: Services, owner: str, row: OwnerRow | None, held: Holdings) -> dict[str, Any]:
    """An owner never set is untrusted, has the defaults and no ``updated_at``."""
    q, lim = (row.quotas, row.limits) if row else (None, None)
    eff = quotas.effective(svc.owner_defaults, q, lim)
    return {"owner": owner, "trusted": bool(row and row.trusted), "updated_at": iso(row.updated_at if row else None),
            "quotas": eff.quotas.model_dump(), "limits": eff.limits.model_dump(),
            "overridden": quotas.overridden(q, lim), "in_use": asdict(held)}


@router.get("/v1/owners", response_model=OwnerList, responses=ERRORS, tags=["owners"],
            description="The owners an operator has set something on (flags, quotas, limits), with their "
                        "effective quotas and limits and what they hold. Admin keys only.")
def list_owners(svc: Svc, _: Admin) -> dict[str, Any]:
    with svc.db.read() as conn:
        rows = owners_repo.list_owners(conn)
        held = owners_repo.holdings(conn, [r.owner for r in rows])
    return {"data": [_owner_out(svc, r.owner, r, held[r.owner]) for r in rows]}


@router.get("/v1/owners/{owner}", response_model=OwnerOut, responses=ERRORS, tags=["owners"],
            description="An owner's flags, effective quotas and limits (the server's defaults with an admin's "
                        "overrides, named in ``overridden``) and what it holds now (``in_use``): any owner may "
                        "read its own; admin keys anyone's.")
def get_owner(owner: OwnerName, svc: Svc, p: Reader) -> dict[str, Any]:
    if owner != p.owner and not p.is_admin:
        raise ApiError(404, f"no owner {owner!r}")
    with svc.db.read() as conn:
        return _owner_out(svc, owner, owners_repo.get_owner(conn, owner), owners_repo.holdings(conn, [owner])[owner])


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
        row = owners_repo.owner_for_update(conn, owner, now)
        values: dict[str, Any] = {"updated_at": now}
        if body.trusted is not None:
            values["trusted"] = body.trusted
        for part in ("quotas", "limits"):
            if part in body.model_fields_set:
                patch = getattr(body, part)
                values[part] = (None if patch is None else
                                quotas.overlay(getattr(row, part),
                                               {f: getattr(patch, f) for f in patch.model_fields_set}))
        owners_repo.write_owner(conn, owner, values)
        return _owner_out(svc, owner, replace(row, **values), owners_repo.holdings(conn, [owner])[owner])
