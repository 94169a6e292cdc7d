"""The dashboard's operator page in a real browser against a real ``tensora serve`` (HTTP in a worker process,
the controller in the supervisor): after a scripted fallback placement the admin sees it counted (requested ->
placed), time to placement and an empty queue, read from the supervisor's metrics listener over loopback; the
gateway's listener does not answer, and the page says so. An owner (alice) gets the API's 403, and its page."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tensora.sdk import Client
from tests.support.browser import WAIT_MS, shot, sign_in
from tests.support.browser import browser as browser  # the fixture, imported under its name
from tests.support.dashboard import signed_in
from tests.support.serve import served_with_an_owner
from tests.support.services import free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
playwright_api = pytest.importorskip("playwright.sync_api")
expect = playwright_api.expect
__all__ = ["browser"]  # the fixture, shared


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str, str]]:
    env = {"TENSORA_METRICS_LISTEN": f"127.0.0.1:{free_port()}",
           "TENSORA_GATEWAY_METRICS_LISTEN": f"127.0.0.1:{free_port()}"}  # nothing listens there
    with served_with_an_owner(tmp_path_factory.mktemp("ops"), env) as keys:
        yield keys


def test_the_admin_sees_a_fallback_placement(browser: Any, server: tuple[str, str, str]) -> None:
    url, admin, _ = server
    with Client(admin, url) as sdk:  # the L40S taken, then a notebook that accepts the A100 at once
        holder = sdk.create_workload("notebook", "holder", "l40s-48gb")
        sdk.wait_until(holder.id, timeout=30, poll_s=0.2)
        nb = sdk.create_workload("notebook", "nb", "l40s-48gb", fallback=["a100-80gb"], fallback_after="0s")
        assert sdk.wait_until(nb.id, timeout=30, poll_s=0.2).placed_class == "a100-80gb"
    ops = httpx.get(f"{url}/v1/operator", headers={"Authorization": f"Bearer {admin}"}, timeout=10).json()
    assert ops["control"] and not ops["gateway"] and ops["fallbacks"] == {"l40s-48gb -> a100-80gb": 1}
    assert ops["time_to_placement"]["p50"] is not None and ops["window_s"] is None
    page = sign_in(browser, url, admin)
    expect(page.get_by_role("heading", name="Workloads")).to_be_visible()
    page.goto(url + "/operator")
    expect(page.locator("h1")).to_contain_text("Operator")
    expect(page.locator("#window")).to_have_text("totals since the servers started")  # not an hour of samples yet
    expect(page.locator("#fallbacks tbody tr")).to_have_count(1)
    expect(page.locator("#fallbacks tbody tr")).to_have_text("l40s-48gb -> a100-80gb1", timeout=WAIT_MS)
    expect(page.locator('rect[data-label="l40s-48gb -> a100-80gb"]')).to_have_attribute("data-value", "1")
    expect(page.locator("#placement")).not_to_contain_text("–")  # p50 and p99 are figures
    expect(page.locator("#queue")).to_contain_text("nothing waiting")
    expect(page.locator("#gateway-unavailable")).to_have_text("gateway metrics unavailable")
    expect(page.locator("#control-unavailable")).to_have_count(0)
    shot(page, "operator")
    page.context.close()


def test_an_owner_is_refused(browser: Any, server: tuple[str, str, str]) -> None:
    url, _, alice = server
    assert httpx.get(f"{url}/v1/operator", headers={"Authorization": f"Bearer {alice}"}).status_code == 403
    page = sign_in(browser, url, alice)
    expect(page.get_by_role("heading", name="Workloads")).to_be_visible()
    response = page.goto(url + "/operator")
    assert response is not None and response.status == 403
    expect(page.locator("body")).to_contain_text("The operator page is for admin keys.")
    expect(page.locator("#fallbacks")).to_have_count(0)
    page.context.close()


def test_without_javascript_the_page_reads_the_same(server: tuple[str, str, str], tmp_path: Path) -> None:
    url, admin, _ = server
    with signed_in(url, admin) as c:
        r = c.get("/operator")
    assert r.status_code == 200 and "Fallback placements" in r.text and "gateway metrics unavailable" in r.text
