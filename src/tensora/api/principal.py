"""Who a request acts as (``Principal``), and how code in this process hands one to the API without a key.

An HTTP request names its caller with ``Authorization: Bearer <key>`` (``tensora.api.auth``). The dashboard
signs a browser in with a session instead and must not keep the key, so its pages call the API in-process
as the session's principal: ``as_principal`` wraps the app given to ``httpx.ASGITransport`` and puts the
principal in the ASGI scope under ``SCOPE_KEY``. The scope is built by the server from the connection;
headers, cookies and the path are values inside it, and no client can add a key to it, so only code in
this process can act this way. This module imports no store, so the dashboard may use it.
"""

from __future__ import annotations

from collections.abc import MutableMapping
from dataclasses import dataclass
from typing import Any

from tensora.api.errors import ApiError
from tensora.keys import apikeys

SCOPE_KEY = "tensora.principal"
"""The ASGI scope key of an in-process caller's principal (``deps.caller`` takes it, with its scopes)."""


@dataclass(frozen=True, slots=True)
class Principal:
    key_id: str
    owner: str
    scopes: tuple[str, ...]

    @property
    def is_admin(self) -> bool:
        return "admin" in self.scopes

    def require(self, scope: str) -> None:
        if not apikeys.allows(self.scopes, scope):
            raise ApiError(403, f"this key lacks the {scope!r} scope")

    def owner_filter(self) -> str | None:
        """Owners see only their own; admin keys see everyone's."""
        return None if self.is_admin else self.owner


def in_scope(scope: MutableMapping[str, Any]) -> Principal | None:
    """The principal that in-process code put in this request's scope, if any."""
    p = scope.get(SCOPE_KEY)
    return p if isinstance(p, Principal) else None


def as_principal(app: Any, principal: Principal) -> Any:
    """``app`` with every HTTP request acting as ``principal`` (for an in-process transport only)."""

    async def acting(scope: dict[str, Any], receive: Any, send: Any) -> None:
        await app({**scope, SCOPE_KEY: principal} if scope["type"] == "http" else scope, receive, send)

    return acting
