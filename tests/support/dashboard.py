"""The dashboard over plain HTTP (httpx), signed in as a browser would be.

httpx's cookie jar (Python's ``http.cookiejar``) sends no ``Secure`` cookie over http, not even to a
loopback host, where browsers do: the dashboard's ``__Host-`` cookies are sent here by hand, as a
``Cookie`` header on the client.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.support import services
from tests.support.stack import Stack, stack

SESSION, CSRF = "__Host-tensora_session", "__Host-tensora_csrf"


@pytest.fixture
def live(tmp_path: Path) -> Iterator[tuple[Stack, str]]:
    """A control API with the dashboard, served over HTTP on 127.0.0.1 (no controller); its stack and URL."""
    s = stack(str(tmp_path / "t.db"), tmp_path, run_controller=False)
    try:
        with services.serving(s.app) as server:
            yield s, server.url
    finally:
        s.services.db.dispose()


@contextlib.contextmanager
def signed_in(url: str, key: str) -> Iterator[httpx.Client]:
    """A client that signed in with ``key`` and sends the session and CSRF cookies with every request."""
    with httpx.Client(base_url=url, follow_redirects=False) as c:
        csrf = c.get("/login").cookies[CSRF]
        r = c.post("/login", data={"csrf": csrf, "key": key}, headers={"Cookie": f"{CSRF}={csrf}"})
        assert r.status_code == 303, r.text
        c.headers["Cookie"] = f"{SESSION}={r.cookies[SESSION]}; {CSRF}={r.cookies[CSRF]}"
        yield c


def cookie(c: httpx.Client, name: str) -> str:
    """The value of cookie ``name`` that ``c`` sends."""
    pairs = dict(p.split("=", 1) for p in str(c.headers.get("Cookie", "")).split("; ") if "=" in p)
    return str(pairs[name])
