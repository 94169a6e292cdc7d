"""Owners' quotas and limits through the control API, on SQLite and PostgreSQL, as a hostile tenant tries
them: a key that sets its own gateway limits, keys and workloads created past the owner's quota (also many at
once), files past its ``storage_bytes``; and an admin's partial PUTs of an owner's settings, which the owner
reads back effective. The overlay of a PUT on stored overrides is pure: a table and a hypothesis property."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError
from sqlalchemy import text

from tensora.config.quotas import GIB, Limits, OwnerSettings, Quotas, effective, overlay
from tensora.config.settings import ServeSettings
from tensora.placement.capacity import Node
from tensora.serve import admin_runs_the_node
from tensora.serving.workers import worker_settings_json
from tests.support.api import Api, assert_error, created
from tests.support.api import api as api  # the fixture, imported under its name

MiB = 2**20
NB: dict[str, Any] = {"kind": "notebook", "name": "nb", "gpu_class": "cpu-1c-4g"}
DEFAULTS = OwnerSettings()


def live_keys(api: Api, owner: str) -> int:
    with api.stack.services.db.read() as conn:
        return int(conn.execute(text("SELECT count(*) FROM api_keys WHERE owner = :o AND revoked_at IS NULL"),
                                {"o": owner}).scalar_one())


# -- limits on keys: admins only ----------------------------------------------------------

@pytest.mark.parametrize("limit", ["requests_per_minute", "tokens_per_minute"])
def test_a_tenant_cannot_set_its_own_keys_gateway_limits(api: Api, limit: str) -> None:
    alice, admin = api.as_(api.stack.alice), api.as_(api.stack.admin)
    before = live_keys(api, "alice")
    for headers in ({}, {"Idempotency-Key": "limits-1"}):
        err = assert_error(alice.post("/v1/keys", json={"name": "fast", limit: 2_000_000_000}, headers=headers),
                           403, limit)
        assert err["type"] == "permission_denied" and limit in err["message"]
    assert live_keys(api, "alice") == before  # nothing written
    assert alice.post("/v1/keys", json={"name": "plain", limit: None}).status_code == 201  # null: not setting it
    r = admin.post("/v1/keys", json={"owner": "alice", "name": "slow", limit: 60})
    assert r.status_code == 201 and r.json()[limit] == 60


# -- an owner's settings: partial PUTs by admins, read back effective ---------------------

def test_an_admin_sets_an_owners_quotas_and_limits_field_by_field(api: Api) -> None:
    alice, admin = api.as_(api.stack.alice), api.as_(api.stack.admin)
    mine = alice.get("/v1/owners/alice").json()
    assert mine == {"owner": "alice", "trusted": False, "updated_at": None, "quotas": DEFAULTS.quotas.model_dump(),
                    "limits": DEFAULTS.limits.model_dump(), "overridden": [],
                    "in_use": {"keys": 1, "workloads": 0, "storage_bytes": 0}}

    def put(body: Any) -> dict[str, Any]:
        r = admin.put("/v1/owners/alice", json=body)
        assert r.status_code == 200, r.text
        out: dict[str, Any] = r.json()
        assert alice.get("/v1/owners/alice").json() == out  # what the owner reads is what was answered
        return out

    o = put({"quotas": {"keys": 20, "storage_bytes": 50 * GIB}, "limits": {"requests_per_minute": 60}})
    assert (o["quotas"]["keys"], o["quotas"]["storage_bytes"], o["limits"]["requests_per_minute"]) == (20, 50 * GIB,
                                                                                                        60)
    assert o["quotas"]["workloads"] == DEFAULTS.quotas.workloads
    assert o["overridden"] == ["quotas.keys", "quotas.storage_bytes", "limits.requests_per_minute"]
    o = put({"trusted": True})  # an old client's body: nothing else moves
    assert o["trusted"] is True and o["overridden"] == ["quotas.keys", "quotas.storage_bytes",
                                                        "limits.requests_per_minute"]
    o = put({"quotas": {"workloads": 5, "keys": None}})  # absent: kept; null: back to the default
    assert (o["quotas"]["keys"], o["quotas"]["workloads"], o["trusted"]) == (DEFAULTS.quotas.keys, 5, True)
    assert o["overridden"] == ["quotas.workloads", "quotas.storage_bytes", "limits.requests_per_minute"]
    o = put({"quotas": None})  # every quota back to the defaults; limits untouched
    assert o["quotas"] == DEFAULTS.quotas.model_dump() and o["overridden"] == ["limits.requests_per_minute"]
    o = put({"limits": {}})  # nothing named: nothing changes
    assert o["overridden"] == ["limits.requests_per_minute"]
    listed = admin.get("/v1/owners").json()["data"]
    assert listed == [o]


def test_puts_of_different_fields_at_once_all_land(api: Api) -> None:
    """Each PUT reads the stored overrides and writes them back merged: under the row's lock, so none is lost."""
    fields = list(Quotas.model_fields)
    clients = {f: api.as_(api.stack.admin) for f in fields}
    lock, todo = threading.Lock(), list(fields)

    def call() -> httpx.Response:
        with lock:
            f = todo.pop()
        return clients[f].put("/v1/owners/carol", json={"quotas": {f: 7}})

    assert _at_once(len(fields), call) == [200] * len(fields)
    got = api.as_(api.stack.admin).get("/v1/owners/carol").json()
    assert got["overridden"] == [f"quotas.{f}" for f in fields] and set(got["quotas"].values()) == {7}


