"""Who a dashboard page acts as: the session in its cookie, and the API client that acts as it.

Sign-in trades an API key for a session (``tensora.api.sessions``) once; after that the browser holds only
the session id, in an http-only, SameSite=Strict cookie that is ``__Host-`` and Secure wherever a browser
keeps such a cookie (https, or a loopback host over http). A page resolves the session to its principal
once per request and calls the API in-process as that principal (``tensora.api.principal``): no key is
kept, sent or needed.
"""

from __future__ import annotations

import contextlib
import ipaddress
from collections.abc import AsyncIterator
from typing import Protocol

import httpx
from fastapi import Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import Response

from tensora.api.principal import Principal, as_principal
from tensora.sdk import AsyncClient

SESSION_COOKIE, CSRF_COOKIE = "tensora_session", "tensora_csrf"
HOST_PREFIX = "__Host-"


class SessionBook(Protocol):
    """What the dashboard asks of the server's sessions (``tensora.api.sessions.Sessions``)."""

    def start(self, key: str) -> str | None: ...
    def principal(self, session_id: str, *, active: bool = True) -> Principal | None: ...
    def end(self, session_id: str) -> None: ...


class SignIn(Exception):
    """No session, or one that ended: back to the sign-in page."""


def secure_cookies(scheme: str, host: str | None) -> bool:
    """Whether a browser keeps a ``Secure`` (and so a ``__Host-``) cookie from this origin: https, or a
    loopback host (localhost, *.localhost, 127.0.0.0/8, ::1), which browsers count as secure over http."""
    if scheme in ("https", "wss"):
        return True
    host = (host or "").lower().rstrip(".")
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def secure(request: Request) -> bool:
    return secure_cookies(request.url.scheme, request.url.hostname)


def cookie_name(request: Request, name: str) -> str:
    """``__Host-<name>`` where the browser keeps it (bound to this host, Secure, Path=/); else plain http on
    another host, where a browser drops Secure cookies: ``<name>``, and the network can read it."""
    return HOST_PREFIX + name if secure(request) else name


def set_cookie(response: Response, request: Request, name: str, value: str) -> None:
    response.set_cookie(cookie_name(request, name), value, httponly=True, secure=secure(request),
                        samesite="strict", path="/")


def forget(response: Response, request: Request, name: str) -> None:
    response.delete_cookie(cookie_name(request, name), path="/", secure=secure(request), httponly=True,
                           samesite="strict")


def sessions(request: Request) -> SessionBook:
    book: SessionBook = request.app.state.services.sessions
    return book


async def principal(request: Request) -> Principal:
    """Who this request's session acts as (once per request); SignIn without one."""
    p: Principal | None = getattr(request.state, "principal", None)
    if p is None:
        session_id = request.cookies.get(cookie_name(request, SESSION_COOKIE), "")
        if session_id:
            p = await run_in_threadpool(sessions(request).principal, session_id,
                                        active=not request.url.path.startswith("/ui/"))
        if p is None:
            raise SignIn
        request.state.principal = p
    return p


@contextlib.asynccontextmanager
async def client(request: Request) -> AsyncIterator[AsyncClient]:
    """The SDK on this app, acting as the session's principal: no key is sent (an empty one: none from the
    environment either), and none is needed."""
    app = as_principal(request.app, await principal(request))
    async with AsyncClient("", "http://dashboard.invalid", transport=httpx.ASGITransport(app=app), max_retries=0,
                           timeout=30) as c:
        yield c
