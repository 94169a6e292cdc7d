"""A real browser for the dashboard's tests: Debian's chromium driven by Playwright (a test module that asks for
``browser`` skips itself where Playwright is not installed: ``pytest.importorskip("playwright.sync_api")``)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

CHROMIUM = "/usr/bin/chromium"
FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run"]
ARTIFACTS = Path(os.environ.get("TENSORA_TEST_ARTIFACTS") or Path(__file__).parents[2] / ".cache" / "artifacts")
WAIT_MS = 20_000


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """Headless chromium with a home of its own, for a module's tests."""
    from playwright.sync_api import sync_playwright

    if not Path(CHROMIUM).exists():
        pytest.fail(f"{CHROMIUM} is missing: ./scripts/test installs Debian's chromium")
    home = tmp_path_factory.mktemp("chromium-home")
    env: dict[str, str | float | bool] = {**os.environ, "HOME": str(home), "XDG_CONFIG_HOME": str(home / "config"),
                                          "XDG_CACHE_HOME": str(home / "cache")}
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, headless=True, chromium_sandbox=False, args=FLAGS, env=env)
        try:
            yield b
        finally:
            b.close()


def shot(page: Any, name: str) -> None:
    """A full-page screenshot of ``page`` into the artifacts' dashboard folder."""
    out = ARTIFACTS / "dashboard"
    out.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(out / f"{name}.png"), full_page=True)


def sign_in(browser: Any, url: str, key: str, **context: Any) -> Any:
    """A new page (in a new context) signed in to the dashboard at ``url`` with ``key``."""
    page = browser.new_context(**context).new_page()
    page.goto(url + "/")
    assert page.url.endswith("/login")
    page.get_by_label("API key").fill(key)
    page.get_by_role("button", name="Sign in").click()
    return page
