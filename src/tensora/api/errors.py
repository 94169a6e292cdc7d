"""One JSON error shape for the whole API: ``{"error": {"type", "message", "field"}}``.

Every 503 carries ``Retry-After``. Validation errors name the field (dotted path, without
the ``body.`` prefix). Unexpected exceptions become a 500 in the same shape, with the
request id, and are logged without request headers (so keys never reach a log).
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from tensora.api import metrics
from tensora.config.wording import in_words
from tensora.errors import ConfigError, Conflict, StoreUnavailable

log = logging.getLogger("tensora.api")

_TYPES = {400: "invalid_request", 401: "authentication_error", 403: "permission_denied", 404: "not_found",
          405: "method_not_allowed", 409: "conflict", 413: "payload_too_large", 415: "unsupported_media_type",
          422: "invalid_request", 429: "rate_limited", 503: "service_unavailable"}

QUOTA_EXCEEDED = "quota_exceeded"
"""The type of a 403 for a create past an owner's quota (keys, workloads): an answer that depends on what the
owner holds now, so it is never stored for Idempotency-Key replays."""

NAME_TAKEN = "name_taken"
"""The type of a 409 for a create whose name one of the owner's workloads not deleted has: like a quota, an answer
that depends on what the owner holds now, never stored for Idempotency-Key replays."""

# FastAPI's 400 for a body it could not read at all (not UTF-8): the same 422 as malformed JSON.
_FASTAPI_BODY_ERROR = "There was an error parsing the body"


class ApiError(Exception):
    """An error response. ``retry_after`` (seconds) becomes the Retry-After header."""

    def __init__(self, status: int, message: str, *, field: str | None = None, type_: str | None = None,
                 retry_after: int | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.field = status, message, field
        self.type = type_ or _TYPES.get(status, "api_error")
        self.headers = dict(headers or {})
        if retry_after is not None:
            self.headers["Retry-After"] = str(retry_after)
        elif status == 503:
            self.headers["Retry-After"] = "2"

    def body(self) -> dict[str, Any]:
        return error_body(self.type, self.message, self.field)


def error_body(type_: str, message: str, field: str | None = None) -> dict[str, Any]:
    return {"error": {"type": type_, "message": message, "field": field}}


def response(exc: ApiError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


def _field(loc: Any) -> str | None:
    parts = [str(p) for p in loc]
    if parts and parts[0] in ("body", "query", "path", "header"):
        parts = parts[1:]
    out = ""
    for p in parts:
        out += f"[{p}]" if p.isdigit() else (f".{p}" if out else p)
    return out or None


def install(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api(_: Request, exc: ApiError) -> JSONResponse:
        return response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request", "type": ""}
        message = in_words(first)
        field = _field(first.get("loc", ()))
        if first.get("type") == "json_invalid":  # its loc is a character offset, not a field
            message, field = "the body is not valid JSON", None
        return response(ApiError(422, message, field=field))

    @app.exception_handler(ConfigError)
    async def _config(_: Request, exc: ConfigError) -> JSONResponse:
        return response(ApiError(422, exc.message, field=exc.field))

    @app.exception_handler(StoreUnavailable)
    async def _store(_: Request, exc: StoreUnavailable) -> JSONResponse:
        log.warning("store unavailable: %s", exc)
        metrics.unavailable("database")
        return response(ApiError(503, "the database is unavailable; retry later", retry_after=exc.retry_after_s))

    @app.exception_handler(Conflict)
    async def _conflict(_: Request, exc: Conflict) -> JSONResponse:
        return response(ApiError(409, "a concurrent request changed this resource; retry", retry_after=1))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = exc.detail if isinstance(exc.detail, str) else "error"
        if exc.status_code == 400 and message == _FASTAPI_BODY_ERROR:  # e.g. a body that is not UTF-8
            return response(ApiError(422, "the body is not valid JSON"))
        headers = dict(exc.headers or {})
        if exc.status_code == 405:  # Starlette's Allow names one route's methods; a path may have several
            headers["Allow"] = ", ".join(_allowed_methods(request))
        return response(ApiError(exc.status_code, message, headers=headers))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        rid = request.headers.get("x-request-id", "")
        log.error("unhandled error on %s %s (request %s): %r", request.method, request.url.path, rid, exc,
                  exc_info=exc)
        return response(ApiError(500, f"internal error (request {rid})", type_="internal_error"))


def _allowed_methods(request: Request) -> list[str]:
    methods: set[str] = set()
    for route in request.app.router.routes:
        match, _ = route.matches(request.scope)
        if match != Match.NONE:
            methods |= set(getattr(route, "methods", None) or ())
    return sorted(methods)