BAD_PUTS = {
    "a negative quota": ({"quotas": {"keys": -1}}, "quotas.keys"),
    "a fractional key count": ({"quotas": {"keys": 1.5}}, "quotas.keys"),
    "a boolean as a count": ({"quotas": {"workloads": True}}, "quotas.workloads"),
    "a number in a string": ({"limits": {"requests_per_minute": "600"}}, "limits.requests_per_minute"),
    "an unknown quota": ({"quotas": {"gpus": 2}}, "quotas.gpus"),
    "a zero rate": ({"limits": {"requests_per_minute": 0}}, "limits.requests_per_minute"),
    "a rate past the bound": ({"limits": {"tokens_per_minute": 10**12}}, "limits.tokens_per_minute"),
    "an unknown limit": ({"limits": {"burst": 5}}, "limits.burst"),
    "quotas not a mapping": ({"quotas": 5}, "quotas"),
    "nothing at all": ({}, None),
}


@pytest.mark.parametrize("case", BAD_PUTS.values(), ids=BAD_PUTS.keys())
def test_a_bad_put_names_the_field_and_changes_nothing(api: Api, case: tuple[dict[str, Any], str | None]) -> None:
    body, field = case
    admin = api.as_(api.stack.admin)
    assert_error(admin.put("/v1/owners/alice", json=body), 422, field)
    assert admin.get("/v1/owners").json() == {"data": []}


def test_only_admins_set_settings_and_owners_read_only_their_own(api: Api) -> None:
    alice, bob, admin = api.as_(api.stack.alice), api.as_(api.stack.bob), api.as_(api.stack.admin)
    for body in ({"quotas": {"keys": 10_000}}, {"limits": {"requests_per_minute": 10_000_000}}):
        assert_error(alice.put("/v1/owners/alice", json=body), 403)
    assert admin.put("/v1/owners/bob", json={"quotas": {"workloads": 7}}).status_code == 200
    err = assert_error(alice.get("/v1/owners/bob"), 404)
    assert "7" not in err["message"]  # nothing of bob's shows
    assert_error(alice.get("/v1/owners"), 403)
    assert bob.get("/v1/owners/bob").json()["quotas"]["workloads"] == 7
    assert alice.get("/v1/owners/alice").json()["overridden"] == []


def test_the_server_config_gives_the_defaults(api: Api) -> None:
    api.stack.services.owner_defaults = OwnerSettings(quotas=Quotas(keys=3), limits=Limits(tokens_per_minute=99))
    admin = api.as_(api.stack.admin)
    got = admin.put("/v1/owners/alice", json={"quotas": {"workloads": 4}}).json()
    assert (got["quotas"]["keys"], got["quotas"]["workloads"], got["limits"]["tokens_per_minute"]) == (3, 4, 99)


STORAGE_CONFIG = {
    "neither: 20 GiB": ({}, 20 * GIB),
    "storage_quota (the older name)": ({"storage_quota": "8Gi"}, 8 * GIB),
    "quotas.storage_bytes": ({"quotas": {"storage_bytes": 5 * GIB}}, 5 * GIB),
}


@pytest.mark.parametrize("case", STORAGE_CONFIG.values(), ids=STORAGE_CONFIG.keys())
def test_storage_quota_stays_the_default_of_storage_bytes(case: tuple[dict[str, Any], int],
                                                          tmp_path: Any) -> None:
    config, want = case
    assert ServeSettings(data_dir=tmp_path, **config).owner_defaults().quotas.storage_bytes == want


