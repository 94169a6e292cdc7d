"""The dashboard in a real browser (Debian's chromium driven by Playwright; nothing downloaded)
against a real ``tensora serve`` on the simulated fleet (one L40S, one A100, CPU workers).

The story of ADR-0010 as a user sees it: sign in; create an endpoint with CPU fallback and see
the 10-50x warning before submitting; see it placed on CPU with the badge and the reason; a
notebook on CPU while the L40S is taken; the L40S frees, "Restart on GPU" appears without a
reload and takes it there; the usage chart grows. A wrong key and a forged form are refused;
pages read without JavaScript. Where replicas run unsandboxed (``isolation: none``, or a host that cannot
sandbox), every page says so. Screenshots of each page go to ``.cache/artifacts/dashboard``
(``TENSORA_TEST_ARTIFACTS`` elsewhere)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tensora.models.tinymodel import write_tiny_model
from tensora.sdk import Client
from tests.support import services
from tests.support.browser import WAIT_MS, shot, sign_in
from tests.support.browser import browser as browser  # the fixture, imported under its name
from tests.support.dashboard import CSRF, SESSION, cookie, signed_in
from tests.support.serve import served
from tests.support.stack import stack

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
playwright_api = pytest.importorskip("playwright.sync_api")
expect = playwright_api.expect



@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str, Path]]:
    tmp = tmp_path_factory.mktemp("dash")
    write_tiny_model(tmp / "tiny")
    # the story runs one owner's three workloads, two of them on CPU classes of up to 32 vCPUs each
    (tmp / "config.yaml").write_text("quotas: {running_cpu: 128}\n")
    with served(tmp, tmp / "data", "--config", str(tmp / "config.yaml")) as proc:
        yield proc.url, (tmp / "data" / "admin-key").read_text().strip(), tmp


def test_a_wrong_key_is_refused(browser: Any, server: tuple[str, str, Path]) -> None:
    url, _, _ = server
    page = sign_in(browser, url, "tsk_this-is-not-a-key")
    expect(page.locator("#login-error")).to_contain_text("refused")
    shot(page, "login-refused")
    assert not [c for c in page.context.cookies() if c["name"] == SESSION]
    page.goto(url + "/capacity")
    assert page.url.endswith("/login")
    page.context.close()


def test_the_fallback_story(browser: Any, server: tuple[str, str, Path]) -> None:
    url, key, tmp = server
    page = sign_in(browser, url, key)
    expect(page.get_by_role("heading", name="Workloads")).to_be_visible()
    cookie = next(c for c in page.context.cookies() if c["name"] == SESSION)
    assert cookie["httpOnly"] and cookie["secure"] and cookie["sameSite"] == "Strict" and cookie["value"] != key

    with Client(key, url) as sdk:  # the L40S is sold out
        sdk.upload_dir(tmp / "tiny", "tiny")  # a model is named by its name in the owner's files
        holder = sdk.create_workload("notebook", "holder", "l40s-48gb")
        sdk.wait_until(holder.id, timeout=30, poll_s=0.2)

        # an endpoint on a class this fleet lacks, CPU accepted at once: the warning shows before submit
        page.goto(url + "/new")
        page.get_by_label("Kind").select_option("endpoint")
        page.get_by_label("Name").fill("chat")
        page.get_by_label("Class").select_option("h100-80gb")
        expect(page.locator("#cpu-warning")).to_be_hidden()
        page.get_by_label("Fallback 1").select_option("cpu")
        expect(page.locator("#cpu-warning")).to_be_visible()
        expect(page.locator("#cpu-warning")).to_contain_text("10-50x slower")
        page.get_by_label("Fallback after").fill("0")
        page.get_by_label("Model (from your files)").fill("tiny")
        shot(page, "create-cpu-warning")
        page.get_by_role("button", name="Create").click()
        # created; the page says what the form could not: this region has no H100 at all
        expect(page.locator("#created-warnings")).to_contain_text(
            "warning: this region has no h100-80gb (0 of 0); it waits until one is added, or runs on its "
            "fallback (cpu) meanwhile")
        expect(page.locator("#created-warnings")).not_to_contain_text("10-50x")  # shown before submit already
        shot(page, "create-none-in-region")
        page.get_by_role("link", name="Open chat").click()
        expect(page.locator("#state")).to_have_text("running", timeout=WAIT_MS)  # live: no reload
        expect(page.locator(".badge-cpu_fallback").first).to_have_text("CPU fallback")
        expect(page.locator("#reason")).to_contain_text("h100-80gb unavailable (fallback after 0s)")
        expect(page.locator("#placed")).to_contain_text("cpu-")
        expect(page.get_by_text("Gateway")).to_be_visible()
        shot(page, "endpoint-on-cpu")

        # a bad name: the API's message, next to the field; nothing created
        page.goto(url + "/new")
        page.get_by_label("Name").fill("Not A Name")
        page.get_by_role("button", name="Create").click()
        expect(page.locator("#name-error")).to_be_visible()
        shot(page, "create-validation-error")

        # a path on the server is no name in the owner's files: the one message, next to the field
        page.goto(url + "/new")
        page.get_by_label("Kind").select_option("endpoint")
        page.get_by_label("Name").fill("by-path")
        page.get_by_label("Class").select_option("cpu-2c-8g")
        page.get_by_label("Model (from your files)").fill(str(tmp / "tiny"))
        page.get_by_role("button", name="Create").click()
        expect(page.locator("#model-error")).to_have_text("not found in your files or the shared models")

        # a notebook that accepts CPU at once while the L40S is taken
        page.goto(url + "/new")
        page.get_by_label("Name").fill("nb")
        page.get_by_label("Class").select_option("l40s-48gb")
        page.get_by_label("Fallback 1").select_option("cpu")
        page.get_by_label("Fallback after").fill("0")
        page.get_by_role("button", name="Create").click()
        expect(page.locator("#state")).to_have_text("running", timeout=WAIT_MS)
        nb_url = page.url

        page.goto(url + "/")
        row = page.locator("tr[data-name=nb]")
        expect(row.locator(".badge-cpu_fallback")).to_be_visible()
        expect(page.locator("tr[data-name=holder] .badge")).to_have_count(0)
        assert sorted(w.name for w in sdk.iter_workloads()) == ["chat", "holder", "nb"]  # the bad name: nothing
        shot(page, "workloads")

        page.goto(url + "/capacity")
        before = float(page.locator("svg.chart").get_attribute("data-total") or 0)
        expect(page.locator("#capacity tr[data-class=l40s-48gb]")).to_contain_text("0 / 1")
        shot(page, "capacity-usage")

        # the L40S frees: the offer appears on the open page, and takes the notebook there
        page.goto(nb_url)
        expect(page.get_by_role("button", name="Restart on GPU")).to_have_count(0)
        sdk.stop_workload(holder.id)
        expect(page.get_by_role("button", name="Restart on GPU")).to_be_visible(timeout=WAIT_MS)
        shot(page, "restart-on-gpu")
        page.get_by_role("button", name="Restart on GPU").click()
        expect(page.locator("#placed")).to_have_text("l40s-48gb", timeout=WAIT_MS)
        expect(page.locator("#state")).to_have_text("running", timeout=WAIT_MS)
        expect(page.locator(".badge-cpu_fallback")).to_have_count(0)
        expect(page.locator("#events")).to_contain_text("restart requested on l40s-48gb only")

        page.goto(url + "/capacity")
        after = float(page.locator("svg.chart").get_attribute("data-total") or 0)
        assert after > before
        expect(page.locator("svg.chart rect[data-class=l40s-48gb]")).to_have_count(1)

    page.get_by_role("button", name="Sign out").click()
    assert page.url.endswith("/login")
    page.goto(url + "/")
    assert page.url.endswith("/login")
    page.context.close()


def test_an_unknown_workload_is_a_404_page(browser: Any, server: tuple[str, str, Path]) -> None:
    url, key, _ = server
    page = sign_in(browser, url, key)
    response = page.goto(url + "/workloads/wl_nothere")
    assert response is not None and response.status == 404
    expect(page.get_by_role("alert")).to_contain_text("no workload")
    page.context.close()


def test_delete_asks_first_and_says_a_notebooks_files_go(browser: Any, server: tuple[str, str, Path]) -> None:
    url, key, _ = server
    with Client(key, url) as sdk:
        nb = sdk.create_workload("notebook", "scratch", "cpu-1c-4g")
        page = sign_in(browser, url, key)
        page.goto(f"{url}/workloads/{nb.id}")
        asked: list[str] = []
        answers = iter([False, True])  # cancel the first time, confirm the second

        def answer(dialog: Any) -> None:
            asked.append(dialog.message)
            if next(answers):
                dialog.accept()
            else:
                dialog.dismiss()

        page.on("dialog", answer)
        page.get_by_role("button", name="Delete").click()
        page.wait_for_timeout(500)  # a cancelled submit navigates nowhere
        assert page.url.endswith(f"/workloads/{nb.id}") and sdk.get_workload(nb.id).name == "scratch"
        page.get_by_role("button", name="Delete").click()
        expect(page.get_by_role("heading", name="Workloads")).to_be_visible(timeout=WAIT_MS)
        assert asked == ["Delete scratch? Its files go with it."] * 2
        assert nb.id not in {w.id for w in sdk.iter_workloads()}
    page.context.close()


def test_pages_read_without_javascript(browser: Any, server: tuple[str, str, Path]) -> None:
    url, key, _ = server
    page = sign_in(browser, url, key, java_script_enabled=False)
    expect(page.get_by_role("heading", name="Workloads")).to_be_visible()
    page.goto(url + "/capacity")
    expect(page.locator("#capacity")).to_contain_text("l40s-48gb")
    page.context.close()


def test_forms_need_the_csrf_token_and_this_origin(server: tuple[str, str, Path]) -> None:
    url, key, _ = server
    with signed_in(url, key) as c:
        session = f"{SESSION}={cookie(c, SESSION)}"
        r = c.post("/new", data={"kind": "notebook", "name": "forged", "gpu_class": "cpu-1c-4g"},
                   headers={"Cookie": session})
        assert r.status_code == 403 and "CSRF" in r.text
        c.headers["Cookie"] = f"{session}; {CSRF}=t0ken"
        r = c.post("/new", data={"kind": "notebook", "name": "forged", "gpu_class": "cpu-1c-4g", "csrf": "t0ken"},
                   headers={"Origin": "https://evil.example"})
        assert r.status_code == 403 and "another site" in r.text
        r = c.post("/new", data={"kind": "notebook", "name": "same-site", "gpu_class": "cpu-1c-4g", "csrf": "t0ken"})
        assert r.status_code == 303 and r.headers["location"].startswith("/workloads/wl_")
    with Client(key, url) as sdk:
        names = [w.name for w in sdk.iter_workloads()]
    assert "forged" not in names and "same-site" in names


def test_the_dashboard_stays_out_of_the_api_document(server: tuple[str, str, Path]) -> None:
    url, _, _ = server
    paths = httpx.get(url + "/openapi.json").json()["paths"]
    assert all(p.startswith(("/v1/", "/healthz", "/readyz")) for p in paths)


NO_RUNC = "no runc on PATH (Debian: apt-get install runc)"
ISOLATION_NOTICES = {  # the services' isolation -> what every page says (None: nothing)
    "none": "Replicas on this server run without a sandbox (isolation: none): every owner's code runs as "
            "Tensora's user.",
    "admin-only": f"This host cannot sandbox replicas ({NO_RUNC}): only the admin's workloads run here.",
    "sandbox": None,
    None: None,  # not the local driver (the simulated fleet)
}


@pytest.mark.parametrize("isolation", list(ISOLATION_NOTICES), ids=lambda m: str(m))
def test_every_page_says_when_replicas_run_unsandboxed(browser: Any, tmp_path: Path, isolation: str | None) -> None:
    s = stack(str(tmp_path / "t.db"), tmp_path, run_controller=False)
    s.services.isolation = isolation
    s.services.isolation_reason = NO_RUNC if isolation == "admin-only" else None
    want = ISOLATION_NOTICES[isolation]
    try:
        with services.serving(s.app) as live:
            page = browser.new_context().new_page()
            page.goto(live.url + "/login")
            expect(page.locator("#isolation-notice")).to_have_count(0)  # told to signed-in users, as the API does
            page.get_by_label("API key").fill(s.alice)  # an owner who is not the admin
            page.get_by_role("button", name="Sign in").click()
            expect(page.get_by_role("heading", name="Workloads")).to_be_visible()
            for path in ["/", "/new", "/capacity", "/workloads/wl_nothere"]:
                page.goto(live.url + path)
                notice = page.locator("#isolation-notice")
                if want is None:
                    expect(notice).to_have_count(0)
                    text = page.locator("body").inner_text()
                    assert "without a sandbox" not in text and "cannot sandbox" not in text
                else:
                    expect(notice).to_be_visible()
                    expect(notice).to_have_text(want)
            if want is not None:
                shot(page, f"isolation-{isolation}")
            page.context.close()
    finally:
        s.services.db.dispose()
