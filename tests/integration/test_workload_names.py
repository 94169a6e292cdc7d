"""A workload's name is unique per owner among its workloads not deleted: over HTTP on SQLite and PostgreSQL, two
creates of one name at once, and a store that already holds duplicates (from before the rule) read back."""

from __future__ import annotations

import threading
from typing import Any

import httpx

from tensora.store import workloads as workloads_repo
from tensora.store.db import Database
from tests.support.api import Api, assert_error, created
from tests.support.api import api as api  # the fixture, imported under its name

NB: dict[str, Any] = {"kind": "notebook", "name": "nb", "gpu_class": "cpu-1c-4g"}


def test_a_second_workload_of_a_name_is_409_naming_the_one_that_has_it(api: Api) -> None:
    alice, bob = api.as_(api.stack.alice), api.as_(api.stack.bob)
    first = created(alice, **NB)
    before = api.rows()
    err = assert_error(alice.post("/v1/workloads", json={**NB, "kind": "vm"}), 409, "name")
    assert err["type"] == "name_taken"
    assert first["id"] in err["message"] and "'nb'" in err["message"], err
    assert api.rows() == before  # nothing written
    created(bob, **NB)  # another owner's name space
    assert alice.post(f"/v1/workloads/{first['id']}/stop").status_code == 200
    assert_error(alice.post("/v1/workloads", json=NB), 409, "name")  # a stopped workload still holds its name
    assert alice.delete(f"/v1/workloads/{first['id']}").status_code == 204
    again = created(alice, **NB)  # a deleted one frees it
    assert again["id"] != first["id"]
    assert [w["id"] for w in alice.get("/v1/workloads").json()["data"]] == [again["id"]]


def test_an_idempotency_key_replays_the_first_201_and_a_409_is_not_kept(api: Api) -> None:
    alice = api.as_(api.stack.alice)
    first = alice.post("/v1/workloads", json=NB, headers={"Idempotency-Key": "create-nb"})
    replay = alice.post("/v1/workloads", json=NB, headers={"Idempotency-Key": "create-nb"})
    assert (first.status_code, replay.status_code) == (201, 201), replay.text
    assert replay.json()["id"] == first.json()["id"]
    refused = alice.post("/v1/workloads", json=NB, headers={"Idempotency-Key": "other"})
    assert_error(refused, 409, "name")
    assert alice.delete(f"/v1/workloads/{first.json()['id']}").status_code == 204
    retried = alice.post("/v1/workloads", json=NB, headers={"Idempotency-Key": "other"})
    assert retried.status_code == 201, retried.text  # the name is free now: the 409 was not replayed


def test_two_creates_of_one_name_at_once_are_one_201_and_one_409(api: Api) -> None:
    clients = [api.as_(api.stack.alice) for _ in range(2)]
    start = threading.Barrier(2)
    codes: list[int] = []

    def one(c: httpx.Client) -> None:
        start.wait()
        codes.append(c.post("/v1/workloads", json=NB).status_code)

    threads = [threading.Thread(target=one, args=(c,)) for c in clients]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert sorted(codes) == [201, 409]
    assert [w["name"] for w in clients[0].get("/v1/workloads").json()["data"]] == ["nb"]


def _insert(db: Database, wid: str, owner: str, name: str, deleted_at: float | None = None) -> None:
    row = {"id": wid, "owner": owner, "kind": "notebook", "region": "local", "gpu_class": "cpu-1c-4g",
           "requested_class": "cpu-1c-4g", "fallback": [], "fallback_after_s": 0.0, "placement": "policy",
           "state": "stopped", "reason": "", "restart_available": False, "replicas": 1, "created_at": 1.0,
           "updated_at": 1.0, "deleted_at": deleted_at, "failures": 0, "last_failure": "", "name": name,
           "restart_reason": "", "spec": {}}
    with db.write() as conn:
        workloads_repo.insert_workload(conn, row)


def test_a_store_holding_duplicates_migrates_and_lists_each_owners_once(db: Database) -> None:
    """Rows written before names were unique stay, each readable by its id; ``duplicate_names`` lists each
    owner's duplicated name once (deleted workloads and other owners' same names are no duplicates)."""
    for wid, owner, name, deleted in [("wl_a1", "alice", "nb", None), ("wl_a2", "alice", "nb", None),
                                      ("wl_a3", "alice", "nb", None), ("wl_a4", "alice", "vm", None),
                                      ("wl_a5", "alice", "vm", 5.0), ("wl_b1", "bob", "nb", None),
                                      ("wl_b2", "bob", "ep", None), ("wl_b3", "bob", "ep", None)]:
        _insert(db, wid, owner, name, deleted)
    db.migrate()  # again, over the duplicates: nothing to refuse
    with db.read() as conn:
        dups = workloads_repo.duplicate_names(conn)
        each = [workloads_repo.get_workload(conn, w) for w in ("wl_a1", "wl_a2", "wl_a3")]
        named = workloads_repo.live_named(conn, "alice", "nb"), workloads_repo.live_named(conn, "alice", "vm")
    assert [(d.owner, d.name, d.ids) for d in dups] == [("alice", "nb", ("wl_a1", "wl_a2", "wl_a3")),
                                                         ("bob", "ep", ("wl_b2", "wl_b3"))]
    assert [w.id if w else None for w in each] == ["wl_a1", "wl_a2", "wl_a3"]
    assert named == ("wl_a1", "wl_a4")
