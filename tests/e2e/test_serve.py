"""``tensora serve``: settings precedence (config < TENSORA_* env < flags), rejected configs, and
the real entry point in a child process: admin key, loopback bind, persistence across restarts,
placement by the simulated driver, SQLite and PostgreSQL, and a clean exit on SIGTERM."""

from __future__ import annotations

import contextlib
import socket
import sqlite3
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from tensora.config.settings import ADMIN_KEY_FILE, ServeSettings, load_settings
from tensora.drivers.base import ReplicaStatus
from tensora.errors import ConfigError
from tensora.keys.apikeys import well_formed
from tensora.placement.kinds import ReplicaState
from tensora.serve import build
from tensora.serving.banner import left_running
from tests.support.serve import START_DEADLINE_S, Proc, launch_serve, served
from tests.support.services import PgCluster, free_port

PLACE_DEADLINE_S = 20.0


# -- load_settings: unit tests, env passed explicitly --------------------------------------------

@dataclass
class Want:
    config: str | None = None  # YAML text of the config file
    env: dict[str, str] = field(default_factory=dict)
    flags: dict[str, Any] = field(default_factory=dict)
    want: dict[str, Any] = field(default_factory=dict)


SETTINGS = {
    "nothing given -> defaults": Want(want={"host": "127.0.0.1", "port": 8700, "region": "local",
                                           "driver": "simulated", "controller": True, "tick_s": 2.0}),
    "config file -> used": Want(config="port: 9001\nregion: eu-west\ntick_s: 0.5\n",
                                want={"port": 9001, "region": "eu-west", "tick_s": 0.5}),
    "env beats config": Want(config="port: 9001\nregion: eu-west\n", env={"TENSORA_PORT": "9002"},
                             want={"port": 9002, "region": "eu-west"}),
    "flag beats env and config": Want(config="port: 9001\n", env={"TENSORA_PORT": "9002"}, flags={"port": 9003},
                                      want={"port": 9003}),
    "a None flag (not given) leaves env": Want(env={"TENSORA_PORT": "9002"}, flags={"port": None, "region": None},
                                               want={"port": 9002, "region": "local"}),
    "env strings are parsed": Want(env={"TENSORA_CONTROLLER": "false", "TENSORA_START_DELAY_S": "0.25",
                                        "TENSORA_MAX_IN_FLIGHT": "8"},
                                   want={"controller": False, "start_delay_s": 0.25, "max_in_flight": 8}),
    "unknown TENSORA_ vars and other env ignored": Want(env={"TENSORA_NOPE": "1", "PORT": "1"}, want={"port": 8700}),
    "env beats config for every kind of setting": Want(config="driver: simulated\ncontroller: true\n",
                                                      env={"TENSORA_CONTROLLER": "0"}, want={"controller": False}),
}


def _config(tmp_path: Path, text: str | None) -> Path | None:
    if text is None:
        return None
    path = tmp_path / "serve.yaml"
    path.write_text(text)
    return path


@pytest.mark.parametrize("case", SETTINGS.values(), ids=SETTINGS.keys())
def test_load_settings_precedence(case: Want, tmp_path: Path) -> None:
    settings = load_settings(_config(tmp_path, case.config), case.flags, env=case.env)
    got = {k: getattr(settings, k) for k in case.want}
    assert got == case.want


def test_database_defaults_to_sqlite_in_the_data_dir(tmp_path: Path) -> None:
    settings = load_settings(None, {"data_dir": tmp_path}, env={})
    assert settings.db_url == str(tmp_path / "tensora.db")
    settings = load_settings(None, {"data_dir": tmp_path}, env={"TENSORA_DATABASE_URL": "postgresql://x@h/db"})
    assert settings.db_url == "postgresql://x@h/db"


@dataclass
class Bad:
    config: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    flags: dict[str, Any] = field(default_factory=dict)
    source: str = "<config>"  # "<config>" stands for the config file's path
    field: str | None = None
    line: int | None = None
    message: str = ""


