"""The dashboard's pages as a new user meets them, in a real browser against a real ``tensora serve`` (the simulated
fleet: one L40S, one A100, CPU workers; the controller's metrics listener on loopback): the create form names the
free count of each class, flags every bad field at once in words, and warns of CPU only as what was chosen; an admin
finds the operator page in the nav and sees whose each workload and token row is, where an owner sees neither; the
operator page counts every queued workload; each page fits a 390 px wide phone."""

from __future__ import annotations

import html
import re
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tensora.sdk import Client
from tests.support.browser import browser as browser  # the fixture, imported under its name
from tests.support.browser import shot, sign_in
from tests.support.dashboard import CSRF, cookie, signed_in
from tests.support.serve import served_with_an_owner
from tests.support.services import free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
playwright_api = pytest.importorskip("playwright.sync_api")
expect = playwright_api.expect
__all__ = ["browser"]  # the fixture, shared

NAME_RULE = "lowercase letters, digits and '-', 1-63 characters, starting and ending with a letter or digit"
PHONE = {"width": 390, "height": 844}
QUEUE_DEADLINE_S = 30.0


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str, str]]:
    """A served stack with its controller's metrics listener; its URL, the admin's key and alice's (an owner's)."""
    with served_with_an_owner(tmp_path_factory.mktemp("pages"),
                              {"TENSORA_METRICS_LISTEN": f"127.0.0.1:{free_port()}"}) as keys:
        yield keys


def test_each_gpu_class_says_how_many_are_free(browser: Any, server: tuple[str, str, str]) -> None:
    url, _, alice = server
    page = sign_in(browser, url, alice)
    page.goto(url + "/new")
    expect(page.locator("#gpu_class option[value=l40s-48gb]")).to_have_text(re.compile(r"^l40s-48gb \(\d+ free\)$"))
    expect(page.locator("#fallback_0 option[value=a100-80gb]")).to_have_text(re.compile(r"^a100-80gb \(\d+ free\)$"))
    page.context.close()


def test_every_bad_field_is_flagged_at_once_in_words(browser: Any, server: tuple[str, str, str]) -> None:
    url, _, alice = server
    page = sign_in(browser, url, alice)
    page.goto(url + "/new")
    posts: list[str] = []
    page.on("request", lambda r: posts.append(r.url) if r.method == "POST" else None)
    page.get_by_label("Name").fill("Not A Name")
    page.get_by_label("Fallback after").fill("45d")
    page.get_by_role("button", name="Create").click()
    expect(page.locator("#name-error")).to_have_text(f"The name must be {NAME_RULE}.")
    expect(page.locator("#fallback_after-error")).to_have_text("Fallback after must be a duration such as 90s, "
                                                               "10m or 1h30m, at most 30 days.")
    expect(page.get_by_label("Name")).to_have_attribute("aria-invalid", "true")
    body = page.locator("main").inner_text()
    assert "pattern" not in body and "^[a-z" not in body and "validation error" not in body.lower()
    shot(page, "create-every-error")
    assert posts == []  # said in the browser, before any request
    # what only the API knows is its message, next to its field, once the obvious checks pass
    page.get_by_label("Name").fill("ok-name")
    page.get_by_label("Fallback after").fill("10m")
    page.get_by_label("Kind").select_option("endpoint")
    page.get_by_label("Class").select_option("cpu-2c-8g")
    page.get_by_label("Model (from your files)").fill("not-uploaded")
    page.get_by_role("button", name="Create").click()
    expect(page.locator("#model-error")).to_have_text("not found in your files or the shared models")
    expect(page.locator("#name-error")).to_have_count(0)
    page.context.close()


def test_without_javascript_the_server_flags_every_bad_field(server: tuple[str, str, str]) -> None:
    url, _, alice = server
    with signed_in(url, alice) as c:
        csrf = cookie(c, CSRF)
        r = c.post("/new", data={"csrf": csrf, "kind": "notebook", "name": "-bad-", "gpu_class": "cpu-1c-4g",
                                 "fallback_after": "ten minutes"})
    assert r.status_code == 422
    said = {m[1]: html.unescape(m[2]) for m in re.finditer(r'id="([a-z_]+)-error"[^>]*>([^<]*)</p>', r.text)}
    assert said == {"name": f"The name must be {NAME_RULE}.",
                    "fallback_after": "Fallback after must be a duration such as 90s, 10m or 1h30m, at most 30 days."}
    with Client(alice, url) as sdk:
        assert "-bad-" not in {w.name for w in sdk.iter_workloads()}


def test_a_requested_cpu_class_is_no_cpu_fallback(browser: Any, server: tuple[str, str, str]) -> None:
    url, _, alice = server
    page = sign_in(browser, url, alice)
    page.goto(url + "/new")
    page.get_by_label("Class").select_option("cpu-2c-8g")
    warning = page.locator("#cpu-warning")
    expect(warning).to_be_visible()
    expect(warning).to_contain_text("You asked for a CPU class (cpu-2c-8g)")
    expect(warning).not_to_contain_text("fallback")
    page.get_by_label("Class").select_option("l40s-48gb")
    expect(warning).to_be_hidden()
    page.get_by_label("Fallback 1").select_option("cpu")
    expect(warning).to_contain_text("CPU fallback is enabled")
    page.context.close()


