"""``model`` and ``image`` name the caller's own files (or an operator's shared models), never host
paths (docs/concepts/security-model.md), over real HTTP on SQLite and PostgreSQL.

An owner who is not an admin tries what an attacker would: host paths (``/etc/shadow``, the admin
key, a valid model outside any storage), another owner's model by its host path and by its name,
``..``, an unknown shared root, and links planted in its own files that point out of them. Every
one is the same 422, byte for byte, so nothing tells what the host holds. What an owner uploaded
works: it is sized from its headers, the host path stays on the server (the row's spec, the
driver's ReplicaSpec, the gateway's route table) and the workload shows the name.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import text

from tensora.storage import NOT_FOUND, Storage, owner_dir
from tensora.store import workloads as workloads_repo
from tests.support import services
from tests.support.api import WRITTEN_TABLES, tiny_model
from tests.support.stack import Stack, stack

SAME_422 = {"error": {"type": "invalid_request", "message": NOT_FOUND, "field": "model"}}


@dataclass
class World:
    """A stack on a DATA_DIR holding an admin key, a shared root ``pool``, bob's uploaded model and
    disk, a valid model outside every storage, and links planted in alice's files."""

    stack: Stack
    url: str
    data: Path
    storage: Storage
    params: int  # of the tiny model everywhere here

    def as_(self, key: str) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers=self.stack.headers(key), timeout=30)

    def rows(self) -> dict[str, int]:
        with self.stack.services.db.read() as conn:
            return {t: int(conn.execute(text(f"SELECT count(*) FROM {t}")).scalar_one()) for t in WRITTEN_TABLES}

    def run(self) -> None:
        """Place and start, then see running; the simulated fleet's replicas have no URL, so each gets
        one here, as a real driver's would, for the route table to list them."""
        for _ in range(2):
            self.stack.controller.run_once()
        with self.stack.services.db.write() as conn:
            for r in workloads_repo.active_replicas(conn, "local"):
                workloads_repo.update_replica(conn, r.id, {"url": f"http://127.0.0.1:9/{r.id}/v1"})

    def row_spec(self, wid: str) -> dict[str, Any]:
        with self.stack.services.db.read() as conn:
            w = workloads_repo.get_workload(conn, wid, None)
        assert w is not None
        spec: dict[str, Any] = dict(w.spec)
        return spec


def upload(client: httpx.Client, name: str, data: bytes) -> None:
    r = client.put(f"/v1/files/{name}", content=data)
    assert r.status_code in (200, 201), r.text


@pytest.fixture
def world(db_url: str, tmp_path: Path) -> Iterator[World]:
    s = stack(db_url, tmp_path, run_controller=False)
    storage = s.services.storage
    assert storage is not None and storage.root.is_relative_to(tmp_path)
    (tmp_path / "admin-key").write_text("tsk_0123456789abcdef0123456789abcdef\n")
    (tmp_path / "pool").mkdir()
    (tmp_path / "outside").mkdir()
    model, params = tiny_model(tmp_path / "outside")
    tiny_model(tmp_path / "pool")
    storage.shared = {"pool": tmp_path / "pool"}
    with services.serving(s.app) as live:
        w = World(s, live.url, tmp_path, storage, params)
        with w.as_(s.bob) as bob:
            upload(bob, "tiny/model.safetensors", model.read_bytes())
            upload(bob, "disk.qcow2", b"QFI\xfb" + bytes(60))
        with w.as_(s.alice) as alice:
            upload(alice, "mine/readme.txt", b"hello")  # so alice's directory exists, with a directory in it
        mine = owner_dir(storage.root, "alice")
        (mine / "evil").symlink_to(tmp_path / "admin-key")
        (mine / "outside.safetensors").symlink_to(model)
        (mine / "linked").mkdir()
        (mine / "linked" / "model.safetensors").symlink_to(model)
        (mine / "up").symlink_to(storage.root)
        try:
            yield w
        finally:
            s.services.db.dispose()


ATTACKS = {  # what alice names -> nothing of it may show; {data}: DATA_DIR, {bob}: bob's directory on the host
    "a host file readable by root": "/etc/shadow",
    "a host file readable by all": "/etc/passwd",
    "the admin key by its host path": "{data}/admin-key",
    "a host path that does not exist": "{data}/no/such/model.safetensors",
    "a valid model outside any storage": "{data}/outside/tiny.safetensors",
    "bob's model by its host path": "{bob}/tiny",
    "bob's model file by its host path": "{bob}/tiny/model.safetensors",
    "bob's model by its name": "tiny",
    "a name with ..": "../x",
    "bob's model through ..": "../{bob_dir}/tiny",
    "a link in alice's files to the admin key": "evil",
    "a link in alice's files to a model outside": "outside.safetensors",
    "a model directory holding a link outside": "linked",
    "a link to the storage root, then bob's model": "up/{bob_dir}/tiny",
    "an unknown shared root": "shared/elsewhere/tiny.safetensors",
    "a shared root left with ..": "shared/pool/../../admin-key",
    "the shared prefix alone": "shared",
    "an empty name": "",
}


