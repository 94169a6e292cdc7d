"""API keys: create (the secret shown once), list, revoke (and with a key, its dashboard sessions)."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Body
from fastapi.responses import Response

from tensora.api.auth import create_key
from tensora.api.deps import ERRORS, AnyKey, IdemKey, KeyAdmin, Svc, iso
from tensora.api.errors import ApiError
from tensora.api.owners import check_quota
from tensora.api.schemas import CurrentKeyOut, KeyCreate, KeyList, KeyOut
from tensora.keys.apikeys import DEFAULT_SCOPES, allows
from tensora.store import keys as keys_repo
from tensora.store import sessions as sessions_repo
from tensora.store.keys import KeyRow

router = APIRouter()


def _key_out(row: KeyRow, secret: str | None = None) -> dict[str, Any]:
    return {"id": row.id, "name": row.name, "owner": row.owner, "scopes": row.scopes,
            "hint": row.hint, "created_at": iso(row.created_at), "key": secret,
            "requests_per_minute": row.rpm, "tokens_per_minute": row.tpm, "secret_withheld": False}


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
        check_quota(conn, svc, owner, "keys")
        secret, row = create_key(conn, owner, body.name, scopes, svc.clock.now(), rpm=body.requests_per_minute,
                                 tpm=body.tokens_per_minute)
        return 201, _key_out(row, secret)

    return svc.idempotency.run(p.key_id, "POST", "/v1/keys", idem, body.model_dump(mode="json"), action,
                               replay=_withheld)


@router.get("/v1/keys", response_model=KeyList, responses=ERRORS, tags=["keys"])
def list_api_keys(svc: Svc, p: KeyAdmin) -> dict[str, Any]:
    with svc.db.read() as conn:
        return {"data": [_key_out(r) for r in keys_repo.list_keys(conn, p.owner_filter())]}


@router.get("/v1/keys/current", response_model=CurrentKeyOut, responses=ERRORS, tags=["keys"],
            description="The key this request carries: its id, owner and scopes, and whether it is an admin key. "
                        "Any valid key may ask (clients use it to show owners to admins).")
def current_api_key(p: AnyKey) -> dict[str, Any]:
    return {"id": p.key_id, "owner": p.owner, "scopes": list(p.scopes), "admin": p.is_admin}


@router.delete("/v1/keys/{key_id}", status_code=204, responses=ERRORS, tags=["keys"])
def revoke_api_key(key_id: str, svc: Svc, p: KeyAdmin) -> Response:
    with svc.db.write() as conn:
        if not keys_repo.revoke_key(conn, key_id, p.owner_filter(), svc.clock.now()):
            raise ApiError(404, f"no key {key_id!r}")
        sessions_repo.revoke_sessions_of_key(conn, key_id, svc.clock.now())  # its dashboard sessions end with it
    svc.keys.forget(key_id)
    return Response(status_code=204)
