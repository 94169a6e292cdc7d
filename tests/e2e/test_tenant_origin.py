"""A tenant's JupyterLab never sees the dashboard's credentials, tried as the tenant would: a non-admin owner's
notebook under ``tensora up`` (a real sandbox), with a Jupyter config in its home (the tenant's own: it could
write it from a terminal) that logs every request's headers to a file in that home; the admin signs in to the
dashboard in Chromium, opens the tenant's notebook page and clicks "Open JupyterLab". Nothing logged may hold
the admin key or the value of any cookie the browser holds for the dashboard: browsers send cookies by host,
not port, so the notebook must be served on a host of its own. Checked again after a restart (a new replica).
Where the host has no other loopback address, the notebook's ``*.localhost`` name works in Chromium."""

from __future__ import annotations

import json
import os
import secrets
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tensora.config.catalog import default_catalog
from tensora.drivers import loopback
from tensora.drivers.base import ReplicaSpec
from tensora.drivers.local import Isolation, LocalDriver
from tensora.placement.capacity import Node
from tensora.placement.kinds import ReplicaState, WorkloadKind
from tests.support.browser import CHROMIUM, FLAGS, sign_in
from tests.support.up import api_client, key_for, needs_sandbox, tensora_up

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
playwright_api = pytest.importorskip("playwright.sync_api")

SEEN = "seen-requests.jsonl"
HOOK = f'''
import json, os
def _log_every_request(handler):
    """Tornado calls this once per request it served: the tenant keeps what the browser sent."""
    with open(os.path.join(os.path.expanduser("~"), {SEEN!r}), "a") as f:
        f.write(json.dumps({{"uri": handler.request.uri, "headers": list(handler.request.headers.get_all())}}) + "\\n")
c.ServerApp.tornado_settings = {{"log_function": _log_every_request}}
'''


def _restarted(c: httpx.Client, wid: str, before: str | None, deadline_s: float = 90) -> dict[str, Any]:
    """The workload once it runs with an access URL other than ``before`` (a new replica)."""
    deadline = time.monotonic() + deadline_s
    while True:
        w: dict[str, Any] = c.get(f"/v1/workloads/{wid}").json()
        url = (w.get("access") or {}).get("url")
        if w["state"] == "running" and url and url != before:
            return w
        assert w["state"] != "failed" and time.monotonic() < deadline, w
        time.sleep(0.3)


def _open_jupyterlab(browser: Any, url: str, key: str, wid: str, home: Path) -> tuple[list[dict[str, Any]],
                                                                                     list[str]]:
    """The admin's browser opens the tenant's notebook from the dashboard: what the tenant's server logged while
    JupyterLab loaded, and the values of the cookies the browser holds for the dashboard."""
    (home / SEEN).unlink(missing_ok=True)
    page = sign_in(browser, url, key)
    try:
        page.goto(f"{url}/workloads/{wid}")
        cookies = [c["value"] for c in page.context.cookies(url)]  # the dashboard's, before any of Jupyter's
        with page.context.expect_page() as opened:
            page.get_by_role("link", name="Open JupyterLab").click()
        lab = opened.value
        deadline = time.monotonic() + 60
        while True:  # JupyterLab's page, then its API calls: the browser's ordinary requests to the notebook
            seen = [json.loads(line) for line in (home / SEEN).read_text().splitlines()] \
                if (home / SEEN).exists() else []
            if any(r["uri"].startswith("/lab") for r in seen) and any(r["uri"].startswith("/api/") for r in seen):
                break
            assert time.monotonic() < deadline, f"JupyterLab did not load at {lab.url}: {seen}"
            time.sleep(0.3)
    finally:
        page.context.close()
    return seen, cookies


