"""The control API's own documentation pages, ``/docs`` (Swagger UI) and ``/redoc``, with nothing from a CDN.

FastAPI's defaults load Swagger UI's and Redoc's scripts from a CDN (and Redoc's fonts from Google): on a machine
without the internet, or one that should not tell a third party who reads its API, the pages stay blank. Here
the same pages load their scripts, stylesheet and icon from ``/docs-assets``, served from the files the
fastapi-offline package ships (pinned in the lock, so an upgrade of the viewers is a reviewed change). Redoc's
sidebar still shows its maker's logo from their CDN, with no option to turn it off: the pages' Content-Security-Policy
keeps that (and anything else a viewer might fetch) from leaving the server, so the browser never asks.
"""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path

from fastapi import FastAPI
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html, get_swagger_ui_oauth2_redirect_html
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles

ASSETS = "/docs-assets"
DOCS, REDOC, OAUTH2_REDIRECT = "/docs", "/redoc", "/docs/oauth2-redirect"
# Swagger UI checks a document at its online validator unless told not to (a request to a third party)
SWAGGER_PARAMETERS = {"validatorUrl": None}
# the pages' own origin only; inline: the pages' start-up script and the viewers' generated styles; blob: Redoc's
# search runs in a worker made from a blob
CSP = ("default-src 'self'; script-src 'self' 'unsafe-inline'; style-src 'self' 'unsafe-inline'; "
       "img-src 'self' data:; font-src 'self' data:; worker-src 'self' blob:; connect-src 'self'; "
       "frame-ancestors 'none'; base-uri 'none'; form-action 'none'")


def _page(html: HTMLResponse) -> HTMLResponse:
    html.headers["Content-Security-Policy"] = CSP
    return html


def assets_dir() -> Path:
    """The folder of swagger-ui-bundle.js, swagger-ui.css, redoc.standalone.js and favicon.png."""
    return Path(str(files("fastapi_offline") / "static"))


def install(app: FastAPI) -> None:
    """Serve /docs, its OAuth2 redirect, /redoc and their assets. The app must be made with ``docs_url=None,
    redoc_url=None`` (FastAPI's own pages, with their CDN links, are then not added)."""
    if app.docs_url is not None or app.redoc_url is not None:
        raise ValueError("make the app with docs_url=None and redoc_url=None: these pages replace FastAPI's own")
    openapi_url = app.openapi_url or "/openapi.json"
    app.mount(ASSETS, StaticFiles(directory=assets_dir()), name="docs-assets")

    @app.get(DOCS, include_in_schema=False)
    async def swagger_ui() -> HTMLResponse:
        return _page(get_swagger_ui_html(openapi_url=openapi_url, title=f"{app.title} - Swagger UI",
                                   oauth2_redirect_url=OAUTH2_REDIRECT,
                                   swagger_js_url=f"{ASSETS}/swagger-ui-bundle.js",
                                   swagger_css_url=f"{ASSETS}/swagger-ui.css",
                                   swagger_favicon_url=f"{ASSETS}/favicon.png",
                                   swagger_ui_parameters=SWAGGER_PARAMETERS))

    @app.get(OAUTH2_REDIRECT, include_in_schema=False)
    async def swagger_ui_redirect() -> HTMLResponse:
        return _page(get_swagger_ui_oauth2_redirect_html())

    @app.get(REDOC, include_in_schema=False)
    async def redoc() -> HTMLResponse:
        return _page(get_redoc_html(openapi_url=openapi_url, title=f"{app.title} - ReDoc",
                              redoc_js_url=f"{ASSETS}/redoc.standalone.js",
                              redoc_favicon_url=f"{ASSETS}/favicon.png", with_google_fonts=False))
