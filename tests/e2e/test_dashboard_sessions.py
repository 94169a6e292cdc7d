"""The dashboard's sign-in in a real browser (Debian's chromium driven by Playwright) against the control API
served on 127.0.0.1 with a fake clock: the browser holds a session, never the API key.

A page on another port of the same host receives this host's cookies (cookies know no port), so whatever
cookie the dashboard sets is what such a page can take. It must not be the key: the session it holds
instead ends on sign-out, when its key is revoked (through the API or by any other path), when idle and at
the end of its lifetime. Every dashboard page carries a Content-Security-Policy that the pages themselves
keep (no inline script or style), which Chromium enforces here.
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tensora.sdk import Client
from tensora.store import keys as keys_repo
from tests.support.browser import browser as browser  # the fixture, imported under its name
from tests.support.dashboard import CSRF, live, signed_in
from tests.support.stack import Stack

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
playwright_api = pytest.importorskip("playwright.sync_api")
expect = playwright_api.expect
__all__ = ["browser", "live"]  # the fixtures, shared

SESSION = "__Host-tensora_session"
HOUR = 3600.0


def sign_in(browser: Any, url: str, key: str) -> Any:
    page = browser.new_context().new_page()
    page.goto(url + "/login")
    page.get_by_label("API key").fill(key)
    page.get_by_role("button", name="Sign in").click()
    expect(page.get_by_role("heading", name="Workloads")).to_be_visible()
    return page


def replay(browser: Any, url: str, cookies: list[dict[str, Any]], path: str = "/") -> Any:
    """A fresh browser that holds only ``cookies`` (as a thief would) opens ``path``."""
    context = browser.new_context()
    context.add_cookies(cookies)
    page = context.new_page()
    page.goto(url + path)
    return page


def test_no_cookie_or_page_holds_the_key(browser: Any, live: tuple[Stack, str]) -> None:
    s, url = live
    page = sign_in(browser, url, s.admin)
    seen = [page.content()]
    for path in ["/", "/new", "/capacity", "/operator", "/workloads/wl_nothere"]:
        page.goto(url + path)
        seen.append(page.content())
    cookies = page.context.cookies()
    assert cookies, "signed in without a cookie?"
    for c in cookies:
        assert s.admin not in c["value"], f"the cookie {c['name']} holds the admin key"
    assert not any(s.admin in html for html in seen)
    assert "tensora_key" not in {c["name"] for c in cookies}
    page.context.close()


def test_the_session_cookie_is_host_prefixed_and_chromium_keeps_it_over_loopback_http(
        browser: Any, live: tuple[Stack, str]) -> None:
    s, url = live
    assert url.startswith("http://127.0.0.1:")
    page = sign_in(browser, url, s.alice)
    by_name = {c["name"]: c for c in page.context.cookies()}
    assert set(by_name) == {SESSION, "__Host-tensora_csrf"}
    for c in by_name.values():
        assert c["secure"] and c["httpOnly"] and c["sameSite"] == "Strict" and c["path"] == "/"
        assert c["domain"] == "127.0.0.1"  # host-only: no Domain attribute
    page.goto(url + "/capacity")  # the browser sends it back: still signed in
    expect(page.locator("#capacity")).to_contain_text("l40s-48gb")
    page.context.close()


def test_after_sign_out_the_old_cookie_goes_to_sign_in(browser: Any, live: tuple[Stack, str]) -> None:
    s, url = live
    page = sign_in(browser, url, s.alice)
    stolen = page.context.cookies()
    page.get_by_role("button", name="Sign out").click()
    assert page.url.endswith("/login")
    assert SESSION not in {c["name"] for c in page.context.cookies()}  # the browser dropped it, too
    page.context.close()
    thief = replay(browser, url, stolen)
    assert thief.url.endswith("/login")
    thief.context.close()


@pytest.mark.parametrize("how", ["through the API", "in the store"])
def test_revoking_the_key_ends_its_sessions(browser: Any, live: tuple[Stack, str], how: str) -> None:
    s, url = live
    with Client(s.admin, url) as sdk:
        made = sdk.create_key("carol", owner="carol")
        assert made.key
        page = sign_in(browser, url, made.key)
        if how == "through the API":
            sdk.revoke_key(made.id)
        else:  # another path (an operator's SQL, another server): the check at use joins the key
            with s.services.db.write() as conn:
                assert keys_repo.revoke_key(conn, made.id, None, s.clock.now())
    page.goto(url + "/")
    assert page.url.endswith("/login")
    page.context.close()


EXPIRY = {  # how long the browser is away -> still signed in?
    "idle just under the idle timeout": (HOUR - 60, True),
    "idle past the idle timeout": (HOUR + 1, False),
}


@pytest.mark.parametrize("case", EXPIRY.values(), ids=EXPIRY.keys())
def test_an_idle_session_goes_to_sign_in(browser: Any, live: tuple[Stack, str], case: tuple[float, bool]) -> None:
    s, url = live
    away, signed_in = case
    page = sign_in(browser, url, s.alice)
    s.clock.advance(away)
    page.goto(url + "/capacity")
    assert page.url.endswith("/capacity") is signed_in
    page.context.close()


def test_a_session_ends_at_its_lifetime_however_active(browser: Any, live: tuple[Stack, str]) -> None:
    s, url = live
    page = sign_in(browser, url, s.alice)
    for _ in range(13):  # a page every 55 minutes, never idle: 11 h 55 min in all
        s.clock.advance(HOUR - 300)
        page.goto(url + "/")
        assert page.url == url + "/"
    s.clock.advance(HOUR - 300)  # 12 h 50 min since sign-in
    page.goto(url + "/")
    assert page.url.endswith("/login")
    page.context.close()


HEADERS = {
    "content-security-policy": ("default-src 'self'; frame-ancestors 'none'; form-action 'self'; "
                                "base-uri 'none'; object-src 'none'"),
    "x-frame-options": "DENY",
    "referrer-policy": "same-origin",
    "x-content-type-options": "nosniff",
}


def test_every_dashboard_response_carries_the_headers(live: tuple[Stack, str]) -> None:
    s, url = live
    with httpx.Client(base_url=url, follow_redirects=False) as c:
        answers = {"sign-in page": c.get("/login"), "static script": c.get("/static/live.js"),
                   "static style": c.get("/static/dashboard.css"), "a page, signed out": c.get("/"),
                   "a forged form": c.post("/new", data={"name": "x"}), "no such page": c.get("/nothing")}
        csrf = answers["sign-in page"].cookies[CSRF]
        answers["refused sign-in"] = c.post("/login", data={"csrf": csrf, "key": "tsk_nope"},
                                            headers={"Cookie": f"{CSRF}={csrf}"})
    with signed_in(url, s.alice) as c:
        for path in ["/", "/new", "/capacity", "/operator", "/workloads/wl_nothere", "/ui/rows"]:
            answers[path] = c.get(path)
    assert answers["refused sign-in"].status_code == 401 and answers["/"].status_code == 200
    assert answers["/operator"].status_code == 403 and answers["/workloads/wl_nothere"].status_code == 404
    for name, r in answers.items():
        got = {h: r.headers.get(h) for h in HEADERS}
        assert got == HEADERS, f"{name} ({r.status_code}): {got}"


def test_the_pages_work_under_their_policy(browser: Any, live: tuple[Stack, str]) -> None:
    """Chromium reports every script, style or frame the policy blocks; the pages need none of them."""
    s, url = live
    with Client(s.alice, url) as sdk:  # usage to chart: a workload that ran
        w = sdk.create_workload("notebook", "nb", "l40s-48gb")
    s.controller.run_once()
    s.clock.advance(600)
    s.controller.run_once()
    page = sign_in(browser, url, s.alice)
    blocked: list[str] = []
    page.on("console", lambda m: blocked.append(m.text) if "Content Security Policy" in m.text else None)
    for path in ["/", f"/workloads/{w.id}", "/capacity"]:
        page.goto(url + path)
        page.wait_for_load_state("networkidle")
    expect(page.locator("#usage .swatch").first).to_be_visible()
    page.goto(url + "/new")
    page.get_by_label("Fallback 1").select_option("cpu")
    expect(page.locator("#cpu-warning")).to_be_visible()  # live.js runs
    page.get_by_label("Kind").select_option("endpoint")
    expect(page.get_by_label("Model (from your files)")).to_be_visible()
    assert blocked == []
    page.context.close()