@pytest.mark.slow
@needs_sandbox
def test_a_tenants_jupyterlab_never_gets_the_dashboards_cookies(tmp_path: Path) -> None:
    with tensora_up(tmp_path) as (_, _log, port, _gw), _browser(tmp_path) as browser:
        data = tmp_path / "data"
        admin_key = (data / "admin-key").read_text().strip()
        url = f"http://127.0.0.1:{port}"
        with api_client(port, admin_key) as admin, api_client(port, key_for(admin, "bob")) as bob:
            wid = bob.post("/v1/workloads", json={"kind": "notebook", "name": "nb", "gpu_class": "cpu-1c-4g"}
                           ).json()["id"]
            first = _restarted(bob, wid, None)
            # 1. the tenant's own Jupyter config, in its home, as it could write it from a terminal
            home = data / "workdirs" / wid
            (home / ".jupyter").mkdir(exist_ok=True)
            (home / ".jupyter" / "jupyter_server_config.py").write_text(HOOK)
            for p in (home / ".jupyter", home / ".jupyter" / "jupyter_server_config.py"):
                os.chown(p, home.stat().st_uid, home.stat().st_gid)
            before = first["access"]["url"]
            for turn in ("after the restart that loads the config", "after one more restart"):
                # 2. a restart: a new replica, which loads the tenant's config
                assert bob.post(f"/v1/workloads/{wid}/restart").status_code == 200
                w = _restarted(bob, wid, before)
                before = w["access"]["url"]
                # 3. the admin opens it from the dashboard
                seen, cookies = _open_jupyterlab(browser, url, admin_key, wid, home)
                assert cookies, "the browser holds no cookie for the dashboard: nothing was checked"
                secrets_ = [admin_key, *cookies]
                leaked = [(r["uri"].split("?")[0], name) for r in seen for name, value in r["headers"]
                          if any(s in value for s in secrets_)]
                assert leaked == [], f"{turn}: the tenant's server got a Tensora credential in {leaked}"
                assert httpx.URL(before).host != "127.0.0.1", (turn, before)


@pytest.mark.slow
def test_where_the_host_has_no_other_loopback_address_a_notebook_gets_a_localhost_name(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """macOS configures only 127.0.0.1: a notebook is bound there, and its URL names ``r-<hex>.localhost``, a host
    of its own to a browser (Chromium resolves every ``*.localhost`` itself), which JupyterLab answers to."""
    monkeypatch.setattr(loopback, "bindable", lambda _address: False)  # as EADDRNOTAVAIL says on such a host
    driver = LocalDriver(tmp_path / "data", Node("box", "local", 4, 16 * 2**30), default_catalog(),
                         isolation=Isolation.NONE)
    rid = "rp_named" + secrets.token_hex(3)
    driver.start(ReplicaSpec(rid, "wl_named", WorkloadKind.NOTEBOOK, "cpu-1c-4g", "box", owner="admin"))
    try:
        deadline = time.monotonic() + 90
        while (seen := {s.id: s for s in driver.observe()}[rid]).state is not ReplicaState.RUNNING:
            assert seen.state is ReplicaState.STARTING and time.monotonic() < deadline, seen
            time.sleep(0.2)
        url = httpx.URL(seen.url)
        assert url.host.startswith("r-") and url.host.endswith(".localhost"), url
        token = url.params["token"]
        with _browser(tmp_path) as browser:
            page = browser.new_page()
            response = page.goto(str(url))
            assert response is not None and response.ok, response
            assert page.evaluate("document.location.hostname") == url.host
            page.close()
        # Jupyter's Host check: its own name passes, any other name is refused
        status = f"http://127.0.0.1:{url.port}/api/status"
        for host, want in ((url.host, 200), ("tensora.example.org", 403)):
            r = httpx.get(status, params={"token": token}, headers={"Host": f"{host}:{url.port}"}, timeout=10)
            assert r.status_code == want, (host, r.status_code)
    finally:
        driver.stop(rid)
        deadline = time.monotonic() + 30
        while {s.id: s for s in driver.observe()}[rid].state is not ReplicaState.STOPPED:
            assert time.monotonic() < deadline
            time.sleep(0.2)


class _browser:
    """Chromium, its home in ``tmp``, closed after."""

    def __init__(self, tmp: Path) -> None:
        self.home = tmp / "chromium-home"

    def __enter__(self) -> Any:
        self.home.mkdir()
        env = {**os.environ, "HOME": str(self.home), "XDG_CONFIG_HOME": str(self.home / "config"),
               "XDG_CACHE_HOME": str(self.home / "cache")}
        self.pw = playwright_api.sync_playwright().start()
        self.b = self.pw.chromium.launch(executable_path=CHROMIUM, headless=True, chromium_sandbox=False,
                                         args=FLAGS, env=env)
        return self.b

    def __exit__(self, *exc: object) -> None:
        self.b.close()
        self.pw.stop()
