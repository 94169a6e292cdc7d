"""The ``tensora`` command as people and scripts run it: the real entry point in a child process,
against a real ``tensora serve`` (simulated fleet with no GPU free, so fallbacks happen), through
the SDK. Exit codes, ``-o json``, ``--wait`` following state and reason, keys, login (and its finding
the local admin key), errors naming flags, output that copies whole (piped, and on an 80-column
terminal), and ``tensora chat`` through a real gateway saying what answered."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import pty
import re
import stat
import struct
import subprocess
import termios
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tensora.gateway.breaker import Policy
from tensora.gateway.limits import MemoryLimiter
from tensora.gateway.proxy import Gateway, Options
from tensora.gateway.routes import RouteTable
from tensora.models.tinymodel import write_tiny_model
from tests.support.gateway_harness import Backends, make_table, replica, serving
from tests.support.serve import FAST, command, served
from tests.support.services import free_port

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
                    "TENSORA_CONFIG": str(self.tmp / "profiles.json"), "COLUMNS": "200",
                    "TENSORA_DATA_DIR": str(self.tmp / "no-data")})  # login finds no admin key unless told
        env.update(extra)
        return {k: v for k, v in env.items() if v != ""}

    def __call__(self, *args: str, code: int = 0, stdin: str = "", **env: str) -> subprocess.CompletedProcess[str]:
        r = subprocess.run([*command(), *args], capture_output=True, text=True, env=self.env(**env), timeout=120,
                           input=stdin, cwd=self.tmp)
        assert r.returncode == code, f"tensora {' '.join(args)} -> {r.returncode}\n{r.stdout}\n{r.stderr}"
        return r

    def json(self, *args: str, **env: str) -> Any:
        return json.loads(self(*args, "-o", "json", **env).stdout)

    def popen(self, *args: str) -> subprocess.Popen[str]:
        return subprocess.Popen([*command(), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env=self.env(), cwd=self.tmp)

    def on_terminal(self, *args: str, columns: int = 80) -> str:
        """stdout of ``tensora ARGS`` on a pseudo-terminal ``columns`` wide, styles taken out."""
        parent, child = pty.openpty()
        fcntl.ioctl(child, termios.TIOCSWINSZ, struct.pack("HHHH", 24, columns, 0, 0))
        proc = subprocess.Popen([*command(), *args], stdin=subprocess.DEVNULL, stdout=child,
                                stderr=subprocess.PIPE, env=self.env(COLUMNS=str(columns), TERM="xterm"), cwd=self.tmp)
        os.close(child)
        data = b""
        with contextlib.suppress(OSError):  # EIO once the child has exited and closed its end
            while chunk := os.read(parent, 65536):
                data += chunk
        os.close(parent)
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, f"tensora {' '.join(args)} -> {proc.returncode}\n{err.decode()}"
        return ANSI.sub("", data.decode()).replace("\r\n", "\n")


ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


@pytest.fixture(scope="module")
def cli(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cli]:
    tmp = tmp_path_factory.mktemp("cli")
    (tmp / "nodes.yaml").write_text(NODES)
    with served(tmp, tmp / "data", "--nodes", str(tmp / "nodes.yaml")) as proc:
        yield Cli(proc.url, (tmp / "data" / "admin-key").read_text().strip(), tmp)


def test_create_with_cpu_fallback_waits_shows_why_and_lands_on_cpu(cli: Cli) -> None:
    r = cli("notebook", "create", "nb", "--gpu-class", "l40s-48gb", "--fallback", "cpu", "--fallback-after", "4s",
            "--wait", "--timeout", "60s")
    assert "warning: CPU fallback is enabled" in r.stderr
    lines = r.stderr.splitlines()
    assert any(line.startswith("nb: queued: this region has no l40s-48gb (0 of 0)") and "fallback to cpu" in line
               for line in lines)  # the fleet has no GPU: not "0 GPU free", as if one were busy
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


def test_a_stopped_vm_says_how_to_start_it_again(cli: Cli) -> None:
    cli("vm", "create", "parked", "--gpu-class", "cpu-1c-4g", "--wait", "--timeout", "60s")
    cli("workloads", "stop", "parked")
    for _ in range(100):  # bounded: the controller records the stop within a few ticks
        if cli.json("workloads", "get", "parked")["state"] == "stopped":
            break
        time.sleep(0.1)
    shown = cli.on_terminal("workloads", "get", "parked", columns=80)
    assert "access     stopped: start it again with tensora workloads restart parked" in shown.splitlines(), shown
    cli("workloads", "delete", "parked")


def test_catalog_shows_classes_and_free_capacity(cli: Cli) -> None:
    cat = cli.json("catalog")
    by = {c["name"]: c for c in cat["data"]}
    assert by["l40s-48gb"]["capacity"]["local"] == {"free": 0, "total": 0}  # the fleet has no GPU
    assert by["cpu-2c-8g"]["capacity"]["local"]["total"] > 0
    assert by["l40s-48gb"]["short"] == {"local": "this region has none"}
    out = cli("catalog").stdout
    assert "l40s-48gb" in out and "10-50x slower" in out
    row = next(line for line in out.splitlines() if line.startswith("l40s-48gb"))
    assert "this region has none" in " ".join(out.split()) and "0/0" in row


def test_create_on_a_class_the_region_has_none_of_warns(cli: Cli) -> None:
    r = cli("notebook", "create", "no-gpu-here", "--gpu-class", "l40s-48gb")  # the fleet has no GPU
    said = " ".join(r.stderr.split())
    assert ("warning: this region has no l40s-48gb (0 of 0); it waits until one is added, or add a fallback"
            in said), r.stderr
    assert said.count("warning:") == 1
    cli("workloads", "delete", "no-gpu-here")


def test_wait_timeout_exits_3_and_the_workload_keeps_waiting(cli: Cli) -> None:
    r = cli("vm", "create", "stuck", "--gpu-class", "a100-80gb", "--wait", "--timeout", "1s", code=3)
    assert "still queued" in r.stderr and "10-50x" not in r.stderr  # no CPU in its fallback: no warning
    assert cli.json("workloads", "get", "stuck")["state"] == "queued"
    cli("workloads", "delete", "stuck")


def test_a_workload_stopped_while_waited_for_exits_5(cli: Cli) -> None:
    waiter = cli.popen("notebook", "create", "doomed", "--gpu-class", "l40s-48gb", "--wait", "--timeout", "60s")
    try:
        # stopped once the waiter has shown the wait (the row saying it is not enough: the waiter polls, and a
        # stop between its polls would pass from "queued for" to "stopped" without it); it times out at 60 s
        seen = []
        while not seen or "doomed: queued: this region has no l40s-48gb" not in seen[-1]:
            line = waiter.stderr.readline() if waiter.stderr is not None else ""
            assert line, f"the waiter ended before it showed the wait: {seen}"
            seen.append(line)
        cli("workloads", "stop", "doomed")
        _, rest = waiter.communicate(timeout=30)
    finally:
        if waiter.poll() is None:
            waiter.kill()
            waiter.wait()
    err = "".join(seen) + rest
    assert waiter.returncode == 5, err
    assert "doomed: queued: this region has no l40s-48gb" in err and "is stopped" in err
    cli("workloads", "delete", "doomed")


def test_exit_codes(cli: Cli) -> None:
    r = cli("workloads", "get", "wl_nothere", code=1)
    assert "404" in r.stderr and "no workload" in r.stderr
    r = cli("notebook", "create", "x", "--gpu-class", "no-such-class", code=1)
    assert "422 --gpu-class: unknown class 'no-such-class'" in r.stderr and "(API field gpu_class)" in r.stderr
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


def test_an_admin_marks_an_owner_trusted_and_back(cli: Cli) -> None:
    tom = cli.json("owners", "get", "tom")
    assert (tom["owner"], tom["trusted"], tom["updated_at"], tom["overridden"]) == ("tom", False, None, [])
    assert cli.json("owners", "set", "tom", "--trusted") == {
        **tom, "trusted": True, "updated_at": cli.json("owners", "get", "tom")["updated_at"]}
    assert "tom" in cli("owners", "list").stdout
    assert cli.json("owners", "set", "tom", "--untrusted")["trusted"] is False
    assert [o["owner"] for o in cli.json("owners", "list")["data"]] == ["tom"]
    cli("owners", "set", "tom", code=2)  # nothing to set: one of the flags must be said
    r = cli("owners", "set", "bad name", "--trusted", code=1)
    assert "422" in r.stderr and "owner" in r.stderr


def test_an_admin_sets_an_owners_quotas_and_limits_and_the_owner_reads_them(cli: Cli) -> None:
    got = cli.json("owners", "set", "uma", "--quota", "keys=3", "--quota", "storage_bytes=50Gi",
                   "--limit", "requests_per_minute=600")
    assert (got["quotas"]["keys"], got["quotas"]["storage_bytes"], got["limits"]["requests_per_minute"]) == (
        3, 50 * 2**30, 600)
    assert got["overridden"] == ["quotas.keys", "quotas.storage_bytes", "limits.requests_per_minute"]
    uma = cli.json("keys", "create", "--owner", "uma", "--name", "uma")["key"]
    shown = cli("owners", "get", "uma", TENSORA_API_KEY=uma).stdout  # the owner reads its own
    keys_row = next(line for line in shown.splitlines() if line.startswith("quotas.keys"))
    assert keys_row.split()[:3] == ["quotas.keys", "3", "1"] and "set for this owner" in keys_row
    assert "50Gi" in shown and "server default" in shown
    assert cli.json("owners", "set", "uma", "--quota", "keys=default")["overridden"] == [
        "quotas.storage_bytes", "limits.requests_per_minute"]
    r = cli("owners", "set", "uma", "--quota", "keys=-1", code=1)
    assert "422" in r.stderr and "--quota keys" in r.stderr
    assert "NAME one of" in cli("owners", "set", "uma", "--quota", "gpus=2", code=2).stderr
    r = cli("owners", "set", "uma", "--limit", "requests_per_minute=9", code=1, TENSORA_API_KEY=uma)
    assert "403" in r.stderr


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


def test_login_on_this_machine_finds_the_admin_key_of_tensora_up(cli: Cli) -> None:
    data, cfg = cli.tmp / "data", cli.tmp / "profiles-local.json"
    r = cli("login", "--profile", "here", TENSORA_API_KEY="", TENSORA_DATA_DIR=str(data), TENSORA_CONFIG=str(cfg))
    assert f"with the admin key in {data / 'admin-key'}" in r.stdout and cli.admin not in r.stdout + r.stderr
    assert "made current" in r.stdout
    assert json.loads(cfg.read_text())["profiles"]["here"]["api_key"] == cli.admin
    # a data dir without one, and nothing piped in: no key
    r = cli("login", code=2, TENSORA_API_KEY="", TENSORA_CONFIG=str(cfg), stdin="\n")
    assert "no API key given" in r.stderr
    # an API elsewhere (not a loopback address): the local key is not offered to it
    r = cli("--api-url", "http://192.0.2.1:8700", "login", code=2, TENSORA_API_KEY="", TENSORA_DATA_DIR=str(data),
            TENSORA_CONFIG=str(cfg), stdin="\n")
    assert "no API key given" in r.stderr
    # a key file that is not this server's: refused, and the message says which file
    other = cli.tmp / "other-data"
    other.mkdir(exist_ok=True)
    (other / "admin-key").write_text("tsk_5KEdT7TvpN2hwH4SSDKEfcA1m0C6KhFj3IpWR9\n")
    r = cli("login", code=1, TENSORA_API_KEY="", TENSORA_DATA_DIR=str(other), TENSORA_CONFIG=str(cfg))
    assert f"the API refused the key in {other / 'admin-key'}" in r.stderr and "401" in r.stderr


def test_login_takes_the_key_as_its_own_option_or_piped_in_over_the_admin_key(cli: Cli) -> None:
    data, cfg = cli.tmp / "data", cli.tmp / "profiles-piped.json"
    ada = cli.json("keys", "create", "--owner", "ada", "--name", "ada")["key"]
    env = {"TENSORA_API_KEY": "", "TENSORA_DATA_DIR": str(data), "TENSORA_CONFIG": str(cfg)}
    r = cli("login", "--api-key", ada, "--profile", "flag", **env)
    assert f"(...{ada[-4:]}); profile 'flag' saved" in r.stdout and ada not in r.stdout + r.stderr
    saved = json.loads(cfg.read_text())
    assert saved["profiles"]["flag"]["api_key"] == ada and saved["current"] == "flag"
    # piped in, it wins over the admin key this machine's data dir holds
    r = cli("login", "--profile", "piped", stdin=f"{ada}\n", **env)
    assert "admin key" not in r.stdout and json.loads(cfg.read_text())["profiles"]["piped"]["api_key"] == ada
    # the profile just made current is what later commands use: ada's key sees only ada's workloads
    assert cli.json("workloads", "list", TENSORA_API_KEY="", TENSORA_API_URL="", TENSORA_CONFIG=str(cfg))["data"] == []
    # an admin's tables say whose each row is; an owner's do not
    assert cli("workloads", "list").stdout.splitlines()[0].split()[:3] == ["id", "name", "owner"]
    assert cli("usage", "--tokens").stdout.splitlines()[0].split()[:2] == ["owner", "endpoint"]
    assert cli("workloads", "list", TENSORA_API_KEY=ada).stdout.splitlines()[0].split()[:3] == ["id", "name", "kind"]
    assert cli("usage", "--tokens", TENSORA_API_KEY=ada).stdout.splitlines()[0].split()[0] == "endpoint"
    r = cli("login", "--api-key", "tsk_wrong", "--profile", "bad", code=1, **env)
    assert "refused the key" in r.stderr and "bad" not in json.loads(cfg.read_text())["profiles"]


ERRORS = {  # args -> what the error must say: the flag typed, and the API's field
    "a duration that is not one": (["notebook", "create", "x", "--gpu-class", "l40s-48gb", "--fallback-after",
                                    "banana"], "--fallback-after:", "fallback_after_s"),
    "an unknown class in the fallback list": (["vm", "create", "x", "--gpu-class", "l40s-48gb", "--fallback",
                                               "a100-80gb,bogus"], "--fallback:", "fallback[1]"),
    "an unknown class": (["notebook", "create", "x", "--gpu-class", "nope"], "--gpu-class:", "gpu_class"),
    "a model that is not there": (["endpoint", "create", "x", "--gpu-class", "cpu-2c-8g", "--model", "missing"],
                                  "--model:", "model"),
    "a bad name": (["notebook", "create", "Bad Name", "--gpu-class", "l40s-48gb"], "NAME:", "name"),
    "another region": (["notebook", "create", "x", "--gpu-class", "l40s-48gb", "--region", "mars"], "--region:",
                       "region"),
    "an unknown scope": (["keys", "create", "--scope", "everything"], "--scope:", "scopes[0]"),
    "a rate of zero": (["keys", "create", "--rpm", "0"], "--rpm:", "requests_per_minute"),
    "an unknown grouping": (["usage", "--group-by", "colour"], "--group-by:", "group_by"),
    "an unknown state": (["workloads", "list", "--state", "sleeping"], "--state:", "state"),
}


@pytest.mark.parametrize(("args", "flag", "api_field"), ERRORS.values(), ids=ERRORS.keys())
def test_api_errors_name_the_flag_typed(cli: Cli, args: list[str], flag: str, api_field: str) -> None:
    r = cli(*args, code=1)
    assert f"error: 422 {flag} " in r.stderr and f"(API field {api_field})" in r.stderr, r.stderr


def test_a_model_or_image_only_on_this_machine_says_to_upload_it(cli: Cli) -> None:
    """The server reads only uploaded files: a name that is a local path here gets the command that uploads it."""
    write_tiny_model(cli.tmp / "here-only")
    (cli.tmp / "disk.qcow2").write_bytes(b"QFI\xfb" + bytes(60))
    cases = [(["endpoint", "create", "x", "--gpu-class", "cpu-2c-8g", "--model", "here-only"],
              "here-only is a directory on this machine; the server reads only your uploaded files: "
              "tensora files upload here-only, then --model here-only"),
             (["endpoint", "create", "x", "--gpu-class", "cpu-2c-8g", "--model", str(cli.tmp / "here-only")],
              f"tensora files upload {cli.tmp / 'here-only'}, then --model here-only"),
             (["vm", "create", "x", "--gpu-class", "cpu-2c-8g", "--image", "./disk.qcow2"],
              "./disk.qcow2 is a file on this machine; the server reads only your uploaded files: "
              "tensora files upload ./disk.qcow2, then --image disk.qcow2")]
    for args, hint in cases:
        r = cli(*args, code=1)
        assert "error: 422 --" in r.stderr and "not found in your files or the shared models" in r.stderr, r.stderr
        assert hint in r.stderr, r.stderr
    r = cli("endpoint", "create", "x", "--gpu-class", "cpu-2c-8g", "--model", "nowhere", code=1)
    assert "tensora files upload" not in r.stderr  # nothing here by that name: no hint


def _whole(text: str, ids: list[str]) -> None:
    """Every id on a line of its own making (never split across two), and no line ending in a space."""
    lines = text.splitlines()
    assert lines and [line for line in lines if line != line.rstrip()] == [], text
    for i in ids:
        assert any(i in line for line in lines), f"{i} not whole in:\n{text}"


def test_output_copies_whole_piped_and_on_an_80_column_terminal(cli: Cli) -> None:
    long = cli.json("vm", "create", "a-rather-long-virtual-machine-name-for-the-table", "--gpu-class", "a100-80gb",
                    "--fallback", "h100-80gb", "--fallback-after", "1h")
    nb = cli.json("notebook", "create", "copyme", "--gpu-class", "l40s-48gb", "--fallback", "cpu",
                  "--fallback-after", "0", "--wait", "--timeout", "60s")
    key = cli.json("keys", "create", "--name", "a-key-with-a-long-name-for-the-table", "--scope", "workloads:read",
                   "--scope", "usage:read", "--scope", "inference")
    wids = [long["id"], nb["id"], nb["placed_class"], long["name"]]
    try:
        for args, ids in [(["workloads", "list"], wids),
                          (["workloads", "get", nb["id"]], [nb["id"], nb["placed_class"]]),
                          (["workloads", "events", nb["id"]], [nb["placed_class"]]),
                          (["keys", "list"], [key["id"], key["name"]]), (["catalog"], ["cpu-32c-128g"]),
                          (["usage", "--group-by", "placed_class,kind"], [nb["placed_class"]]),
                          (["runtime", "list"], ["tensora-transformers", "tensora-vllm-cpu"])]:
            piped = cli(*args, COLUMNS="80").stdout
            _whole(piped, ids)
            on_80 = cli.on_terminal(*args)
            _whole(on_80, ids)
        # a table has its header; a wait shows as it was typed; a time names its zone
        assert cli("runtime", "list").stdout.splitlines()[0].split() == ["name", "installed", "preferred", "for",
                                                                          "description"]
        assert "fallback   h100-80gb, after 1h\n" in cli("workloads", "get", long["id"]).stdout
        first = cli("workloads", "events", nb["id"]).stdout.splitlines()[1]
        assert re.match(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d [A-Z+-][A-Za-z0-9+-]* ", first), first
        # piped: one line per row, whatever COLUMNS says
        rows = cli("workloads", "list", COLUMNS="80").stdout.splitlines()
        assert len(rows) == 1 + len(cli.json("workloads", "list")["data"])
        # on the terminal, a table that fits when its reasons wrap is drawn within the 80 columns
        events = cli.on_terminal("workloads", "events", nb["id"]).splitlines()
        assert max(len(line) for line in events) <= 80 and len(events) > 4, "\n".join(events)
    finally:
        for w in (long, nb):
            cli("workloads", "delete", w["id"])
        cli("keys", "revoke", key["id"])


def _gateway(tables: list[RouteTable]) -> Gateway:
    """A gateway that routes by ``tables[0]`` (swapped by the test)."""
    o = Options(region="local", ttft_s=5.0, deadline_s=20.0, retry_after_s=1, breaker=Policy(consecutive=1000))
    return Gateway(o, lambda: tables[0], MemoryLimiter(), None)


def test_chat_tells_placed_on_cpu_apart_from_failed_over(cli: Cli) -> None:
    write_tiny_model(cli.tmp / "tiny")
    cli("files", "upload", "tiny")  # as the quick start does: then --model names it
    ep = cli.json("endpoint", "create", "talk", "--gpu-class", "l40s-48gb", "--fallback", "cpu", "--fallback-after",
                  "0", "--model", "tiny", "--wait", "--timeout", "60s")
    assert ep["model"] == "tiny"
    (rid, cls), = [(r["id"], r["class"]) for r in ep["replicas"] if r["role"] == "primary"]
    assert cls.startswith("cpu-")
    backends = Backends(["cpu", "gpu"])  # the simulated fleet runs no model server: fakes answer for it

    def table(*replicas: dict[str, Any]) -> RouteTable:  # what the control API's routes would say
        return make_table([{"id": ep["id"], "name": "talk", "owner": ep["owner"], "cpu_fallback": True,
                            "replicas": list(replicas)}], {cli.admin: (ep["owner"], ["admin"])})

    tables = [table(replica(rid, backends.url("cpu"), cpu=True))]
    placed = f"served by the endpoint's own replica {rid} (placed on {cls}, a CPU fallback: no l40s-48gb was free)"
    try:
        with serving(_gateway(tables)) as url:
            gateway = url.removesuffix("/v1")
            r = cli("chat", "talk", "-m", "hi", "--max-tokens", "4", TENSORA_GATEWAY_URL=gateway)
            assert r.stdout.strip() and "served by cpu, fallback true, region local" in r.stderr
            assert placed in r.stderr and "another backend" not in r.stderr, r.stderr
            # by its id, as every other command takes it
            r = cli("chat", ep["id"], "-m", "hi", "--max-tokens", "4", TENSORA_GATEWAY_URL=gateway)
            assert r.stdout.strip() and placed in r.stderr, r.stderr
            assert "404" in cli("chat", ep["id"] + "x", "-m", "hi", code=1).stderr  # an id nobody has

            # no control API to ask (or no right to): the headers alone, still no failover
            r = cli("chat", "talk", "-m", "hi", "--max-tokens", "4", TENSORA_GATEWAY_URL=gateway,
                    TENSORA_API_URL=f"http://127.0.0.1:{free_port()}")
            assert (f"served by the endpoint's own replica {rid} (placed on a CPU class, a CPU fallback"
                    in r.stderr), r.stderr

            # a GPU replica of its own in front that fails: the CPU replica answers after it
            backends.mode("gpu", "http_500")
            tables[0] = table(replica("rp_gpu", backends.url("gpu")), replica(rid, backends.url("cpu"), cpu=True))
            r = cli("chat", "talk", "-m", "hi", "--max-tokens", "4", TENSORA_GATEWAY_URL=gateway)
            assert (f"another backend answered: the endpoint's own replica {rid} (placed on {cls}, a CPU fallback: "
                    "no l40s-48gb was free), after talk/rp_gpu failed twice (HTTP 500)") in r.stderr, r.stderr

            # every backend failing: the error says what was tried
            backends.mode("cpu", "http_503")
            r = cli("chat", "talk", "-m", "hi", TENSORA_GATEWAY_URL=gateway, code=1)
            assert "503" in r.stderr and "talk/rp_gpu failed twice (HTTP 500)" in r.stderr, r.stderr
    finally:
        backends.close()
        cli("workloads", "delete", ep["id"])


def test_a_taken_name_is_refused_naming_the_workload_that_has_it(cli: Cli) -> None:
    """One name, one workload of its owner until it is deleted: so ``workloads get NAME`` always finds one."""
    first = cli.json("notebook", "create", "dup", "--gpu-class", "cpu-1c-4g")
    r = cli("vm", "create", "dup", "--gpu-class", "cpu-1c-4g", code=1)
    assert f"error: 409 NAME: a workload called 'dup' already exists ({first['id']})" in r.stderr, r.stderr
    assert cli.json("workloads", "get", "dup")["id"] == first["id"]
    cli("workloads", "delete", "dup")
    again = cli.json("vm", "create", "dup", "--gpu-class", "cpu-1c-4g")
    assert cli.json("workloads", "get", "dup")["id"] == again["id"] != first["id"]
    cli("workloads", "delete", "dup")
