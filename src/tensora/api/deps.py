"""What every resource's handlers share: the services, the caller and its scopes, the error responses, the
Idempotency-Key header, timestamps as ISO 8601.

Handlers parse, check the caller, and call ``tensora.control`` / ``repo`` in one transaction; the controller does
the rest (it is woken at once). Every POST takes ``Idempotency-Key`` (see ``idempotency``). Owners see and touch
only their own workloads and keys: anyone else's is a 404, as if it did not exist.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable
from typing import Annotated, Any

from fastapi import Depends, Header, Path, Request
from fastapi.concurrency import run_in_threadpool

from tensora.api.principal import Principal, in_scope
from tensora.api.schemas import OWNER_PATTERN, ErrorOut
from tensora.api.services import Services

ERRORS: dict[int | str, dict[str, Any]] = {
    s: {"model": ErrorOut} for s in (401, 403, 404, 409, 413, 422, 503)
}
RATED: dict[int | str, dict[str, Any]] = {
    **ERRORS, 429: {"model": ErrorOut, "description": "past the owner's rate of such calls (limits.*_per_minute); "
                                                      "Retry-After says when to try again"}}
"""The answers of a route that counts against an owner's control-API rate (``tensora.api.rates``)."""
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


def caller(scope: str | None) -> Callable[..., Any]:
    """The request's principal, which must hold ``scope`` (None: any valid key)."""

    async def dependency(request: Request) -> Principal:
        p = in_scope(request.scope)  # a dashboard page's in-process call, as its session (``api.principal``)
        if p is None:
            keys = _services(request).keys
            p = keys.cached(request)
            if p is None:
                p = await run_in_threadpool(keys.check, request)
        if scope is not None:
            p.require(scope)
        return p

    return dependency


Svc = Annotated[Services, Depends(services)]
Reader = Annotated[Principal, Depends(caller("workloads:read"))]
Writer = Annotated[Principal, Depends(caller("workloads:write"))]
UsageReader = Annotated[Principal, Depends(caller("usage:read"))]
KeyAdmin = Annotated[Principal, Depends(caller("keys:write"))]
Admin = Annotated[Principal, Depends(caller("admin"))]
AnyKey = Annotated[Principal, Depends(caller(None))]
OwnerName = Annotated[str, Path(min_length=1, max_length=128, pattern=OWNER_PATTERN)]


def iso(ts: float | None) -> str | None:
    if ts is None:
        return None
    return dt.datetime.fromtimestamp(ts, dt.UTC).isoformat().replace("+00:00", "Z")
