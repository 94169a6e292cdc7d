"""Bounded create bodies and owners' running quotas, over real HTTP (SQLite and PostgreSQL).

Every field of a create body is bounded and ``spec`` holds only its kind's keys: each bad body is a 422
naming the field, and nothing is written. An owner at its running quota waits with the quota's reason,
and another owner's workload still runs.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tensora.placement.capacity import Node
from tensora.store.tables import O
from tests.support import services
from tests.support.api import WRITTEN_TABLES, Api, assert_error, created, serving_api, settle
from tests.support.stack import GI, stack


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def bare(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Api]:
    """One server on which nothing is ever created: every table a workload write touches stays empty."""
    tmp = tmp_path_factory.mktemp("bounds")
    url = str(tmp / "tensora.db") if request.param == "sqlite" else request.getfixturevalue("pg").new_database()
    with serving_api(url, tmp) as a:
        yield a


NB = {"kind": "notebook", "name": "nb", "gpu_class": "l40s-48gb"}
EP = {"kind": "endpoint", "name": "chat", "gpu_class": "l40s-48gb", "model_params": "1B"}
VM = {"kind": "vm", "name": "vm", "gpu_class": "l40s-48gb"}
NINE = ["a100-80gb", "h100-80gb", "h200-141gb", "apple-metal-16gb", "cpu-1c-4g", "cpu-2c-8g", "cpu-4c-16g",
        "cpu-8c-32g", "cpu-16c-64g"]

LABEL_WORDS = "lowercase letters, digits and '-', 1-63 characters"  # a DNS label's rule, in words

BAD = {  # name -> (body, the field the 422 names, a piece of its message)
    "spec over 16 KiB": ({**EP, "spec": {"ttft_deadline_s": 5, "x": "y" * 16_500}}, "spec", "16384"),
    "spec with an integer past 64 bits (a 422, never a 500)": (
        {**NB, "spec": {"x": {"": 31209958788402896729223232225280}}}, "spec", "64-bit"),
    "spec key unknown to endpoints": ({**EP, "spec": {"foo": 1}}, "spec.foo", "unknown field for an endpoint"),
    "spec key of endpoints on a notebook": ({**NB, "spec": {"ttft_deadline_s": 5}}, "spec.ttft_deadline_s",
                                            "unknown field for a notebook"),
    "any spec key on a vm": ({**VM, "spec": {"serverless": False}}, "spec.serverless", "unknown field for a vm"),
    "free-form padding in a notebook's spec": ({**NB, "spec": {"pad": "x" * 100}}, "spec.pad", "unknown field"),
    "serverless not a boolean": ({**EP, "spec": {"serverless": 0}}, "spec.serverless", "boolean"),
    "ttft_deadline_s a string": ({**EP, "spec": {"ttft_deadline_s": "fast"}}, "spec.ttft_deadline_s", ""),
    "stream_idle_s past 600": ({**EP, "spec": {"stream_idle_s": 601}}, "spec.stream_idle_s", "600"),
    "stream_idle_s of 0": ({**EP, "spec": {"stream_idle_s": 0}}, "spec.stream_idle_s", "0"),
    "stream_idle_s on a notebook": ({**NB, "spec": {"stream_idle_s": 5}}, "spec.stream_idle_s",
                                    "unknown field for a notebook"),
    "name of 64 characters": ({**NB, "name": "n" * 64}, "name", LABEL_WORDS),
    "name not a DNS label": ({**NB, "name": "My_Notebook"}, "name", LABEL_WORDS),
    "gpu_class of 300 characters": ({**NB, "gpu_class": "x" * 300}, "gpu_class", LABEL_WORDS),
    "fallback of 9 classes": ({**NB, "fallback": NINE}, "fallback", "at most 8"),
    "fallback entry not a label": ({**NB, "fallback": ["A100 80GB"]}, "fallback[0]", LABEL_WORDS),
    "fallback entry of 64 characters": ({**NB, "fallback": ["cpu", "c" * 64]}, "fallback[1]", LABEL_WORDS),
    "fallback_after past 30 days": ({**NB, "fallback_after_s": 1e12}, "fallback_after_s", "at most 30 days"),
    "fallback_models of 5": ({**EP, "fallback_models": ["a", "b", "c", "d", "e"]}, "fallback_models", "at most 4"),
    "fallback_models entry not a name": ({**EP, "fallback_models": ["../other"]}, "fallback_models[0]", LABEL_WORDS),
    "fallback_models twice the same": ({**EP, "fallback_models": ["a", "a"]}, "fallback_models", "twice"),
    "replicas 17": ({**EP, "replicas": 17}, "replicas", "16"),
    "replicas 0": ({**EP, "replicas": 0}, "replicas", "1"),
    "model name of 513 characters": ({**EP, "model_params": None, "model": "m" * 513}, "model", "512"),
    "image name of 513 characters": ({**VM, "image": "i" * 513}, "image", "512"),
    "model_params past 100T": ({**EP, "model_params": 10**15}, "model_params", ""),
    "model_bytes past a BIGINT": ({**EP, "model_bytes": 2**63}, "model_bytes", ""),
}


@pytest.mark.parametrize(("body", "field", "message"), BAD.values(), ids=BAD.keys())
def test_a_bad_create_body_is_a_422_naming_the_field_and_writes_nothing(
        bare: Api, body: dict[str, Any], field: str, message: str) -> None:
    alice = bare.as_(bare.stack.alice)
    err = assert_error(alice.post("/v1/workloads", json=body), 422, field)
    assert message in err["message"], err
    assert bare.rows() == dict.fromkeys(WRITTEN_TABLES, 0)


GOOD = {
    "an endpoint's spec keys": {**EP, "spec": {"serverless": False, "ttft_deadline_s": 10}},
    "ttft_deadline_s at its bound": {**EP, "spec": {"ttft_deadline_s": 600}},
    "stream_idle_s at its bound": {**EP, "spec": {"stream_idle_s": 600, "ttft_deadline_s": 0.5}},
    "8 fallback classes": {**NB, "fallback": NINE[:8]},
    "4 fallback models, 16 replicas": {**EP, "fallback_models": ["a", "b", "c", "d"], "replicas": 16},
    "a 63-character name": {**NB, "name": "n" * 63},
}


@pytest.mark.parametrize("body", GOOD.values(), ids=GOOD.keys())
def test_bodies_at_the_bounds_are_taken(api_room: Api, body: dict[str, Any]) -> None:
    assert created(api_room.as_(api_room.stack.alice), **body)["name"] == body["name"]


@pytest.fixture
def api_room(db_url: str, tmp_path: Path) -> Iterator[Api]:
    """A server with room for five L40S workloads at once."""
    s = stack(db_url, tmp_path, nodes=[Node("g1", "local", 96, 1024 * GI, {"L40S": 5})], run_controller=False)
    with services.serving(s.app) as live:
        a = Api(s, live.url, tmp_path)
        try:
            yield a
        finally:
            a.close()


def test_an_owner_at_its_gpu_quota_waits_and_another_owner_still_runs(api_room: Api) -> None:
    with api_room.stack.services.db.write() as conn:  # an admin's override, as PUT /v1/owners/{owner} stores it
        conn.execute(O.insert().values(owner="alice", trusted=False, updated_at=0, quotas={"running_gpus": 1}))
    alice, bob = api_room.as_(api_room.stack.alice), api_room.as_(api_room.stack.bob)
    first = created(alice, **{**NB, "name": "a1"})
    second = created(alice, **{**NB, "name": "a2"})
    theirs = created(bob, **{**NB, "name": "b1"})
    api_room.cycle()
    assert settle(api_room, alice, first["id"], "running")["placed_class"] == "l40s-48gb"
    assert settle(api_room, bob, theirs["id"], "running")["placed_class"] == "l40s-48gb"
    waiting = alice.get(f"/v1/workloads/{second['id']}").json()
    assert waiting["state"] == "queued"  # three GPUs free, but alice's quota is one
    assert waiting["reason"] == "waiting for l40s-48gb (owner quota: 1 of 1 GPU in use); no fallback accepted"
    assert alice.post(f"/v1/workloads/{first['id']}/stop").status_code == 200
    settle(api_room, alice, first["id"], "stopped")
    assert settle(api_room, alice, second["id"], "running")["placed_class"] == "l40s-48gb"
