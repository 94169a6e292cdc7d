"""Where the dashboard's cookies can be ``__Host-`` and Secure: where a browser keeps a Secure cookie."""

from __future__ import annotations

import pytest

from tensora.dashboard.signin import secure_cookies

CASES = {  # (scheme, host) -> Secure (and __Host-) cookies?
    "https anywhere": ("https", "tensora.example", True),
    "http on 127.0.0.1": ("http", "127.0.0.1", True),
    "http on another loopback address": ("http", "127.0.0.2", True),
    "http on ::1": ("http", "::1", True),
    "http on localhost": ("http", "localhost", True),
    "http on LOCALHOST.": ("http", "LOCALHOST.", True),
    "http on a name under localhost": ("http", "dash.localhost", True),
    "http on a name": ("http", "tensora.example", False),
    "http on a name ending in localhost": ("http", "notlocalhost", False),
    "http on a private address": ("http", "10.0.0.5", False),
    "http on any address": ("http", "0.0.0.0", False),
    "http without a host": ("http", None, False),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_secure_cookies(case: tuple[str, str | None, bool]) -> None:
    scheme, host, want = case
    assert secure_cookies(scheme, host) is want