def test_the_operator_page_is_in_the_nav_for_admins_only(browser: Any, server: tuple[str, str, str]) -> None:
    url, admin, alice = server
    page = sign_in(browser, url, admin)
    nav = page.get_by_role("navigation", name="main")
    expect(nav.get_by_role("link", name="Operator")).to_have_attribute("href", "/operator")
    nav.get_by_role("link", name="Operator").click()
    expect(page.locator("h1")).to_contain_text("Operator")
    page.context.close()
    page = sign_in(browser, url, alice)
    expect(page.get_by_role("heading", name="Workloads")).to_be_visible()
    expect(page.get_by_role("navigation", name="main").get_by_role("link", name="Operator")).to_have_count(0)
    page.context.close()


def _queued(url: str, admin: str, cls: str, want: int) -> int:
    """The operator figures' queue depth of ``cls`` once it is ``want``, or as last read when the deadline passes."""
    deadline, n = time.monotonic() + QUEUE_DEADLINE_S, 0
    while time.monotonic() < deadline:
        ops = httpx.get(f"{url}/v1/operator", headers={"Authorization": f"Bearer {admin}"}, timeout=10).json()
        n = int(ops["queue"].get(cls, 0))
        if n >= want:
            break
        time.sleep(0.2)
    return n


def test_the_queue_depth_counts_every_queued_workload(browser: Any, server: tuple[str, str, str]) -> None:
    url, admin, alice = server
    with Client(alice, url) as sdk:  # no H100 in this fleet: both wait, with nothing to fall back to
        sdk.create_workload("notebook", "wait-one", "h100-80gb")
        sdk.create_workload("notebook", "wait-two", "h100-80gb")
    assert _queued(url, admin, "h100-80gb", 2) == 2
    with Client(admin, url) as sdk:  # another owner's workload is placed: a cycle that decides only some again
        sdk.wait_until(sdk.create_workload("notebook", "placed", "cpu-1c-4g").id, timeout=30, poll_s=0.2)
    page = sign_in(browser, url, admin)
    page.goto(url + "/operator")
    expect(page.locator("#queue tr[data-class=h100-80gb]")).to_have_text(re.compile(r"h100-80gb\s*2"))
    page.context.close()


def _usage_of(owner: str) -> dict[str, Any]:
    """One metered gateway request of ``owner``'s, as a gateway reports it."""
    return {"id": f"rec-{owner}", "at": time.time(), "owner": owner, "key_id": "key_x", "endpoint": "chat",
            "product": "endpoint", "model": "tiny", "served_by": "cpu-2c-8g", "region": "local",
            "prompt_tokens": 3, "completion_tokens": 5, "status": 200}


def test_admins_see_whose_each_row_is(browser: Any, server: tuple[str, str, str]) -> None:
    url, admin, alice = server
    with Client(alice, url) as sdk:
        sdk.create_workload("notebook", "alices", "cpu-1c-4g")
    r = httpx.post(f"{url}/v1/gateway/usage", json={"records": [_usage_of("alice")]},
                   headers={"Authorization": f"Bearer {admin}"}, timeout=10)
    assert r.status_code == 200, r.text
    page = sign_in(browser, url, admin)
    expect(page.locator("thead th", has_text="Owner")).to_have_count(1)
    expect(page.locator("tr[data-name=alices] td.owner")).to_have_text("alice")
    page.goto(url + "/capacity")
    expect(page.locator("#tokens thead th", has_text="Owner")).to_have_count(1)
    expect(page.locator("#tokens tbody tr", has_text="cpu-2c-8g").locator("td.owner")).to_have_text("alice")
    shot(page, "capacity-admin")
    page.context.close()
    page = sign_in(browser, url, alice)
    expect(page.locator("tr[data-name=alices]")).to_be_visible()
    expect(page.locator("th", has_text="Owner")).to_have_count(0)
    expect(page.locator("td.owner")).to_have_count(0)
    page.goto(url + "/capacity")
    expect(page.locator("#tokens")).to_be_visible()
    expect(page.locator("th", has_text="Owner")).to_have_count(0)
    page.context.close()


def test_every_page_fits_a_phone(browser: Any, server: tuple[str, str, str]) -> None:
    url, admin, _ = server
    with Client(admin, url) as sdk:
        w = sdk.create_workload("notebook", "phone-notebook-with-a-rather-long-name", "h100-80gb",
                                fallback=["a100-80gb", "l40s-48gb", "cpu"], fallback_after="30d")
    page = sign_in(browser, url, admin, viewport=PHONE)
    expect(page.get_by_role("heading", name="Workloads")).to_be_visible()
    for path, name in [("/", "workloads"), ("/new", "new"), ("/capacity", "capacity"), ("/operator", "operator"),
                       (f"/workloads/{w.id}", "workload")]:
        page.goto(url + path)
        expect(page.locator("h1")).to_be_visible()
        wide = page.evaluate("Math.max(document.documentElement.scrollWidth, document.body.scrollWidth)")
        shot(page, f"phone-{name}")
        assert wide <= PHONE["width"], f"{path} is {wide} px wide on a {PHONE['width']} px phone"
    page.context.close()