BAD_SETTINGS = {
    "unknown setting in the file": Bad(config="region: local\nbogus: 1\n", field="bogus", line=2,
                                       message="unknown setting"),
    "port out of range in the file": Bad(config="port: 70000\n", field="port", line=1, message="65535"),
    "bad region in the file": Bad(config="host: 127.0.0.1\nregion: Not_A_Region\n", field="region", line=2,
                                  message="lowercase letters, digits and '-'"),
    "unknown driver in the file": Bad(config="driver: docker\n", field="driver", line=1),
    "unparsable YAML": Bad(config="port: [8700\n", message="not valid YAML"),
    "not a mapping": Bad(config="- port\n- 8700\n", message="mapping of settings"),
    "bad value from env names the variable": Bad(config="region: local\n", env={"TENSORA_PORT": "eighty"},
                                                 source="TENSORA_PORT", field="port"),
    "bad value from a flag names the flag": Bad(env={"TENSORA_REGION": "ok"}, flags={"region": "UPPER"},
                                                source="--region", field="region"),
    "zero tick from env": Bad(env={"TENSORA_TICK_S": "0"}, source="TENSORA_TICK_S", field="tick_s"),
    "a notebook domain that is a URL": Bad(config="driver: kubernetes\nnotebook_domain: https://nb.example.org\n",
                                           field="notebook_domain", line=2, message="a domain name"),
    "a home size in an unknown unit": Bad(config="driver: kubernetes\nhome_size: 10G\n", field="home_size", line=2,
                                      message="a whole size in Mi, Gi or Ti, such as 10Ti"),
}


@pytest.mark.parametrize("case", BAD_SETTINGS.values(), ids=BAD_SETTINGS.keys())
def test_load_settings_rejects(case: Bad, tmp_path: Path) -> None:
    config = _config(tmp_path, case.config)
    with pytest.raises(ConfigError) as info:
        load_settings(config, case.flags, env=case.env)
    err = info.value
    assert err.source == (str(config) if case.source == "<config>" else case.source)
    assert err.field == case.field
    if case.line is not None:
        assert err.line == case.line
    assert case.message in err.message
    assert err.source is not None and err.source in str(err)


BAD_GATEWAY_SETTINGS = {
    "unknown gateway setting in the file's section": Bad(config="gateway: {bogus: 1}\n", source="gateway",
                                                         field="gateway.bogus", message="unknown setting"),
    "gateway port out of range in the section": Bad(config="gateway: {port: 70000}\n", source="gateway",
                                                    field="gateway.port", message="65535"),
    "bad TTFT deadline from env": Bad(env={"TENSORA_GATEWAY_TTFT_S": "-1"}, source="TENSORA_GATEWAY_TTFT_S",
                                      field="gateway.ttft_s"),
    "bad peers from the section": Bad(config="gateway: {peers: [{region: eu}]}\n", source="gateway",
                                      field="gateway.peers.0.url"),
    "a zero rate limit from a flag": Bad(flags={"requests_per_minute": 0}, source="--requests-per-minute",
                                     field="gateway.requests_per_minute"),
    "a plain http peer off loopback": Bad(config="gateway: {peers: [{region: eu, url: 'http://10.0.0.5/v1'}]}\n",
                                          source="gateway", field="gateway.peers",
                                          message="peers[0].url (eu): plain http to 10.0.0.5"),
    "a header timeout of zero from env": Bad(env={"TENSORA_GATEWAY_HEADER_TIMEOUT_S": "0"},
                                             source="TENSORA_GATEWAY_HEADER_TIMEOUT_S",
                                             field="gateway.header_timeout_s"),
}


@pytest.mark.parametrize("case", BAD_GATEWAY_SETTINGS.values(), ids=BAD_GATEWAY_SETTINGS.keys())
def test_gateway_settings_reject(case: Bad, tmp_path: Path) -> None:
    from tensora.serve import load_gateway_settings

    with pytest.raises(ConfigError) as info:
        load_gateway_settings(_config(tmp_path, case.config), case.flags, env=case.env)
    assert (info.value.source, info.value.field) == (case.source, case.field)
    assert case.message in info.value.message


def test_gateway_settings_follow_the_servers(tmp_path: Path) -> None:
    from tensora.serve import load_gateway_settings

    config = _config(tmp_path, "region: eu-west\nport: 9000\nhost: 0.0.0.0\ngateway: {port: 9001, ttft_s: 5}\n")
    gw = load_gateway_settings(config, {"data_dir": tmp_path}, env={"TENSORA_GATEWAY_DEADLINE_S": "60"})
    assert (gw.region, gw.port, gw.host, gw.control_url) == ("eu-west", 9001, "0.0.0.0", "http://127.0.0.1:9000")
    assert (gw.ttft_s, gw.deadline_s, gw.data_dir) == (5.0, 60.0, tmp_path)
    assert gw.limits().max_header_bytes == 60 << 10 and gw.limits().idle_timeout_s == 60.0  # Envoy's defaults