@pytest.mark.parametrize("case", STORAGE_CONFIG.values(), ids=STORAGE_CONFIG.keys())
def test_the_http_workers_read_the_same_defaults_back(case: tuple[dict[str, Any], int], tmp_path: Any) -> None:
    config, want = case
    back = ServeSettings.model_validate_json(worker_settings_json(ServeSettings(data_dir=tmp_path, **config)))
    assert back.owner_defaults().quotas.storage_bytes == want


def test_storage_quota_and_storage_bytes_together_are_refused(tmp_path: Any) -> None:
    with pytest.raises(ValidationError, match="set one of the two"):
        ServeSettings(data_dir=tmp_path, storage_quota="8Gi", quotas={"storage_bytes": GIB})


# -- quotas at creation ---------------------------------------------------------------------

def test_keys_past_the_quota_are_403_quota_exceeded_and_a_freed_slot_is_usable(api: Api) -> None:
    alice, admin = api.as_(api.stack.alice), api.as_(api.stack.admin)
    admin.put("/v1/owners/alice", json={"quotas": {"keys": 2}})
    second = alice.post("/v1/keys", json={"name": "second"})
    assert second.status_code == 201
    for headers in ({}, {"Idempotency-Key": "third"}):
        err = assert_error(alice.post("/v1/keys", json={"name": "third"}, headers=headers), 403)
        assert (err["type"], err["message"]) == ("quota_exceeded", "owner quota: 2 of 2 keys in use")
    err = assert_error(admin.post("/v1/keys", json={"owner": "alice"}), 403)  # an admin's create for it too
    assert err["type"] == "quota_exceeded"
    assert live_keys(api, "alice") == 2
    assert alice.delete(f"/v1/keys/{second.json()['id']}").status_code == 204
    r = alice.post("/v1/keys", json={"name": "third"}, headers={"Idempotency-Key": "third"})
    assert r.status_code == 201 and "Idempotent-Replayed" not in r.headers  # the refusal was not stored
    assert alice.get("/v1/owners/alice").json()["in_use"]["keys"] == 2
    assert api.as_(api.stack.bob).post("/v1/keys", json={"name": "x"}).status_code == 201  # bob: his own quota


def test_workloads_past_the_quota_are_403_and_a_deleted_one_frees_its_slot(api: Api) -> None:
    alice, admin = api.as_(api.stack.alice), api.as_(api.stack.admin)
    admin.put("/v1/owners/alice", json={"quotas": {"workloads": 2}})
    first = created(alice, **NB)
    created(alice, **{**NB, "name": "nb-2"})
    alice.post(f"/v1/workloads/{first['id']}/stop")  # a stopped workload still counts: it is not deleted
    before = api.rows()
    err = assert_error(alice.post("/v1/workloads", json={**NB, "name": "nb-3"}), 403)
    assert (err["type"], err["message"]) == ("quota_exceeded", "owner quota: 2 of 2 workloads in use")
    assert api.rows() == before
    err = assert_error(admin.post("/v1/workloads", json={**NB, "name": "nb-3", "owner": "alice"}), 403)
    assert err["type"] == "quota_exceeded"
    assert alice.get("/v1/owners/alice").json()["in_use"]["workloads"] == 2
    assert alice.delete(f"/v1/workloads/{first['id']}").status_code == 204
    created(alice, **{**NB, "name": "nb-3"})
    created(api.as_(api.stack.bob), **NB)  # bob is not held by alice's quota


