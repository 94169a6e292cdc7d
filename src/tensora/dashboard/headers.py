"""The headers every dashboard response carries (its pages, the sign-in and error pages, its static files).

- ``Content-Security-Policy``: scripts, styles, images and fetches from this origin only, and no inline
  script or style (the pages keep to it: one script file, one style sheet); no page may frame it, its forms
  post only here, no ``<base>`` and no plugins. A tenant's content injected into a page could run nothing.
- ``X-Frame-Options: DENY`` for browsers without ``frame-ancestors``; ``X-Content-Type-Options: nosniff``.
- ``Referrer-Policy: same-origin``: no dashboard URL (a workload's id) goes to another site. Not
  ``no-referrer``: under it a browser sends ``Origin: null`` with the dashboard's own forms, which the forms'
  Origin check refuses.

The API's routes (``/v1/...``) and its documentation pages are left as they are: JSON for programs, and
the documentation's pages need scripts of their own.
"""

from __future__ import annotations

from typing import Any

CSP = "default-src 'self'; frame-ancestors 'none'; form-action 'self'; base-uri 'none'; object-src 'none'"
HEADERS = [(b"content-security-policy", CSP.encode()), (b"x-frame-options", b"DENY"),
           (b"referrer-policy", b"same-origin"), (b"x-content-type-options", b"nosniff")]
_NOT_PAGES = ("/v1/", "/docs", "/redoc", "/openapi.json", "/healthz", "/readyz")


class PageHeaders:
    """Pure ASGI middleware: ``HEADERS`` on every HTTP response outside ``_NOT_PAGES``."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope.get("path", "").startswith(_NOT_PAGES):
            await self.app(scope, receive, send)
            return

        async def with_headers(message: Any) -> None:
            if message["type"] == "http.response.start":
                names = {h for h, _ in HEADERS}
                message["headers"] = [*(h for h in message.get("headers", []) if h[0].lower() not in names),
                                      *HEADERS]
            await send(message)

        await self.app(scope, receive, with_headers)