def test_missing_config_file_is_named(tmp_path: Path) -> None:
    missing = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError, match="cannot read file") as info:
        load_settings(missing, {}, env={})
    assert info.value.source == str(missing)


def test_build_refuses_a_driver_it_cannot_configure_before_touching_the_store(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    settings = ServeSettings(data_dir=data_dir, driver="kubernetes", kubeconfig=tmp_path / "missing.yaml")
    with pytest.raises(ConfigError, match="no kubeconfig at") as info:
        build(settings)
    assert info.value.field == "kubeconfig"
    assert not data_dir.exists()


# -- the real entry point, in a child process ------------------------------------------------------

def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _wait_state(url: str, key: str, workload_id: str, state: str) -> dict[str, Any]:
    deadline = time.monotonic() + PLACE_DEADLINE_S
    body: dict[str, Any] = {}
    while time.monotonic() < deadline:
        r = httpx.get(f"{url}/v1/workloads/{workload_id}", headers=_auth(key), timeout=5)
        assert r.status_code == 200, r.text
        body = r.json()
        if body["state"] == state:
            return body
        time.sleep(0.1)
    pytest.fail(f"{workload_id} not {state} within {PLACE_DEADLINE_S}s; last seen: {body}")


def _wait_leader(proc: Proc) -> None:
    deadline = time.monotonic() + START_DEADLINE_S
    while httpx.get(f"{proc.url}/readyz", timeout=5).json()["controller"] != "leader":
        if time.monotonic() > deadline:
            pytest.fail(f"the controller did not take the lease within {START_DEADLINE_S}s:\n{proc.output()}")
        time.sleep(0.1)


def _leases(db_file: Path) -> list[tuple[Any, ...]]:
    with contextlib.closing(sqlite3.connect(db_file)) as conn:
        return conn.execute("SELECT name, holder FROM leases").fetchall()


def _refused(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(2)
        return s.connect_ex((host, port)) != 0


NOTEBOOK = {"kind": "notebook", "name": "nb", "gpu_class": "l40s-48gb"}


@pytest.mark.slow
def test_first_start_admin_key_loopback_and_clean_sigterm(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    with served(tmp_path, data_dir) as proc:
        key_file = data_dir / ADMIN_KEY_FILE
        assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
        key = key_file.read_text().strip()
        assert well_formed(key)
        assert httpx.get(f"{proc.url}/v1/workloads", headers=_auth(key), timeout=5).status_code == 200
        assert httpx.get(f"{proc.url}/v1/workloads", timeout=5).status_code == 401
        bad = httpx.get(f"{proc.url}/v1/workloads", headers=_auth(key[:-1] + ("A" if key[-1] != "A" else "B")),
                        timeout=5)
        assert bad.status_code == 401
        # bound to 127.0.0.1 only: another loopback address of this machine is refused
        assert _refused("127.0.0.2", proc.port)
        _wait_leader(proc)
        assert [name for name, _ in _leases(data_dir / "tensora.db")] == ["controller/local"]
        rc = proc.terminate()  # it waits EXIT_DEADLINE_S at most
        assert rc == 0, proc.output()
        output = proc.output()
    assert key not in output
    assert str(key_file) in output and "127.0.0.1" in output
    assert "Traceback" not in output
    # a graceful stop released the controller's lease (so a successor leads at once)
    assert _leases(data_dir / "tensora.db") == []


def _database(backend: str, request: pytest.FixtureRequest) -> list[str]:
    if backend == "sqlite":
        return []
    cluster: PgCluster = request.getfixturevalue("pg")
    return ["--database-url", cluster.new_database()]


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_restart_keeps_key_and_workloads_and_places_on_the_default_fleet(
        backend: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    data_dir = tmp_path / "data"
    db_args = _database(backend, request)
    env = {"TENSORA_LEASE_TTL_S": "120"}  # longer than START_DEADLINE_S: leading again needs a released lease
    with served(tmp_path, data_dir, *db_args, env=env) as first:
        key = (data_dir / ADMIN_KEY_FILE).read_text().strip()
        r = httpx.post(f"{first.url}/v1/workloads", json=NOTEBOOK, headers=_auth(key), timeout=5)
        assert r.status_code == 201, r.text
        created = r.json()
        assert created["state"] == "queued"
        running = _wait_state(first.url, key, created["id"], "running")
        assert running["placed_class"] == "l40s-48gb"
        assert running["access"]["node"] == "gpu-l40s-1"
        assert first.terminate() == 0, first.output()
        first_output = first.output()
    assert ("PostgreSQL" in first_output) == (backend == "postgresql")
    assert (data_dir / "tensora.db").exists() == (backend == "sqlite")
    with served(tmp_path, data_dir, *db_args, env=env) as second:
        assert (data_dir / ADMIN_KEY_FILE).read_text().strip() == key
        r = httpx.get(f"{second.url}/v1/workloads", headers=_auth(key), timeout=5)
        assert r.status_code == 200, r.text
        assert [w["id"] for w in r.json()["data"]] == [created["id"]]
        _wait_leader(second)  # before lease_ttl_s: the first run released its lease
        assert second.terminate() == 0, second.output()
        assert key not in second.output()


@pytest.mark.slow
def test_flag_beats_env_beats_config_in_the_process(tmp_path: Path) -> None:
    config_port, env_port = free_port(), free_port()
    config = tmp_path / "serve.yaml"
    config.write_text(f"port: {config_port}\nregion: from-config\ntick_s: 0.1\n")
    with served(tmp_path, tmp_path / "data", "--config", str(config),
                env={"TENSORA_PORT": str(env_port), "TENSORA_REGION": "from-env"}) as proc:
        ready = httpx.get(f"{proc.url}/readyz", timeout=5).json()
        assert ready["region"] == "from-env"
        assert proc.port not in (config_port, env_port)
        assert _refused("127.0.0.1", env_port) and _refused("127.0.0.1", config_port)
        assert proc.terminate() == 0, proc.output()


REJECTED = {
    "unknown setting in the config": ("config", "region: local\nbogus: 1\n", {}, ["{config}:2", "bogus",
                                                                                  "unknown setting"]),
    "port 70000 in the config": ("config-only", "port: 70000\n", {}, ["{config}:1", "port", "65535"]),
    "bad region in the config": ("config", "region: EU_West\n", {}, ["{config}:1", "region"]),
    "unparsable config": ("config", "port: [1\n", {}, ["{config}", "not valid YAML"]),
    "bad region from env": ("env", "", {"TENSORA_REGION": "EU_West"}, ["TENSORA_REGION", "region"]),
    "missing --nodes file": ("nodes", "", {}, ["{missing}", "cannot read file"]),
    "--driver kubernetes, kubeconfig missing": ("driver", "kubernetes", {"TENSORA_KUBECONFIG": "/nonexistent/kc"},
                                                ["kubeconfig", "no kubeconfig at /nonexistent/kc"]),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", REJECTED.values(), ids=REJECTED.keys())
def test_rejected_settings_exit_2_naming_file_and_field_and_write_nothing(
        case: tuple[str, str, dict[str, str], list[str]], tmp_path: Path) -> None:
    kind, text, env, wants = case
    data_dir = tmp_path / "data"
    config, missing = tmp_path / "serve.yaml", tmp_path / "no-such-nodes.yaml"
    args = ["--data-dir", str(data_dir)] + ([] if kind == "config-only" else ["--port", str(free_port())])
    if kind.startswith("config"):
        config.write_text(text)
        args += ["--config", str(config)]
    elif kind == "nodes":
        args += ["--nodes", str(missing)]
    elif kind == "driver":
        args += ["--driver", text]
    proc = launch_serve(tmp_path, args, env=env, tag="rejected")
    rc = proc.exit_code()
    stderr = proc.err.read_text()
    assert rc == 2, proc.output()
    assert stderr.startswith("error: ")
    for want in wants:
        assert want.format(config=config, missing=missing) in stderr
    assert "Traceback" not in stderr
    assert not data_dir.exists(), "a rejected start left a data dir (and maybe a database) behind"


@pytest.mark.slow
def test_an_unreachable_database_exits_1_with_a_clear_error(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    dead = f"postgresql://nobody@127.0.0.1:{free_port()}/tensora"  # a free port: nothing listens there
    proc = launch_serve(tmp_path, ["--data-dir", str(data_dir), "--database-url", dead, "--port", str(free_port())],
                   tag="nodb")
    rc = proc.exit_code()
    stderr = proc.err.read_text()
    assert rc == 1, proc.output()
    assert stderr.startswith("error: the database is unavailable: ")
    assert "Traceback" not in stderr
    assert not data_dir.exists()


# -- what tensora up says as it stops: pure ---------------------------------------------------------

def _replica(rid: str, workload: str, state: ReplicaState) -> ReplicaStatus:
    return ReplicaStatus(rid, workload, "cpu-1c-4g", "box", state)


STOPPED_UP = {
    "nothing ran": ([], "stopped the API and gateway; no workloads are running"),
    "only stopped and failed replicas": (
        [_replica("rp_1", "wl_1", ReplicaState.STOPPED), _replica("rp_2", "wl_2", ReplicaState.FAILED)],
        "stopped the API and gateway; no workloads are running"),
    "one notebook": (
        [_replica("rp_1", "wl_1", ReplicaState.RUNNING)],
        "stopped the API and gateway; 1 workload keeps running (1 replica): the next `tensora up` adopts them; "
        "to stop them, start it and run `tensora workloads stop NAME`"),
    "an endpoint moving back has two replicas; one still starting counts": (
        [_replica("rp_1", "wl_ep", ReplicaState.RUNNING), _replica("rp_2", "wl_ep", ReplicaState.STARTING),
         _replica("rp_3", "wl_nb", ReplicaState.RUNNING), _replica("rp_4", "wl_old", ReplicaState.STOPPED)],
        "stopped the API and gateway; 2 workloads keep running (3 replicas): the next `tensora up` adopts them; "
        "to stop them, start it and run `tensora workloads stop NAME`"),
    "a replica still stopping is said apart": (
        [_replica("rp_1", "wl_1", ReplicaState.STOPPING)],
        "stopped the API and gateway; no workloads are running (1 replica still stopping: the next `tensora up` "
        "sees it through)"),
}


@pytest.mark.parametrize("case", STOPPED_UP.values(), ids=STOPPED_UP.keys())
def test_what_tensora_up_says_keeps_running(case: tuple[list[ReplicaStatus], str]) -> None:
    replicas, want = case
    assert left_running(replicas) == want


def test_a_store_holding_duplicated_names_starts_and_lists_each_once(tmp_path: Path) -> None:
    """Names made before they were unique per owner: the store migrates, each workload reads back by its id, and
    the start lists each owner's duplicated name once (a name two owners each hold once is no duplicate)."""
    from tensora.store import workloads as workloads_repo
    from tensora.store.db import Database

    data_dir = tmp_path / "data"
    db = Database(str(data_dir / "tensora.db"))
    db.migrate()
    with db.write() as conn:
        for wid, owner in [("wl_a1", "alice"), ("wl_a2", "alice"), ("wl_b1", "bob")]:
            workloads_repo.insert_workload(conn, {
                "id": wid, "owner": owner, "kind": "notebook", "region": "local", "gpu_class": "cpu-1c-4g",
                "requested_class": "cpu-1c-4g", "fallback": [], "fallback_after_s": 0.0, "placement": "policy",
                "state": "stopped", "reason": "", "restart_available": False, "replicas": 1, "created_at": 1.0,
                "updated_at": 1.0, "failures": 0, "last_failure": "", "name": "nb", "restart_reason": "",
                "spec": {}})
    db.dispose()
    with served(tmp_path, data_dir) as proc:
        key = (data_dir / ADMIN_KEY_FILE).read_text().strip()
        by_id = [httpx.get(f"{proc.url}/v1/workloads/{w}", headers=_auth(key), timeout=5) for w in ("wl_a1", "wl_a2")]
        assert proc.terminate() == 0, proc.output()
        output = proc.output()
    assert [r.status_code for r in by_id] == [200, 200]
    notes = [ln for ln in output.splitlines() if "workloads called" in ln]
    assert notes == ["note: owner 'alice' has 2 workloads called 'nb' (wl_a1, wl_a2), made before names were "
                     "unique: each keeps working by its id; delete all but one to use the name alone"], output
