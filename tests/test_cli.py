"""The ``tensora`` command as people and scripts run it: the real entry point in a child process,
against a real ``tensora serve`` (simulated fleet with no GPU free, so fallbacks happen), through
the SDK. Exit codes, ``-o json``, ``--wait`` following state and reason, keys, login."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from services import free_port
from test_serve import FAST, _command, served

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

NODES = """nodes:
  - name: cpu-1
    region: local
    allocatable: {cpu: 64, memory: 256Gi}
"""


@dataclass
class Cli:
    url: str
    admin: str
    tmp: Path

    def env(self, **extra: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("TENSORA_")}
        env.update(FAST)
        env.update({"TENSORA_API_URL": self.url, "TENSORA_API_KEY": self.admin,
                    "TENSORA_CONFIG": str(self.tmp / "profiles.json"), "COLUMNS": "200"})
        env.update(extra)
        return {k: v for k, v in env.items() if v != ""}

    def __call__(self, *args: str, code: int = 0, stdin: str = "", **env: str) -> subprocess.CompletedProcess[str]:
        r = subprocess.run([*_command(), *args], capture_output=True, text=True, env=self.env(**env), timeout=120,
                           input=stdin, cwd=self.tmp)
        assert r.returncode == code, f"tensora {' '.join(args)} -> {r.returncode}\n{r.stdout}\n{r.stderr}"
        return r

    def json(self, *args: str, **env: str) -> Any:
        return json.loads(self(*args, "-o", "json", **env).stdout)

    def popen(self, *args: str) -> subprocess.Popen[str]:
        return subprocess.Popen([*_command(), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env=self.env(), cwd=self.tmp)


@pytest.fixture(scope="module")
def cli(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cli]:
    tmp = tmp_path_factory.mktemp("cli")
    (tmp / "nodes.yaml").write_text(NODES)
    with served(tmp, tmp / "data", "--nodes", str(tmp / "nodes.yaml")) as proc:
        yield Cli(proc.url, (tmp / "data" / "admin-key").read_text().strip(), tmp)


def test_create_with_cpu_fallback_waits_shows_why_and_lands_on_cpu(cli: Cli) -> None:
    r = cli("notebook", "create", "nb", "--gpu-class", "l40s-48gb", "--fallback", "cpu", "--fallback-after", "4s",
            "--wait", "--timeout", "60s")
    assert "10-50x slower" in r.stderr  # CPU fallback enabled: the warning
    lines = r.stderr.splitlines()
    assert any(line.startswith("nb: queued: waiting for l40s-48gb") and "fallback to cpu" in line for line in lines)
    placed = [line for line in lines if ": placed on cpu-" in line and "l40s-48gb unavailable for 4s" in line]
    assert placed and placed[-1].startswith("nb: running: ")  # (starting may pass between two polls)
    assert "running" in r.stdout and "(fallback)" in r.stdout and "cpu_fallback" in r.stdout

    w = cli.json("workloads", "get", "nb")
    assert (w["state"], w["requested_class"]) == ("running", "l40s-48gb") and w["placed_class"].startswith("cpu-")
    assert w["conditions"][0]["reason"] == "cpu_fallback"
    assert [x["id"] for x in cli.json("workloads", "list")["data"]] == [w["id"]]
    assert cli.json("workloads", "list", "--state", "queued")["data"] == []

    events = cli.json("workloads", "events", "nb")["data"]
    assert [e["to_state"] for e in events if e["type"] == "transition"][:3] == ["queued", "starting", "running"]
    table = cli("workloads", "events", w["id"]).stdout
    assert f"placed on {w['placed_class']}" in table and "queued -> starting" in table

    time.sleep(1.0)
    usage = cli.json("usage")
    rows = {row["placed_class"]: row["seconds"] for row in usage["data"]}
    assert rows.get(w["placed_class"], 0) > 0 and "l40s-48gb" not in rows  # accounted where it ran
    assert w["placed_class"] in cli("usage", "--group-by", "placed_class,day").stdout

    assert cli("workloads", "stop", "nb", "-o", "json").stdout
    cli("workloads", "delete", "nb")
    cli("workloads", "get", w["id"], code=1)


def test_catalog_shows_classes_and_free_capacity(cli: Cli) -> None:
    cat = cli.json("catalog")
    by = {c["name"]: c for c in cat["data"]}
    assert by["l40s-48gb"]["capacity"]["local"] == {"free": 0, "total": 0}  # the fleet has no GPU
    assert by["cpu-2c-8g"]["capacity"]["local"]["total"] > 0
    out = cli("catalog").stdout
    assert "l40s-48gb" in out and "10-50x slower" in out


def test_wait_timeout_exits_3_and_the_workload_keeps_waiting(cli: Cli) -> None:
    r = cli("vm", "create", "stuck", "--gpu-class", "a100-80gb", "--wait", "--timeout", "1s", code=3)
    assert "still queued" in r.stderr and "10-50x" not in r.stderr  # no CPU in its fallback: no warning
    assert cli.json("workloads", "get", "stuck")["state"] == "queued"
    cli("workloads", "delete", "stuck")


def test_a_workload_stopped_while_waited_for_exits_5(cli: Cli) -> None:
    waiter = cli.popen("notebook", "create", "doomed", "--gpu-class", "l40s-48gb", "--wait", "--timeout", "60s")
    try:
        deadline = time.monotonic() + 30
        while not [w for w in cli.json("workloads", "list")["data"]
                   if w["name"] == "doomed" and w["reason"].startswith("waiting for")]:
            assert time.monotonic() < deadline and waiter.poll() is None
            time.sleep(0.2)
        cli("workloads", "stop", "doomed")
        _, err = waiter.communicate(timeout=30)
    finally:
        if waiter.poll() is None:
            waiter.kill()
            waiter.wait()
    assert waiter.returncode == 5, err
    assert "doomed: queued: waiting for l40s-48gb" in err and "is stopped" in err
    cli("workloads", "delete", "doomed")


def test_exit_codes(cli: Cli) -> None:
    r = cli("workloads", "get", "wl_nothere", code=1)
    assert "404" in r.stderr and "no workload" in r.stderr
    r = cli("notebook", "create", "x", "--gpu-class", "no-such-class", code=1)
    assert "422" in r.stderr and "gpu_class" in r.stderr
    cli("notebook", "create", "x", code=2)  # --gpu-class missing
    cli("workloads", "list", "-o", "yaml", code=2)
    r = cli("workloads", "list", code=4, TENSORA_API_URL=f"http://127.0.0.1:{free_port()}")
    assert "cannot reach the control API" in r.stderr
    r = cli("workloads", "list", code=2, TENSORA_API_KEY="")
    assert "no API key" in r.stderr
    r = cli("workloads", "list", code=1, TENSORA_API_KEY="tsk_not-a-real-key")
    assert "401" in r.stderr and "tsk_not-a-real-key" not in r.stderr


def test_keys_scopes_and_revocation(cli: Cli) -> None:
    k = cli.json("keys", "create", "--name", "ci", "--scope", "workloads:read")
    assert k["key"] and k["scopes"] == ["workloads:read"]
    listed = cli.json("keys", "list")["data"]
    assert any(x["id"] == k["id"] and x["key"] is None for x in listed)
    assert k["key"] not in cli("keys", "list").stdout
    cli("workloads", "list", TENSORA_API_KEY=k["key"])
    r = cli("notebook", "create", "x", "--gpu-class", "cpu-2c-8g", code=1, TENSORA_API_KEY=k["key"])
    assert "403" in r.stderr
    cli("keys", "revoke", k["id"])
    cli("workloads", "list", code=1, TENSORA_API_KEY=k["key"])


def test_an_admin_marks_an_owner_untrusted_and_back(cli: Cli) -> None:
    assert cli.json("owners", "set", "mallory", "--untrusted") == {
        "owner": "mallory", "untrusted": True, "updated_at": cli.json("owners", "get", "mallory")["updated_at"]}
    assert "mallory" in cli("owners", "list").stdout
    assert cli.json("owners", "set", "mallory", "--trusted")["untrusted"] is False
    assert [o["owner"] for o in cli.json("owners", "list")["data"]] == ["mallory"]
    cli("owners", "set", "mallory", code=2)  # --untrusted or --trusted: one must be said
    r = cli("owners", "set", "bad name", "--untrusted", code=1)
    assert "422" in r.stderr and "owner" in r.stderr


def test_login_saves_a_private_profile_that_later_commands_use(cli: Cli) -> None:
    cfg = cli.tmp / "profiles.json"
    r = cli("login", "--key-file", str(cli.tmp / "data" / "admin-key"), TENSORA_API_KEY="")
    assert "profile 'default' saved" in r.stdout and cli.admin not in r.stdout
    assert stat.S_IMODE(cfg.stat().st_mode) == 0o600
    saved = json.loads(cfg.read_text())
    assert saved["profiles"]["default"] == {"api_url": cli.url, "api_key": cli.admin,
                                            "gateway_url": "http://127.0.0.1:8701"}
    assert cli.json("workloads", "list", TENSORA_API_KEY="", TENSORA_API_URL="")["data"] is not None
    before = cfg.read_text()
    r = cli("--api-url", cli.url, "login", "--profile", "other", code=1, stdin="tsk_wrong\n", TENSORA_API_KEY="")
    assert "refused" in r.stderr and cfg.read_text() == before  # nothing written
    r = cli("--profile", "nope", "workloads", "list", code=2, TENSORA_API_KEY="")
    assert "no profile 'nope'" in r.stderr