def _at_once(n: int, call: Callable[[], httpx.Response]) -> list[int]:
    codes: list[int] = []
    start = threading.Barrier(n)

    def one() -> None:
        start.wait()
        codes.append(call().status_code)

    threads = [threading.Thread(target=one) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    return sorted(codes)


@dataclass
class Race:
    quota: str
    path: str
    body: dict[str, Any]


RACES = {"keys": Race("keys", "/v1/keys", {"name": "k"}), "workloads": Race("workloads", "/v1/workloads", NB)}


@pytest.mark.parametrize("race", RACES.values(), ids=RACES.keys())
def test_creates_at_once_never_pass_the_quota(api: Api, race: Race) -> None:
    """Twelve creates at once for the last three slots: three pass, whatever the interleaving."""
    admin = api.as_(api.stack.admin)
    held = 1 if race.quota == "keys" else 0
    admin.put("/v1/owners/alice", json={"quotas": {race.quota: held + 3}})
    clients = [api.as_(api.stack.alice) for _ in range(12)]
    it = iter(clients)
    lock = threading.Lock()

    names = iter(range(12))

    def call() -> httpx.Response:
        with lock:
            c, n = next(it), next(names)
        return c.post(race.path, json={**race.body, "name": f"{race.body['name']}-{n}"})  # a workload's is unique

    assert _at_once(12, call) == [201] * 3 + [403] * 9
    assert admin.get("/v1/owners/alice").json()["in_use"][race.quota] == held + 3


def test_files_past_the_owners_storage_bytes_are_413(api: Api) -> None:
    alice, bob, admin = api.as_(api.stack.alice), api.as_(api.stack.bob), api.as_(api.stack.admin)
    admin.put("/v1/owners/alice", json={"quotas": {"storage_bytes": MiB}})
    r = alice.put("/v1/files/big.bin", content=b"x" * (2 * MiB))
    assert r.status_code == 413 and "quota of 1Mi" in r.json()["error"]["message"]
    assert alice.put("/v1/files/small.bin", content=b"x" * 1000).status_code == 201
    assert alice.get("/v1/files").json()["quota"] == MiB
    assert bob.put("/v1/files/big.bin", content=b"x" * (2 * MiB)).status_code == 201  # bob: the default
    assert bob.get("/v1/files").json()["quota"] == DEFAULTS.quotas.storage_bytes
    assert alice.get("/v1/owners/alice").json()["in_use"]["storage_bytes"] == 1000
    admin.put("/v1/owners/alice", json={"quotas": {"storage_bytes": None}})
    assert alice.put("/v1/files/big.bin", content=b"x" * (2 * MiB)).status_code == 201


# -- the overlay of a PUT on stored overrides (pure) -----------------------------------------

OVERLAYS = {
    "nothing stored, a value -> stored": (None, {"keys": 3}, {"keys": 3}),
    "a value replaces the stored one": ({"keys": 3}, {"keys": 5}, {"keys": 5}),
    "null drops the override": ({"keys": 3, "workloads": 9}, {"keys": None}, {"workloads": 9}),
    "the last override dropped -> None": ({"keys": 3}, {"keys": None}, None),
    "a field not named is kept": ({"workloads": 9}, {"keys": 3}, {"keys": 3, "workloads": 9}),
    "nothing named -> unchanged": ({"keys": 3}, {}, {"keys": 3}),
    "null for a field never set -> nothing": (None, {"keys": None}, None),
}


@pytest.mark.parametrize("case", OVERLAYS.values(), ids=OVERLAYS.keys())
def test_overlay(case: tuple[dict[str, Any] | None, dict[str, Any], dict[str, Any] | None]) -> None:
    stored, changes, want = case
    assert overlay(stored, changes) == want


FIELDS = list(Quotas.model_fields)
changes_st = st.dictionaries(st.sampled_from(FIELDS), st.none() | st.integers(0, 10_000))


@given(st.lists(changes_st, max_size=6))
def test_after_any_puts_each_field_is_its_last_value_or_the_default(puts: list[dict[str, Any]]) -> None:
    stored: dict[str, Any] | None = None
    for changes in puts:
        stored = overlay(stored, changes)
    eff = effective(DEFAULTS, stored, None).quotas
    for name in FIELDS:
        said = [c[name] for c in puts if name in c]
        want = said[-1] if said and said[-1] is not None else getattr(DEFAULTS.quotas, name)
        assert getattr(eff, name) == want
        assert (name in (stored or {})) == bool(said and said[-1] is not None)


# -- tensora up: the machine's operator runs the whole node --------------------------------------

def test_the_admin_owner_may_run_the_whole_node_unless_an_admin_set_its_quotas(api: Api) -> None:
    """``tensora up`` gives the admin owner the node (other owners get a share of it): once, as the admin's own
    quotas, never over what an admin set."""
    db, now = api.stack.services.db, api.stack.services.clock.now()
    node = Node("box", "local", cpu=8, memory=24 * GIB, gpus={"NVIDIA L40S": 2})
    admin = api.as_(api.stack.admin)
    assert admin_runs_the_node(db, node, now) is True
    got = admin.get("/v1/owners/admin").json()
    assert (got["quotas"]["running_cpu"], got["quotas"]["running_gpus"]) == (8, 2)
    assert "quotas.running_cpu" in got["overridden"]
    admin.put("/v1/owners/admin", json={"quotas": {"running_cpu": 3}})
    assert admin_runs_the_node(db, node, now) is False
    assert admin.get("/v1/owners/admin").json()["quotas"]["running_cpu"] == 3
    assert "quotas.running_cpu" not in admin.get("/v1/owners/alice").json()["overridden"]