def _format(value: str, w: World) -> str:
    bob = owner_dir(w.storage.root, "bob")
    return value.format(data=w.data, bob=bob, bob_dir=bob.name)


def test_every_attack_runs_against_a_world_where_it_would_tell_something(world: World) -> None:
    """The fixture is what the attacks assume: the targets exist, readable by this process."""
    assert (world.data / "admin-key").read_text().startswith("tsk_")
    assert world.storage.resolve("bob", "tiny") == (owner_dir(world.storage.root, "bob") / "tiny").resolve()
    assert (owner_dir(world.storage.root, "alice") / "linked" / "model.safetensors").is_file()


@pytest.mark.parametrize("value", ATTACKS.values(), ids=ATTACKS.keys())
def test_an_endpoint_model_outside_the_owners_files_is_the_same_422(world: World, value: str) -> None:
    rows = world.rows()
    with world.as_(world.stack.alice) as alice:
        r = alice.post("/v1/workloads", json={"kind": "endpoint", "name": "ep", "gpu_class": "cpu-2c-8g",
                                              "model": _format(value, world)})
    assert (r.status_code, r.json()) == (422, SAME_422)
    assert world.rows() == rows


@pytest.mark.parametrize("value", [*ATTACKS.values(), "mine"], ids=[*ATTACKS.keys(), "a directory of alice's"])
def test_a_vm_image_outside_the_owners_files_is_the_same_422(world: World, value: str) -> None:
    rows = world.rows()
    with world.as_(world.stack.alice) as alice:
        r = alice.post("/v1/workloads", json={"kind": "vm", "name": "box", "gpu_class": "cpu-2c-8g",
                                              "image": _format(value, world)})
    assert (r.status_code, r.json()) == (422, {"error": {**SAME_422["error"], "field": "image"}})
    assert world.rows() == rows


def test_an_uploaded_model_is_sized_and_its_host_path_stays_on_the_server(world: World) -> None:
    model, params = tiny_model(world.data, "alices.safetensors")
    with world.as_(world.stack.alice) as alice:
        upload(alice, "tiny/model.safetensors", model.read_bytes())
        r = alice.post("/v1/workloads", json={"kind": "endpoint", "name": "chat", "gpu_class": "cpu-2c-8g",
                                              "model": "tiny"})
        assert r.status_code == 201, r.text
        ep = r.json()
        assert (ep["model"], ep["model_params"]) == ("tiny", params)
        host = world.storage.resolve("alice", "tiny")
        assert str(world.data) not in r.text
        assert world.row_spec(ep["id"])["model_path"] == str(host)
        world.run()
        assert [(s.model, s.image) for s in world.stack.driver.specs()] == [(str(host), None)]
        got = alice.get(f"/v1/workloads/{ep['id']}")
        assert got.json()["model"] == "tiny" and str(world.data) not in got.text
    with world.as_(world.stack.admin) as admin:
        [route] = admin.get("/v1/gateway/routes").json()["endpoints"]
    # the model server answers to the path it was started with; the pool matches shared models only
    assert [r["upstream_model"] for r in route["replicas"]] == [str(host)]
    assert route["model"] is None


def test_a_vm_boots_an_uploaded_image_by_its_name(world: World) -> None:
    with world.as_(world.stack.alice) as alice:
        upload(alice, "disks/debian.qcow2", b"QFI\xfb" + bytes(60))
        r = alice.post("/v1/workloads", json={"kind": "vm", "name": "box", "gpu_class": "cpu-2c-8g",
                                              "image": "disks/debian.qcow2"})
        assert r.status_code == 201, r.text
        assert r.json()["image"] == "disks/debian.qcow2" and str(world.data) not in r.text
    host = world.storage.resolve("alice", "disks/debian.qcow2")
    assert world.row_spec(r.json()["id"])["image_path"] == str(host)
    world.run()
    assert [(s.model, s.image) for s in world.stack.driver.specs()] == [(None, str(host))]


