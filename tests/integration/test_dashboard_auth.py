"""How the dashboard's pages call the API as the signed-in user, and why no one else can.

A page's in-process client hands the API the session's ``Principal`` in the ASGI scope, which only code in
this process can write: an HTTP request (served here by uvicorn, on a real socket) has headers, cookies and
a path, and none of them becomes a principal. The session cookie is the dashboard's alone: the API takes
keys only.
"""

from __future__ import annotations

import httpx
import pytest
from sqlalchemy import text

from tensora.sdk import Client
from tests.support.dashboard import CSRF, SESSION, cookie, live, signed_in
from tests.support.stack import Stack

__all__ = ["live"]  # the fixture, shared


FORGED = {  # what a caller can put in a request, trying to be someone without a key
    "the scope key as a header": {"tensora.principal": "admin"},
    "its spelling as a header": {"tensora-principal": "admin", "x-tensora-principal": "admin"},
    "proxy user headers": {"x-forwarded-user": "admin", "x-remote-user": "admin", "remote-user": "admin",
                           "x-auth-request-user": "admin"},
    "a principal as JSON": {"x-principal": '{"key_id": "key_x", "owner": "admin", "scopes": ["admin"]}'},
    "forwarded for loopback": {"x-forwarded-for": "127.0.0.1", "forwarded": "for=127.0.0.1",
                               "x-real-ip": "127.0.0.1"},
}


@pytest.mark.parametrize("headers", FORGED.values(), ids=FORGED.keys())
def test_an_external_request_cannot_become_a_principal(live: tuple[Stack, str], headers: dict[str, str]) -> None:
    _, url = live
    for method, path in [("GET", "/v1/workloads"), ("GET", "/v1/keys"), ("GET", "/v1/operator"),
                         ("POST", "/v1/workloads")]:
        r = httpx.request(method, url + path, headers=headers, json={} if method == "POST" else None)
        assert r.status_code == 401, (path, r.status_code, r.text)


def test_the_session_cookie_is_no_key_to_the_api(live: tuple[Stack, str]) -> None:
    s, url = live
    with signed_in(url, s.admin) as dash:
        session = cookie(dash, SESSION)
        assert session and dash.get("/").status_code == 200
        as_cookie = httpx.get(url + "/v1/workloads", headers={"Cookie": f"{SESSION}={session}"})
        as_bearer = httpx.get(url + "/v1/workloads", headers={"Authorization": f"Bearer {session}"})
    assert as_cookie.status_code == 401 and as_bearer.status_code == 401


def test_pages_act_as_the_session_and_its_scopes(live: tuple[Stack, str]) -> None:
    """A form creates a workload for the session's owner (an idempotent POST, keyed by its key's id); a key
    without a scope gets the API's 403 on the page, as it would with the key."""
    s, url = live
    with Client(s.admin, url) as sdk:
        reader = sdk.create_key("reader", owner="alice", scopes=["workloads:read"]).key
    assert reader
    with signed_in(url, s.alice) as dash:
        csrf = cookie(dash, CSRF)
        r = dash.post("/new", data={"csrf": csrf, "kind": "notebook", "name": "mine", "gpu_class": "cpu-1c-4g"})
        assert r.status_code == 303 and r.headers["location"].startswith("/workloads/wl_")
    with Client(s.alice, url) as sdk:
        assert [w.name for w in sdk.iter_workloads()] == ["mine"]
    with signed_in(url, reader) as dash:
        assert "mine" in dash.get("/").text
        csrf = cookie(dash, CSRF)
        r = dash.post("/new", data={"csrf": csrf, "kind": "notebook", "name": "not-mine", "gpu_class": "cpu-1c-4g"})
        assert r.status_code == 403 and "workloads:write" in r.text


def test_plain_http_on_another_host_gets_cookies_without_the_prefix_or_secure(live: tuple[Stack, str]) -> None:
    """A browser drops a Secure cookie sent over http to a host that is not loopback: there the dashboard
    still works, with the same cookies minus ``__Host-`` and Secure (and says nothing of a ``__Host-`` one)."""
    s, url = live
    host = {"Host": "tensora.example"}
    with httpx.Client(base_url=url, follow_redirects=False, headers=host) as c:
        page = c.get("/login")
        csrf = page.cookies["tensora_csrf"]
        r = c.post("/login", data={"csrf": csrf, "key": s.alice}, headers={"Cookie": f"tensora_csrf={csrf}"})
        assert r.status_code == 303
        set_cookies = r.headers.get_list("set-cookie") + page.headers.get_list("set-cookie")
        assert set_cookies and all(v.startswith("tensora_") for v in set_cookies)
        assert not any("secure" in v.lower() for v in set_cookies)
        assert all("httponly" in v.lower() and "samesite=strict" in v.lower() for v in set_cookies)
        session = r.cookies["tensora_session"]
        assert c.get("/", headers={"Cookie": f"tensora_session={session}"}).status_code == 200
        assert c.get("/", headers={"Cookie": f"{SESSION}={session}"}).status_code == 303  # not this host's name
    with httpx.Client(base_url=url, follow_redirects=False) as c:  # on 127.0.0.1, only the prefixed name counts
        assert c.get("/", headers={"Cookie": f"tensora_session={session}"}).status_code == 303
        assert c.get("/", headers={"Cookie": f"{SESSION}={session}"}).status_code == 200


def test_a_pages_own_refresh_does_not_keep_the_session_from_going_idle(live: tuple[Stack, str]) -> None:
    s, url = live
    with signed_in(url, s.alice) as dash:
        for _ in range(2):  # a page left open refreshes itself; nobody looks
            s.clock.advance(1_500)
            assert dash.get("/ui/rows").status_code == 200
        s.clock.advance(1_500)
        assert dash.get("/ui/rows").status_code == 401  # 75 min after the last page opened
        assert dash.get("/").headers["location"] == "/login"
    with signed_in(url, s.alice) as dash:
        for _ in range(3):  # pages opened: the session stays
            s.clock.advance(1_500)
            assert dash.get("/").status_code == 200


def test_revoking_a_key_through_the_api_signs_its_sessions_out(live: tuple[Stack, str]) -> None:
    s, url = live
    with Client(s.admin, url) as sdk:
        made = sdk.create_key("carol", owner="carol")
        assert made.key
        with signed_in(url, made.key), signed_in(url, made.key), signed_in(url, s.alice):
            sdk.revoke_key(made.id)
    with s.services.db.read() as conn:
        rows = conn.execute(text("SELECT key_id, revoked_at FROM dashboard_sessions")).all()
    assert sorted((k == made.id, at is not None) for k, at in rows) == [(False, False), (True, True), (True, True)]
