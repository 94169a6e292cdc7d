"""The control API's /docs (Swagger UI) and /redoc in a real browser (Debian's chromium driven by Playwright) with
every host but the server's own cut off: both render from what the server itself serves, with no CDN and no fonts
from elsewhere. Every request the pages make that is not to 127.0.0.1 is aborted and recorded; the tests assert
that none reached the network, so a viewer that starts fetching from outside fails here even where the page still
renders."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest

from tests.support.browser import WAIT_MS
from tests.support.browser import browser as browser  # the fixture, imported under its name
from tests.support.services import serving
from tests.support.stack import stack

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]
playwright_api = pytest.importorskip("playwright.sync_api")
__all__ = ["browser"]  # the fixture, shared
expect = playwright_api.expect


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    tmp = tmp_path_factory.mktemp("apidocs")
    s = stack(str(tmp / "tensora.db"), tmp)
    with serving(s.app) as live:
        yield live.url


class Offline:
    """A page on which every request to a host but 127.0.0.1 is aborted before it leaves the browser.

    ``reached``: such requests that got as far as the network (to the route that aborts them): the page fetched
    from outside. ``refused``: those the page's Content-Security-Policy stopped in the browser (never sent).
    ``failed``: the server's own requests that failed (a missing asset)."""

    def __init__(self, browser: Any) -> None:
        self.context = browser.new_context()
        self.reached: list[str] = []
        self.refused: list[str] = []
        self.failed: list[str] = []
        self.context.route("**/*", self._route)
        self.page = self.context.new_page()
        self.page.on("requestfailed", self._failed)

    def _route(self, route: Any) -> None:
        if _local(route.request.url):
            route.continue_()
            return
        self.reached.append(route.request.url)
        route.abort("blockedbyclient")

    def _failed(self, request: Any) -> None:
        if _local(request.url):
            self.failed.append(f"{request.url}: {request.failure}")
        elif request.failure == "csp":
            self.refused.append(request.url)

    def close(self) -> None:
        self.context.close()


def _local(url: str) -> bool:
    target = urlsplit(url)
    return target.scheme in ("data", "blob") or target.hostname == "127.0.0.1"


@pytest.fixture
def offline(browser: Any) -> Iterator[Offline]:
    o = Offline(browser)
    try:
        yield o
    finally:
        o.close()


def test_swagger_ui_renders_every_operation_offline(offline: Offline, url: str) -> None:
    spec = httpx.get(url + "/openapi.json", timeout=10).json()
    operations = sum(1 for item in spec["paths"].values() for m in item if m in ("get", "post", "put", "patch",
                                                                               "delete"))
    assert operations > 10  # the API's, not an empty document
    page = offline.page
    page.goto(url + "/docs")
    expect(page.locator(".swagger-ui .info .title")).to_contain_text("Tensora control API", timeout=WAIT_MS)
    expect(page.locator(".opblock")).to_have_count(operations, timeout=WAIT_MS)
    expect(page.locator(".opblock-summary-path", has_text="/v1/workloads").first).to_be_visible()
    assert offline.reached == []
    assert offline.refused == []
    assert offline.failed == []


def test_redoc_renders_offline(offline: Offline, url: str) -> None:
    page = offline.page
    page.goto(url + "/redoc")
    expect(page.locator(".api-info h1")).to_contain_text("Tensora control API", timeout=WAIT_MS)
    expect(page.get_by_text("CPU means no GPU.").first).to_be_visible()
    expect(page.locator("[data-section-id^='operation/']").first).to_be_attached(timeout=WAIT_MS)
    assert offline.reached == []
    # Redoc's sidebar asks for its maker's logo from their CDN, unconditionally: the page's policy refuses it
    assert set(offline.refused) <= {"https://cdn.redoc.ly/redoc/logo-mini.svg"}
    assert offline.failed == []


def test_the_pages_name_no_other_host(url: str) -> None:
    """What the browser test cannot see (a link that is not followed while the page loads) is checked in the HTML:
    every script, stylesheet and icon is the server's own."""
    for path in ("/docs", "/redoc"):
        html = httpx.get(url + path, timeout=10).text
        assert "http://" not in html and "https://" not in html, path
        for asset in ("/docs-assets/",):
            assert asset in html, path
    for name in ("swagger-ui-bundle.js", "swagger-ui.css", "redoc.standalone.js", "favicon.png"):
        r = httpx.get(f"{url}/docs-assets/{name}", timeout=10)
        assert r.status_code == 200 and len(r.content) > 1000, name