OWN_BAD = {  # alice's own files that are not a model: she may be told why, by her names, never by host paths
    "not safetensors": ({"notes.safetensors": b"these are notes, not tensors\n"}, "notes.safetensors",
                        "notes.safetensors: header length"),
    "a directory without safetensors": ({"empty/readme.txt": b"hi"}, "empty",
                                        "empty: no .safetensors files in this directory"),
    "a shard that is not safetensors": ({"sharded/a.safetensors": b"\x02\x00\x00\x00\x00\x00\x00\x00{}",
                                         "sharded/b.safetensors": b"short"}, "sharded",
                                        "sharded/b.safetensors: truncated"),
}


@pytest.mark.parametrize(("files", "name", "says"), OWN_BAD.values(), ids=OWN_BAD.keys())
def test_an_owners_own_file_that_is_no_model_is_named_by_its_name(world: World, files: dict[str, bytes], name: str,
                                                                   says: str) -> None:
    with world.as_(world.stack.alice) as alice:
        for path, data in files.items():
            upload(alice, path, data)
        r = alice.post("/v1/workloads", json={"kind": "endpoint", "name": "ep", "gpu_class": "cpu-2c-8g",
                                              "model": name})
    assert r.status_code == 422 and r.json()["error"]["field"] == "model", r.text
    assert r.json()["error"]["message"].startswith(says), r.text
    assert str(world.data) not in r.text and str(world.storage.root) not in r.text


def test_shared_models_are_open_to_all_and_match_the_serverless_pool_by_their_host_path(world: World) -> None:
    """The pool answers for a model only when it is the same file: a shared model. An owner's ``tiny``
    and the operator's own ``tiny`` are different files and never match."""
    made = {}
    for who, name, model, spec in (("alice", "a", "shared/pool/tiny.safetensors", {}),
                                   ("bob", "b", "shared/pool/tiny.safetensors", {}),
                                   ("admin", "pool", "shared/pool/tiny.safetensors", {"serverless": True}),
                                   ("bob", "own", "tiny", {}),
                                   ("admin", "pool-own", "tiny", {"serverless": True})):
        key = getattr(world.stack, who)
        with world.as_(key) as c:
            if who == "admin" and model == "tiny":
                upload(c, "tiny/model.safetensors", tiny_model(world.data, "admins.safetensors")[0].read_bytes())
            r = c.post("/v1/workloads", json={"kind": "endpoint", "name": name, "gpu_class": "cpu-2c-8g",
                                              "model": model, "spec": spec})
            assert r.status_code == 201, r.text
            assert (r.json()["model"], r.json()["model_params"]) == (model, world.params)
            made[name] = r.json()["id"]
    world.run()
    with world.as_(world.stack.admin) as admin:
        routes = {e["name"]: e for e in admin.get("/v1/gateway/routes").json()["endpoints"]}
    pool = str((world.data / "pool" / "tiny.safetensors").resolve())
    assert {n: e["model"] for n, e in routes.items()} == {"a": pool, "b": pool, "pool": pool, "own": None,
                                                          "pool-own": None}
    assert routes["own"]["replicas"][0]["upstream_model"] == str(world.storage.resolve("bob", "tiny"))
    assert routes["pool-own"]["replicas"][0]["upstream_model"] == str(world.storage.resolve("admin", "tiny"))


def test_an_admin_creating_for_an_owner_names_that_owners_files(world: World) -> None:
    with world.as_(world.stack.admin) as admin:
        upload(admin, "mine-only/model.safetensors", tiny_model(world.data, "admins.safetensors")[0].read_bytes())
        r = admin.post("/v1/workloads", json={"kind": "endpoint", "name": "ep", "gpu_class": "cpu-2c-8g",
                                              "owner": "bob", "model": "mine-only"})
        assert (r.status_code, r.json()) == (422, SAME_422)
        r = admin.post("/v1/workloads", json={"kind": "endpoint", "name": "ep", "gpu_class": "cpu-2c-8g",
                                              "owner": "bob", "model": "tiny"})
        assert r.status_code == 201, r.text
    assert world.row_spec(r.json()["id"])["model_path"] == str(world.storage.resolve("bob", "tiny"))


def test_a_server_without_storage_finds_no_model_and_says_the_same(world: World) -> None:
    world.stack.services.storage = None
    with world.as_(world.stack.alice) as alice:
        r = alice.post("/v1/workloads", json={"kind": "endpoint", "name": "ep", "gpu_class": "cpu-2c-8g",
                                              "model": "mine"})
    assert (r.status_code, r.json()) == (422, SAME_422)
