"""The control API over real HTTP (uvicorn on loopback, httpx), on SQLite and PostgreSQL.

Every route, the shape of a workload as ADR-0010 describes it (requested and placed class,
fallback policy, the CPU warning, degraded conditions), auth and owner isolation, and the
one error shape with nothing written on a rejection. Placement is driven by
``controller.run_once()`` on the stack's fake clock, so "fallback after 10m" takes no wall
time; one test lets the controller thread run, to show that a create wakes it.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import text

from tensora.keys import apikeys
from tensora.storage import NOT_FOUND
from tensora.store import workloads as workloads_repo
from tests.support import services
from tests.support.api import WRITTEN_TABLES, Api, assert_error, created, iso, own_model, settle
from tests.support.api import api as api  # the fixture, imported under its name
from tests.support.clock import FakeClock
from tests.support.stack import T0, stack

ROUTES = ["/v1/workloads", "/v1/workloads/{workload_id}", "/v1/workloads/{workload_id}/events",
          "/v1/workloads/{workload_id}/stop", "/v1/workloads/{workload_id}/restart", "/v1/catalog",
          "/v1/usage", "/v1/usage/tokens", "/v1/keys", "/v1/keys/{key_id}", "/v1/gateway/routes",
          "/v1/gateway/usage", "/v1/owners", "/v1/owners/{owner}", "/healthz", "/readyz"]


# -- harness --------------------------------------------------------------------------

@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def shared(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Api]:
    """One server for the rejection tables: nothing is ever created on it, so every table
    that a workload write touches must stay empty."""
    tmp = tmp_path_factory.mktemp("shared")
    url = str(tmp / "tensora.db") if request.param == "sqlite" else request.getfixturevalue("pg").new_database()
    s = stack(url, tmp, run_controller=False)
    with services.serving(s.app) as live:
        a = Api(s, live.url, tmp)
        alice = a.as_(s.alice)  # alice's files: what the rejection tables name
        # every rejection below is a create that counts against alice's rate: room for tables of any length
        assert a.as_(s.admin).put("/v1/owners/alice", json={"limits": {"creates_per_minute": 100_000}}).is_success
        own_model(a, alice)
        assert alice.put("/v1/files/notes.safetensors", content=b"these are notes, not tensors\n").status_code == 201
        assert alice.put("/v1/files/empty/readme.txt", content=b"no tensors here").status_code == 201
        try:
            yield a
        finally:
            a.close()


def occupy(api: Api, *classes: str) -> list[str]:
    """Admin places a notebook for carol on each class (the ADR's "GPUs are sold out")."""
    admin = api.as_(api.stack.admin)
    ids = [created(admin, kind="notebook", name=f"holds-{i}", gpu_class=c, owner="carol")["id"]
           for i, c in enumerate(classes)]
    api.cycle()
    for wid, c in zip(ids, classes, strict=True):
        assert admin.get(f"/v1/workloads/{wid}").json()["placed_class"] == c
    return ids


# -- workloads: create and read back ----------------------------------------------------

def test_a_created_workload_shows_its_policy_and_where_it_will_run(api: Api) -> None:
    alice = api.as_(api.stack.alice)
    model, params = own_model(api, alice)
    ep = created(alice, kind="endpoint", name="chat", gpu_class="l40s-48gb", fallback=["a100-80gb", "cpu"],
                 fallback_after="10m", model=model, replicas=2, spec={"ttft_deadline_s": 10})
    assert ep["id"].startswith("wl_")
    assert (ep["state"], ep["kind"], ep["owner"], ep["region"]) == ("queued", "endpoint", "alice", "local")
    assert ep["gpu_class"] == ep["requested_class"] == "l40s-48gb"
    assert ep["placed_class"] is None
    assert (ep["fallback"], ep["fallback_after_s"]) == (["a100-80gb", "cpu"], 600.0)
    assert ep["conditions"] == [] and ep["restart_available"] is False
    assert "l40s-48gb" in ep["reason"]
    assert ep["created_at"] == iso(T0)
    assert ep["replicas"] == [] and ep.get("access") is None
    assert ep["model_params"] == params  # read from the safetensors header by the server
    assert (ep["model"], ep["spec"]) == ("tiny.safetensors", {"ttft_deadline_s": 10})  # the name, not a host path
    assert "10-50x slower" in ep["warning"]

    # what GET returns agrees with what POST returned
    got = alice.get(f"/v1/workloads/{ep['id']}").json()
    for k in ("id", "state", "gpu_class", "requested_class", "placed_class", "fallback", "fallback_after_s",
              "region", "conditions", "reason", "created_at", "restart_available", "warning", "replicas",
              "model", "model_params", "spec"):
        assert got[k] == ep[k], k

    nb = created(alice, kind="notebook", name="lab", gpu_class="l40s-48gb", fallback=["a100-80gb"],
                 fallback_after=90)
    assert nb["fallback_after_s"] == 90.0
    assert nb.get("warning") is None  # no CPU in the list: no CPU warning
    assert nb["access"] == {"url": None, "node": None} and nb.get("replicas") is None
    assert alice.put("/v1/files/images/debian.qcow2", content=b"QFI\xfb" + bytes(60)).status_code == 201
    vm = created(alice, kind="vm", name="box", gpu_class="a100-80gb", fallback=["cpu-8c-32g"],
                 image="images/debian.qcow2")
    assert vm["warning"] == ("CPU fallback is enabled: GPU drivers in the guest find no device while on CPU; "
                             "restart it on GPU to get one (the dashboard offers it when one frees)")  # a class too
    assert vm["fallback_after_s"] == 0.0 and vm["access"] == {"url": None, "node": None}
    assert alice.get(f"/v1/workloads/{vm['id']}").json()["image"] == vm["image"] == "images/debian.qcow2"
    plain = created(alice, kind="notebook", name="plain", gpu_class="cpu-1c-4g")
    assert plain["fallback"] == [] and plain.get("warning") is None
    on_cpu = created(alice, kind="notebook", name="on-cpu", gpu_class="cpu-2c-8g", fallback=["cpu-1c-4g"])
    assert on_cpu.get("warning") is None  # asked for CPU: nothing a GPU would have given is lost


def test_create_warns_when_the_region_has_none_of_the_class(api: Api) -> None:
    api.cycle()  # the region's nodes are known: an L40S, an A100, CPU; no H200
    alice = api.as_(api.stack.alice)
    alone = created(alice, kind="notebook", name="h200", gpu_class="h200-141gb")
    assert alone["warnings"] == ["this region has no h200-141gb (0 of 0); it waits until one is added, "
                                 "or add a fallback"]
    later = created(alice, kind="notebook", name="h200-or-cpu", gpu_class="h200-141gb", fallback=["cpu"],
                    fallback_after="10m")
    assert later["warnings"] == [later["warning"], "this region has no h200-141gb (0 of 0); it waits until one "
                                                   "is added, or runs on its fallback (cpu) meanwhile"]
    here = created(alice, kind="notebook", name="l40s", gpu_class="l40s-48gb")
    assert here["warnings"] == []  # the region has one, busy or not: nothing to warn of
    api.cycle()
    assert alice.get(f"/v1/workloads/{alone['id']}").json()["reason"] == alone["warnings"][0]


def test_workloads_placed_on_a_fallback_say_so_in_conditions_reason_and_events(api: Api) -> None:
    occupy(api, "l40s-48gb")
    alice = api.as_(api.stack.alice)
    on_a100 = created(alice, kind="notebook", name="on-a100", gpu_class="l40s-48gb", fallback=["a100-80gb"])
    api.cycle()
    w = settle(api, alice, on_a100["id"], "running")
    assert (w["requested_class"], w["placed_class"]) == ("l40s-48gb", "a100-80gb")
    assert [(c["type"], c["reason"]) for c in w["conditions"]] == [("degraded", "class_fallback")]
    assert "a100-80gb" in w["conditions"][0]["message"] and "l40s-48gb" in w["conditions"][0]["message"]
    assert w["access"]["node"] == "gpu-a100-1"

    # now both GPUs are taken: an endpoint that accepts cpu after 10m waits 10m, then runs on CPU
    model, _ = own_model(api, alice)
    ep = created(alice, kind="endpoint", name="chat", gpu_class="l40s-48gb", fallback=["a100-80gb", "cpu"],
                 fallback_after="10m", model=model)
    api.cycle()
    w = alice.get(f"/v1/workloads/{ep['id']}").json()
    assert (w["state"], w["placed_class"]) == ("queued", None)
    assert w["fallback_eligible_at"] == iso(T0 + 600)
    api.stack.clock.advance(599)
    api.cycle()
    assert alice.get(f"/v1/workloads/{ep['id']}").json()["state"] == "queued"
    api.stack.clock.advance(1)
    api.cycle()
    w = alice.get(f"/v1/workloads/{ep['id']}").json()
    assert w["state"] == "starting" and w["placed_class"].startswith("cpu-")
    assert w["reason"].startswith(f"placed on {w['placed_class']}: l40s-48gb unavailable for 10m")
    w = settle(api, alice, ep["id"], "running")
    assert w["requested_class"] == "l40s-48gb"
    assert [(c["type"], c["reason"]) for c in w["conditions"]] == [("degraded", "cpu_fallback")]
    assert "10-50x slower" in w["conditions"][0]["message"] and "10-50x slower" in w["warning"]
    assert [(r["class"], r["role"], r["state"]) for r in w["replicas"]] == [(w["placed_class"], "primary",
                                                                              "running")]

    events = alice.get(f"/v1/workloads/{ep['id']}/events").json()["data"]
    reasons = [e["reason"] for e in events]
    assert reasons[0] == "created: queued for l40s-48gb; fallback to a100-80gb, cpu after 600s"
    assert w["reason"] in reasons  # the placement sentence is the event's
    assert any(r.startswith(f"running on {w['placed_class']}") for r in reasons)
    assert [(e["from_state"], e["to_state"]) for e in events if e["type"] == "transition"][:3] == [
        (None, "queued"), ("queued", "starting"), ("starting", "running")]
    placed = next(e for e in events if e["reason"] == w["reason"])
    assert placed["at"] == iso(T0 + 600)
    assert [e["id"] for e in events] == sorted(e["id"] for e in events)


def test_an_install_step_is_an_endpoints_reason_only_while_it_lasts(db_url: str, tmp_path: Path) -> None:
    s = stack(db_url, tmp_path, start_delay_s=30, run_controller=False)
    with services.serving(s.app) as live:
        api = Api(s, live.url, tmp_path)
        try:
            occupy(api, "l40s-48gb")
            alice = api.as_(s.alice)
            model, _ = own_model(api, alice)
            ep = created(alice, kind="endpoint", name="chat", gpu_class="l40s-48gb", fallback=["cpu"],
                         fallback_after=0, model=model)["id"]
            api.cycle()
            placed = alice.get(f"/v1/workloads/{ep}").json()["reason"]
            assert placed.startswith("placed on cpu-"), placed
            with s.services.db.read() as conn:
                (replica,) = workloads_repo.replicas_of(conn, [ep])
            installing = ("installing runtime tensora-transformers: unpacking 48 packages into the environment "
                          "(step 3 of 3)")
            s.driver.wait_on(replica.id, installing)
            api.cycle()
            w = alice.get(f"/v1/workloads/{ep}").json()
            assert (w["state"], w["reason"]) == ("starting", installing)
            s.clock.advance(30)
            w = settle(api, alice, ep, "running")
            assert w["reason"] == placed
            assert [x["reason"] for x in alice.get("/v1/workloads").json()["data"] if x["id"] == ep] == [placed]
        finally:
            api.close()


def test_an_endpoint_runs_the_replicas_it_asked_for_and_lists_them(api: Api) -> None:
    alice = api.as_(api.stack.alice)
    model, params = own_model(api, alice)
    ep = created(alice, kind="endpoint", name="pair", gpu_class="cpu-2c-8g", model=model, replicas=2)
    assert ep["replicas"] == [] and ep["model_params"] == params
    api.cycle()
    w = settle(api, alice, ep["id"], "running")
    assert w["placed_class"] == "cpu-2c-8g" and w["conditions"] == []
    assert len(w["replicas"]) == 2 and len({r["id"] for r in w["replicas"]}) == 2
    assert all((r["class"], r["role"], r["state"]) == ("cpu-2c-8g", "primary", "running") for r in w["replicas"])
    listed = alice.get("/v1/workloads", params={"kind": "endpoint"}).json()["data"]
    assert [x["replicas"] for x in listed] == [w["replicas"]]
    api.stack.clock.advance(100)
    assert alice.get("/v1/usage").json()["total_seconds"] == pytest.approx(200)  # two replicas, 100 s each


ON_CPU = {  # kind -> what running on CPU instead of an L40S means for it (ADR-0010's table)
    "notebook": "JupyterLab runs without a GPU while on CPU; restart on GPU when one frees (the dashboard offers it)",
    "vm": "GPU drivers in the guest find no device while on CPU; restart it on GPU to get one "
          "(the dashboard offers it when one frees)",
    "endpoint": "CPU serving is roughly 10-50x slower than a GPU; it moves back to a GPU by itself when one frees",
}


@pytest.mark.parametrize("kind", ON_CPU, ids=[f"{k} on CPU says what it means for a {k}" for k in ON_CPU])
def test_each_kind_on_cpu_says_what_cpu_means_for_it(api: Api, kind: str) -> None:
    occupy(api, "l40s-48gb")
    alice = api.as_(api.stack.alice)
    extra = {"model": own_model(api, alice)[0]} if kind == "endpoint" else {}
    w = created(alice, kind=kind, name="w", gpu_class="l40s-48gb", fallback=["cpu"], fallback_after=0, **extra)
    assert w["warning"] == f"CPU fallback is enabled: {ON_CPU[kind]}"
    api.cycle()
    w = settle(api, alice, w["id"], "running")
    assert w["reason"] == "placed on cpu-16c-64g: l40s-48gb unavailable (fallback after 0s)"
    assert w["conditions"] == [{"type": "degraded", "reason": "cpu_fallback",
                                "message": f"placed on cpu-16c-64g instead of l40s-48gb: {ON_CPU[kind]}"}]
    assert ("10-50x" in w["conditions"][0]["message"]) is (kind == "endpoint")


def test_list_filters_by_kind_and_state_and_pages_with_a_cursor_in_creation_order(api: Api) -> None:
    alice = api.as_(api.stack.alice)
    model, _ = own_model(api, alice)
    made = [created(alice, kind="notebook", name=f"nb{i}", gpu_class="cpu-1c-4g")["id"] for i in range(2)]
    made += [created(alice, kind="vm", name=f"vm{i}", gpu_class="cpu-1c-4g")["id"] for i in range(2)]
    made += [created(alice, kind="endpoint", name="ep", gpu_class="cpu-2c-8g", model=model)["id"]]
    made += [created(alice, kind="notebook", name="nb2", gpu_class="cpu-1c-4g")["id"]]
    ids, vms, eps = {made[0], made[1], made[5]}, set(made[2:4]), {made[4]}
    stopped = made[2]
    assert alice.post(f"/v1/workloads/{stopped}/stop").json()["state"] == "stopped"  # never placed: at once
    everything = ids | vms | eps

    def listed(**params: Any) -> list[str]:
        r = alice.get("/v1/workloads", params=params)
        assert r.status_code == 200, r.text
        return [w["id"] for w in r.json()["data"]]

    assert listed() == made  # the order they were made in, kinds interleaved
    assert listed(kind="notebook") == [made[0], made[1], made[5]]
    assert set(listed(kind="vm")) == vms
    assert set(listed(kind="endpoint")) == eps
    assert listed(state="stopped") == [stopped]
    assert set(listed(state="queued")) == everything - {stopped}
    assert listed(kind="notebook", state="stopped") == []

    seen: list[str] = []
    pages, after = 0, None
    while pages < 10:
        params: dict[str, Any] = {"limit": 2} | ({"after": after} if after else {})
        page = alice.get("/v1/workloads", params=params).json()
        assert len(page["data"]) <= 2
        seen += [w["id"] for w in page["data"]]
        pages += 1
        after = page["next"]
        if after is None:
            break
        assert after == seen[-1]
    assert pages == 3 and seen == made
    assert alice.get("/v1/workloads", params={"limit": 6}).json()["next"] is None
    assert listed(limit=500, after=max(everything)) == []


def test_stop_then_restart_and_stop_is_safe_to_repeat(api: Api) -> None:
    alice = api.as_(api.stack.alice)
    nb = created(alice, kind="notebook", name="nb", gpu_class="cpu-2c-8g")
    api.cycle()
    w = settle(api, alice, nb["id"], "running")
    assert w["access"]["node"] == "cpu-1"  # the simulated fleet gives no URL

    assert w["reason"] == "placed on cpu-2c-8g"
    r = alice.post(f"/v1/workloads/{nb['id']}/stop")
    assert r.status_code == 200 and (r.json()["state"], r.json()["reason"]) == ("stopping", "stopped by its owner")
    restart = alice.post(f"/v1/workloads/{nb['id']}/restart")
    assert_error(restart, 409)
    assert restart.headers["Retry-After"].isdigit()
    w = settle(api, alice, nb["id"], "stopped")
    assert w["access"] == {"url": None, "node": None}
    assert w["reason"] == "stopped by its owner"  # not "placed on ..." any more
    again = alice.post(f"/v1/workloads/{nb['id']}/stop")
    assert again.status_code == 200 and (again.json()["state"], again.json()["reason"]) == ("stopped",
                                                                                              "stopped by its owner")

    r = alice.post(f"/v1/workloads/{nb['id']}/restart")  # no body: the placement policy
    assert r.status_code == 200, r.text
    assert (r.json()["state"], r.json()["placement"]) == ("queued", "policy")
    w = settle(api, alice, nb["id"], "running")
    assert (w["placed_class"], w["reason"]) == ("cpu-2c-8g", "placed on cpu-2c-8g")  # the placement is back
    reasons = [e["reason"] for e in alice.get(f"/v1/workloads/{nb['id']}/events").json()["data"]]
    assert any("stop requested" in x for x in reasons)
    assert any("restart requested" in x for x in reasons)
    assert_error(alice.post(f"/v1/workloads/{nb['id']}/restart", json={"placement": "gpu"}), 422, "placement")


def test_restart_on_gpu_is_offered_when_the_class_frees_and_takes_the_requested_class(api: Api) -> None:
    [holder] = occupy(api, "l40s-48gb")
    alice = api.as_(api.stack.alice)
    nb = created(alice, kind="notebook", name="nb", gpu_class="l40s-48gb", fallback=["cpu"], fallback_after=0)
    api.cycle()
    w = settle(api, alice, nb["id"], "running")
    cpu_class = w["placed_class"]
    assert cpu_class.startswith("cpu-") and w["restart_available"] is False
    api.stack.clock.advance(300)
    assert w["conditions"][0]["reason"] == "cpu_fallback"

    admin = api.as_(api.stack.admin)
    assert admin.post(f"/v1/workloads/{holder}/stop").status_code == 200
    assert settle(api, admin, holder, "stopped")["reason"] == "stopped by an admin"  # carol's, stopped by admin
    api.cycle()
    w = alice.get(f"/v1/workloads/{nb['id']}").json()
    assert w["restart_available"] is True and "l40s-48gb" in w["restart_reason"]
    assert (w["state"], w["placed_class"]) == ("running", cpu_class)  # a notebook never moves by itself

    r = alice.post(f"/v1/workloads/{nb['id']}/restart", json={"placement": "requested"})
    assert r.status_code == 200, r.text
    assert (r.json()["state"], r.json()["placement"], r.json()["restart_available"]) == ("queued", "requested",
                                                                                         False)
    w = settle(api, alice, nb["id"], "running")
    assert (w["placed_class"], w["requested_class"], w["conditions"]) == ("l40s-48gb", "l40s-48gb", [])
    assert w["access"]["node"] == "gpu-l40s-1"
    api.stack.clock.advance(60)
    usage = {row["placed_class"]: row["seconds"] for row in alice.get("/v1/usage").json()["data"]}
    assert usage == {cpu_class: pytest.approx(300), "l40s-48gb": pytest.approx(60)}


def test_delete_removes_the_workload_from_view_but_keeps_its_usage(api: Api) -> None:
    alice = api.as_(api.stack.alice)
    keep = created(alice, kind="notebook", name="keep", gpu_class="cpu-1c-4g")
    gone = created(alice, kind="notebook", name="gone", gpu_class="a100-80gb")
    api.cycle()
    settle(api, alice, gone["id"], "running")
    api.stack.clock.advance(120)

    r = alice.delete(f"/v1/workloads/{gone['id']}")
    assert r.status_code == 204 and r.content == b""
    for path in (f"/v1/workloads/{gone['id']}", f"/v1/workloads/{gone['id']}/events"):
        assert_error(alice.get(path), 404)
    assert_error(alice.post(f"/v1/workloads/{gone['id']}/stop"), 404)
    assert_error(alice.delete(f"/v1/workloads/{gone['id']}"), 404)
    assert [w["id"] for w in alice.get("/v1/workloads").json()["data"]] == [keep["id"]]

    # the A100 it held is released, and the time it ran is still accounted
    api.cycle(3)
    a100 = next(c for c in alice.get("/v1/catalog").json()["data"] if c["name"] == "a100-80gb")
    assert a100["capacity"]["local"]["free"] == a100["capacity"]["local"]["total"] == 1
    api.stack.clock.advance(1000)
    rows = {row["placed_class"]: row["seconds"] for row in alice.get("/v1/usage").json()["data"]}
    assert rows["a100-80gb"] == pytest.approx(120)
    assert rows["cpu-1c-4g"] == pytest.approx(1120)


def test_a_create_wakes_the_controller_instead_of_waiting_for_its_tick(db_url: str, tmp_path: Path) -> None:
    s = stack(db_url, tmp_path, tick_s=3600)  # the controller thread runs; its next tick is an hour away
    with services.serving(s.app) as live, httpx.Client(base_url=live.url, headers=s.headers(s.alice)) as alice:
        deadline = time.monotonic() + 10
        while not s.controller.is_leader():  # its first cycle, at start
            assert time.monotonic() < deadline
            time.sleep(0.01)
        wid = created(alice, kind="notebook", name="now", gpu_class="cpu-1c-4g")["id"]
        while (w := alice.get(f"/v1/workloads/{wid}").json())["state"] == "queued":
            assert time.monotonic() < deadline, "not placed until the next tick"
            time.sleep(0.01)
        assert w["placed_class"] == "cpu-1c-4g"
    s.services.db.dispose()


# -- catalog and usage ----------------------------------------------------------------

def test_catalog_lists_every_class_with_kind_and_free_capacity_that_drops_when_placed(api: Api) -> None:
    alice = api.as_(api.stack.alice)
    api.cycle()  # the controller records the fleet's nodes

    def capacity() -> dict[str, tuple[int, int]]:
        body = alice.get("/v1/catalog").json()
        assert body["region"] == "local" and "10-50x slower" in body["note"]
        out = {}
        for c in body["data"]:
            assert c["kind"] == ("gpu" if c["gpu"] else "cpu")
            assert c["kind"] == ("cpu" if c["name"].startswith("cpu-") else "gpu")
            cap = c["capacity"]["local"]
            out[c["name"]] = (cap["free"], cap["total"])
        return out

    before = capacity()
    assert before["l40s-48gb"] == (1, 1) and before["a100-80gb"] == (1, 1)
    assert before["h100-80gb"] == (0, 0)  # no H100 in this fleet
    assert all(free == total for free, total in before.values())
    assert before["cpu-1c-4g"][1] > before["cpu-32c-128g"][1] > 0

    created(alice, kind="notebook", name="takes-l40s", gpu_class="l40s-48gb")
    created(alice, kind="notebook", name="takes-cpu", gpu_class="cpu-32c-128g")
    api.cycle()
    after = capacity()
    assert after["l40s-48gb"] == (0, 1) and after["a100-80gb"] == (1, 1)
    assert after["cpu-32c-128g"][0] < before["cpu-32c-128g"][0]
    assert {k: v[1] for k, v in after.items()} == {k: v[1] for k, v in before.items()}  # totals stay
    assert all(after[k][0] <= before[k][0] for k in before)

    short = {c["name"]: c["short"] for c in alice.get("/v1/catalog").json()["data"]}
    assert short["l40s-48gb"] == {"local": "0 GPU free, 1 needed"}  # what none fits for, with its figures
    assert short["h100-80gb"] == {"local": "this region has none"}  # not busy: absent
    assert short["a100-80gb"] == {}  # one fits: nothing short


def test_usage_is_accounted_by_placed_class_owner_and_day(api: Api) -> None:
    alice, bob, admin = api.as_(api.stack.alice), api.as_(api.stack.bob), api.as_(api.stack.admin)
    created(alice, kind="notebook", name="nb", gpu_class="l40s-48gb")
    created(bob, kind="vm", name="vm", gpu_class="cpu-2c-8g")
    api.cycle()
    api.stack.clock.advance(20 * 3600)  # 08:00 -> 04:00 the next day, across midnight UTC

    def usage(client: httpx.Client, **params: Any) -> dict[str, Any]:
        r = client.get("/v1/usage", params=params)
        assert r.status_code == 200, r.text
        out: dict[str, Any] = r.json()
        return out

    mine = usage(alice)
    assert mine["group_by"] == ["placed_class"]
    assert [(r["placed_class"], r["seconds"], r["hours"]) for r in mine["data"]] == [("l40s-48gb", 72000, 20)]
    assert mine["total_seconds"] == 72000 and mine["until"] == iso(T0 + 72000)

    days = usage(alice, group_by="day")["data"]
    assert sorted((r["day"], r["hours"]) for r in days) == [("2027-01-15", 16), ("2027-01-16", 4)]
    by_all = usage(alice, group_by="placed_class,owner,day")
    assert by_all["group_by"] == ["placed_class", "owner", "day"]
    assert {(r["placed_class"], r["owner"], r["day"]) for r in by_all["data"]} == {
        ("l40s-48gb", "alice", "2027-01-15"), ("l40s-48gb", "alice", "2027-01-16")}
    assert by_all["total_seconds"] == 72000
    window = usage(alice, since=T0 + 3600, until=T0 + 7200)
    assert window["total_seconds"] == 3600

    assert {(r["owner"], r["seconds"]) for r in usage(admin, group_by="owner")["data"]} == {
        ("alice", 72000), ("bob", 72000)}
    assert [r["placed_class"] for r in usage(admin, owner="bob")["data"]] == ["cpu-2c-8g"]
    assert [r["owner"] for r in usage(bob, group_by="owner")["data"]] == ["bob"]
    assert usage(alice, owner="alice")["total_seconds"] == 72000
    assert_error(alice.get("/v1/usage", params={"owner": "bob"}), 403, "owner")
    assert_error(alice.get("/v1/usage", params={"group_by": "price"}), 422, "group_by")


# -- keys and auth --------------------------------------------------------------------

def test_keys_show_their_secret_once_store_only_a_digest_and_revoke_at_once(api: Api) -> None:
    alice, admin = api.as_(api.stack.alice), api.as_(api.stack.admin)
    assert_error(alice.post("/v1/keys", json={"name": "lap\x00top"}), 422, "name")  # PostgreSQL text holds no NUL
    r = alice.post("/v1/keys", json={"name": "laptop", "scopes": ["workloads:read", "usage:read"]})
    assert r.status_code == 201, r.text
    key = r.json()
    secret = key["key"]
    assert apikeys.well_formed(secret)
    assert (key["owner"], key["name"], key["scopes"]) == ("alice", "laptop", ["workloads:read", "usage:read"])
    assert secret not in key["hint"] and key["hint"][:8] == secret[:8] and key["hint"][-4:] == secret[-4:]

    listed = alice.get("/v1/keys").json()["data"]
    mine = next(k for k in listed if k["id"] == key["id"])
    assert mine["key"] is None and mine["hint"] == key["hint"]
    assert {k["owner"] for k in listed} == {"alice"}
    assert secret not in api.as_(api.stack.alice).get("/v1/keys").text
    assert {"admin", "alice", "bob"} <= {k["owner"] for k in admin.get("/v1/keys").json()["data"]}

    with api.stack.services.db.read() as conn:
        row = conn.execute(text("SELECT * FROM api_keys WHERE id = :id"), {"id": key["id"]}).mappings().one()
    assert secret not in [str(v) for v in row.values()]
    assert not any(secret in str(v) for v in row.values())
    assert row["digest"] == hashlib.sha256(secret.encode()).hexdigest()

    laptop = api.as_(secret)
    assert laptop.get("/v1/workloads").status_code == 200  # the key works, and is now cached
    assert laptop.get("/v1/usage").status_code == 200
    assert_error(api.as_(api.stack.bob).delete(f"/v1/keys/{key['id']}"), 404)  # not bob's
    assert laptop.get("/v1/workloads").status_code == 200
    assert alice.delete(f"/v1/keys/{key['id']}").status_code == 204
    r = laptop.get("/v1/workloads")
    assert_error(r, 401)
    assert r.headers["WWW-Authenticate"] == "Bearer"
    assert key["id"] not in {k["id"] for k in alice.get("/v1/keys").json()["data"]}
    assert_error(alice.delete(f"/v1/keys/{key['id']}"), 404)

    carol = admin.post("/v1/keys", json={"owner": "carol", "name": "carol"})
    assert carol.status_code == 201 and carol.json()["owner"] == "carol"
    assert set(carol.json()["scopes"]) == set(apikeys.DEFAULT_SCOPES)
    assert api.as_(carol.json()["key"]).get("/v1/workloads").json()["data"] == []


def test_every_owner_is_untrusted_until_an_admin_marks_it_trusted(api: Api) -> None:
    alice, bob, admin = api.as_(api.stack.alice), api.as_(api.stack.bob), api.as_(api.stack.admin)
    got = alice.get("/v1/owners/alice").json()
    assert {k: got[k] for k in ("owner", "trusted", "updated_at")} == {"owner": "alice", "trusted": False,
                                                                       "updated_at": None}
    assert_error(alice.put("/v1/owners/alice", json={"trusted": True}), 403)  # only admins set flags
    assert_error(alice.get("/v1/owners/bob"), 404)  # anyone else's: as if it did not exist
    assert_error(alice.get("/v1/owners"), 403)
    assert_error(admin.put("/v1/owners/alice", json={"trusted": "maybe"}), 422, "trusted")
    assert_error(admin.put("/v1/owners/alice", json={"trusted": True, "vip": True}), 422, "vip")
    assert_error(admin.put("/v1/owners/alice", json={"trusted": False, "untrusted": False}), 422,
                 "untrusted")  # the old flag is gone
    assert_error(admin.put("/v1/owners/not%20a%20name", json={"trusted": True}), 422, "owner")
    assert admin.get("/v1/owners").json() == {"data": []}  # nothing half-written by those

    r = admin.put("/v1/owners/alice", json={"trusted": True})
    assert r.status_code == 200 and (r.json()["trusted"], r.json()["updated_at"]) == (True, iso(T0))
    assert admin.put("/v1/owners/alice", json={"trusted": True}).json() == r.json()  # a PUT twice: one state
    assert alice.get("/v1/owners/alice").json()["trusted"] is True
    assert [o["owner"] for o in admin.get("/v1/owners").json()["data"]] == ["alice"]

    nb_alice = created(alice, kind="notebook", name="nb", gpu_class="cpu-2c-8g")
    nb_bob = created(bob, kind="notebook", name="nb", gpu_class="cpu-2c-8g")
    api.cycle()
    started = {s.workload_id: s for s in api.stack.controller.driver.specs()}  # what the driver was told
    assert started[nb_alice["id"]].trusted is True and started[nb_bob["id"]].trusted is False  # bob: no row


def test_a_key_revoked_by_another_process_stops_working_within_the_cache_ttl(api: Api) -> None:
    keys = api.stack.services.keys
    keys.clock = clock = FakeClock()  # the cache's TTL counted on a clock moved by hand
    r = api.as_(api.stack.alice).post("/v1/keys", json={"name": "ci", "scopes": ["workloads:read"]})
    key = r.json()
    ci = api.as_(key["key"])
    assert ci.get("/v1/workloads").status_code == 200  # looked up, and cached for ttl
    with api.stack.services.db.write() as conn:  # what another API process's revoke writes
        conn.execute(text("UPDATE api_keys SET revoked_at = :t WHERE id = :id"), {"t": T0, "id": key["id"]})
    clock.advance(keys.ttl - 0.01)
    assert ci.get("/v1/workloads").status_code == 200  # still cached: this process has not seen the revoke
    clock.advance(0.02)
    assert_error(ci.get("/v1/workloads"), 401)  # past the cache TTL: looked up again, and refused


def test_a_key_cannot_grant_what_it_lacks_nor_act_for_another_owner(shared: Api) -> None:
    alice = shared.as_(shared.stack.alice)
    for scopes in (["admin"], ["workloads:read", "inference"]):
        err = assert_error(alice.post("/v1/keys", json={"scopes": scopes}), 403, "scopes")
        assert err["type"] == "permission_denied"
    assert_error(alice.post("/v1/keys", json={"owner": "bob", "scopes": ["workloads:read"]}), 403, "owner")
    assert_error(alice.post("/v1/keys", json={"scopes": ["root"]}), 422, "scopes[0]")
    assert_error(alice.post("/v1/keys", json={"name": "x", "colour": "blue"}), 422, "colour")

    reader = shared.as_(alice.post("/v1/keys", json={"scopes": ["workloads:read"]}).json()["key"])
    assert reader.get("/v1/workloads").status_code == 200
    assert reader.get("/v1/catalog").status_code == 200
    before = shared.rows()
    for r in (reader.post("/v1/workloads", json={"kind": "notebook", "name": "nb", "gpu_class": "cpu-1c-4g"}),
              reader.post("/v1/workloads/wl_nope/stop"),
              reader.delete("/v1/workloads/wl_nope")):
        err = assert_error(r, 403)
        assert "workloads:write" in err["message"] and err["type"] == "permission_denied"
    assert "usage:read" in assert_error(reader.get("/v1/usage"), 403)["message"]
    assert "keys:write" in assert_error(reader.get("/v1/keys"), 403)["message"]
    assert "keys:write" in assert_error(reader.post("/v1/keys", json={"scopes": ["workloads:read"]}),
                                        403)["message"]
    assert shared.rows() == before


def _unknown_key() -> str:
    return apikeys.generate()


def _bad_checksum() -> str:
    key = apikeys.generate()
    return key[:-1] + ("A" if key[-1] != "A" else "B")


AUTH_CASES: dict[str, dict[str, str]] = {
    "no Authorization header": {},
    "not a bearer scheme": {"Authorization": "Basic YWxpY2U6c2VjcmV0"},
    "bearer without a key": {"Authorization": "Bearer"},
    "malformed key (too short)": {"Authorization": "Bearer tsk_abc"},
    "wrong prefix": {"Authorization": "Bearer sk_" + "a" * 39},
    "bad checksum": {"Authorization": "Bearer " + _bad_checksum()},
    "well-formed but unknown": {"Authorization": "Bearer " + _unknown_key()},
}


@pytest.mark.parametrize("headers", AUTH_CASES.values(), ids=AUTH_CASES.keys())
def test_requests_without_a_valid_key_are_401(shared: Api, headers: dict[str, str]) -> None:
    client = shared.as_(None)
    for method, path in (("GET", "/v1/workloads"), ("POST", "/v1/workloads"), ("GET", "/v1/catalog"),
                         ("GET", "/v1/usage"), ("POST", "/v1/keys"), ("DELETE", "/v1/keys/key_x"),
                         ("POST", "/v1/workloads/wl_x/restart")):
        r = client.request(method, path, headers=headers,
                           json={"kind": "notebook", "name": "nb", "gpu_class": "cpu-1c-4g"}
                           if path == "/v1/workloads" and method == "POST" else None)
        err = assert_error(r, 401)
        assert err["type"] == "authentication_error"
        assert r.headers["WWW-Authenticate"] == "Bearer"
    assert shared.rows()["workloads"] == 0


def test_an_invalid_key_gets_the_same_answer_whatever_is_wrong_with_it(shared: Api) -> None:
    """No oracle: a made-up, mistyped or revoked key read the same."""
    alice = shared.as_(shared.stack.alice)
    revoked = alice.post("/v1/keys", json={"scopes": ["workloads:read"]}).json()
    assert alice.delete(f"/v1/keys/{revoked['id']}").status_code == 204
    answers = {shared.as_(k).get("/v1/workloads").json()["error"]["message"]
               for k in (_unknown_key(), _bad_checksum(), "tsk_abc", revoked["key"])}
    assert len(answers) == 1


def test_owners_see_and_touch_only_their_own_workloads(api: Api) -> None:
    alice, bob, admin = api.as_(api.stack.alice), api.as_(api.stack.bob), api.as_(api.stack.admin)
    theirs = created(alice, kind="notebook", name="private", gpu_class="cpu-1c-4g")
    wid = theirs["id"]
    own = created(bob, kind="notebook", name="bobs", gpu_class="cpu-1c-4g")
    api.cycle()
    before = alice.get(f"/v1/workloads/{wid}").json()
    events_before = alice.get(f"/v1/workloads/{wid}/events").json()
    assert before["state"] == "starting"

    missing = assert_error(bob.get("/v1/workloads/wl_doesnotexist"), 404)
    for r in (bob.get(f"/v1/workloads/{wid}"), bob.get(f"/v1/workloads/{wid}/events"),
              bob.post(f"/v1/workloads/{wid}/stop"), bob.post(f"/v1/workloads/{wid}/restart"),
              bob.post(f"/v1/workloads/{wid}/restart", json={"placement": "requested"}),
              bob.post(f"/v1/workloads/{wid}/stop", headers={"Idempotency-Key": "bob-1"}),
              bob.delete(f"/v1/workloads/{wid}")):
        err = assert_error(r, 404)
        assert err["type"] == missing["type"] == "not_found"  # as if it did not exist
    assert [w["id"] for w in bob.get("/v1/workloads").json()["data"]] == [own["id"]]
    assert alice.get(f"/v1/workloads/{wid}").json() == before
    assert alice.get(f"/v1/workloads/{wid}/events").json() == events_before

    assert {w["id"] for w in admin.get("/v1/workloads").json()["data"]} == {wid, own["id"]}
    assert admin.get(f"/v1/workloads/{wid}").json()["owner"] == "alice"

    body = {"kind": "notebook", "name": "forged", "gpu_class": "cpu-1c-4g", "owner": "bob"}
    rows = api.rows()
    assert_error(alice.post("/v1/workloads", json=body), 403, "owner")
    assert_error(alice.post("/v1/workloads", json=body, headers={"Idempotency-Key": "forge-1"}), 403, "owner")
    assert api.rows() == rows
    assert created(alice, **{**body, "name": "mine", "owner": "alice"})["owner"] == "alice"
    assert created(admin, **body)["owner"] == "bob"
    assert {w["name"] for w in bob.get("/v1/workloads").json()["data"]} == {"bobs", "forged"}


# -- errors: one shape, nothing written -------------------------------------------------

NB = {"kind": "notebook", "name": "nb", "gpu_class": "l40s-48gb"}
EP = {"kind": "endpoint", "name": "ep", "gpu_class": "l40s-48gb", "model": "tiny.safetensors"}  # in alice's files


@dataclass(frozen=True)
class Bad:
    body: dict[str, Any] | bytes
    field_name: str | None
    says: str = ""
    status: int = 422
    headers: dict[str, str] = field(default_factory=dict)


BAD_CREATES = {
    "unknown kind": Bad({**NB, "kind": "pod"}, "kind", "notebook"),
    "empty name": Bad({**NB, "name": ""}, "name"),
    "name not a DNS label": Bad({**NB, "name": "My Notebook"}, "name"),
    "missing gpu_class": Bad({"kind": "notebook", "name": "nb"}, "gpu_class"),
    "negative fallback_after": Bad({**NB, "fallback": ["cpu"], "fallback_after": -5}, "fallback_after_s", ">= 0"),
    "unparsable fallback_after": Bad({**NB, "fallback": ["cpu"], "fallback_after": "soon"}, "fallback_after_s",
                                     "'soon'"),
    "fallback_after and fallback_after_s": Bad({**NB, "fallback_after": "1m", "fallback_after_s": 60}, None,
                                               "not both"),
    "fallback repeats the requested class": Bad({**NB, "fallback": ["a100-80gb", "l40s-48gb"]}, "fallback",
                                                "gpu_class"),
    "duplicate fallback entries": Bad({**NB, "fallback": ["cpu", "cpu"]}, "fallback", "twice"),
    "unknown gpu_class": Bad({**NB, "gpu_class": "tpu-v5"}, "gpu_class", "tpu-v5"),
    "fallback entry not in the catalog": Bad({**NB, "fallback": ["cpu", "tpu-v5"]}, "fallback[1]", "tpu-v5"),
    "endpoint without a model": Bad({**EP, "model": None}, "model", "model"),
    "model not in your files": Bad({**EP, "model": "nope.safetensors"}, "model", NOT_FOUND),
    "model a host path": Bad({**EP, "model": "{dir}/tensora.db"}, "model", NOT_FOUND),
    "model not safetensors": Bad({**EP, "model": "notes.safetensors"}, "model", "notes.safetensors: header length"),
    "model directory without safetensors": Bad({**EP, "model": "empty"}, "model", "empty: no .safetensors"),
    "image not in your files": Bad({**NB, "kind": "vm", "image": "nope.qcow2"}, "image", NOT_FOUND),
    "image on a notebook": Bad({**NB, "image": "tiny.safetensors"}, "image", "vms only"),
    "replicas 0": Bad({**EP, "replicas": 0}, "replicas", "1"),
    "replicas 17": Bad({**EP, "replicas": 17}, "replicas", "16"),
    "replicas on a notebook": Bad({**NB, "replicas": 2}, "replicas", "endpoints only"),
    "wrong region": Bad({**NB, "region": "eu-west"}, "region", "local"),
    "unknown top-level field": Bad({**NB, "colour": "blue"}, "colour", "unknown field"),
    "fallback not a list": Bad({**NB, "fallback": "cpu"}, "fallback"),
    "not JSON": Bad(b'{"kind": notebook', None, "not valid JSON", headers={"Content-Type": "application/json"}),
    "JSON but not an object": Bad(b"[1, 2]", None, headers={"Content-Type": "application/json"}),
    "oversize body (Content-Length)": Bad(b"{" + b" " * (1 << 20) + b"}", None, "larger than", 413,
                                          {"Content-Type": "application/json"}),
}


def _format(body: dict[str, Any], where: Path) -> dict[str, Any]:
    return {k: v.format(dir=where) if isinstance(v, str) else v for k, v in body.items()}


@pytest.mark.parametrize("case", BAD_CREATES.values(), ids=BAD_CREATES.keys())
def test_bad_creates_are_rejected_naming_the_field_and_write_nothing(shared: Api, case: Bad) -> None:
    """Each body is sent plain and with an Idempotency-Key: the same answer, and no row anywhere
    (a rejection stores no idempotency record either)."""
    alice = shared.as_(shared.stack.alice)
    answers = []
    for extra in ({}, {"Idempotency-Key": "retry-me"}, {"Idempotency-Key": "retry-me"}):
        headers = case.headers | extra
        if isinstance(case.body, bytes):
            r = alice.post("/v1/workloads", content=case.body, headers=headers)
        else:
            r = alice.post("/v1/workloads", json=_format(case.body, shared.tmp), headers=headers)
        err = assert_error(r, case.status, case.field_name)
        assert case.says in err["message"] and str(shared.tmp) not in err["message"]  # never a host path
        assert err["type"] == ("payload_too_large" if case.status == 413 else "invalid_request")
        assert "Idempotent-Replayed" not in r.headers
        answers.append(err)
    assert answers[0] == answers[1] == answers[2]
    assert shared.rows() == dict.fromkeys(WRITTEN_TABLES, 0)
    assert alice.get("/v1/workloads").json()["data"] == []


def test_an_unknown_class_is_answered_with_every_known_class(shared: Api) -> None:
    alice = shared.as_(shared.stack.alice)
    err = assert_error(alice.post("/v1/workloads", json={**NB, "gpu_class": "tpu-v5"}), 422, "gpu_class")
    names = [c["name"] for c in alice.get("/v1/catalog").json()["data"]]
    assert len(names) > 5
    assert all(n in err["message"] for n in names)


def test_a_chunked_body_over_the_limit_is_refused_too(shared: Api) -> None:
    alice = shared.as_(shared.stack.alice)

    def chunks() -> Iterator[bytes]:
        yield b'{"kind": "notebook", "name": "nb", "gpu_class": "cpu-1c-4g", "spec": {"x": "'
        for _ in range(5):
            yield b"y" * (256 << 10)
        yield b'"}}'

    r = alice.post("/v1/workloads", content=chunks(), headers={"Content-Type": "application/json",
                                                               "Idempotency-Key": "chunked"})
    assert_error(r, 413)
    assert shared.rows() == dict.fromkeys(WRITTEN_TABLES, 0)


BAD_QUERIES = {
    "kind filter unknown": ("/v1/workloads?kind=pod", "kind"),
    "state filter unknown": ("/v1/workloads?state=sleeping", "state"),
    "limit 0": ("/v1/workloads?limit=0", "limit"),
    "limit 501": ("/v1/workloads?limit=501", "limit"),
    "limit not a number": ("/v1/workloads?limit=many", "limit"),
    "usage group_by unknown": ("/v1/usage?group_by=price", "group_by"),
    "usage since negative": ("/v1/usage?since=-1", "since"),
}


@pytest.mark.parametrize(("path", "field_"), BAD_QUERIES.values(), ids=BAD_QUERIES.keys())
def test_bad_query_parameters_name_the_parameter(shared: Api, path: str, field_: str) -> None:
    err = assert_error(shared.as_(shared.stack.alice).get(path), 422, field_)
    assert err["type"] == "invalid_request"


def test_unknown_routes_methods_and_ids_answer_in_the_same_shape(shared: Api) -> None:
    alice = shared.as_(shared.stack.alice)
    assert_error(alice.get("/v1/nothing-here"), 404)
    assert_error(alice.get("/v1/workloads/wl_nope"), 404)
    assert_error(alice.post("/v1/workloads/wl_nope/stop"), 404)
    assert_error(alice.delete("/v1/keys/key_nope"), 404)
    assert_error(alice.put("/v1/workloads", json=NB), 405)
    err = assert_error(alice.post("/v1/workloads", json=NB, headers={"Idempotency-Key": ""}), 422,
                       "Idempotency-Key")
    assert "Idempotency-Key" in err["message"]
    assert shared.rows() == dict.fromkeys(WRITTEN_TABLES, 0)


# -- health and the API's description --------------------------------------------------

def test_health_readiness_openapi_and_docs_need_no_key(shared: Api) -> None:
    anon = shared.as_(None)
    assert anon.get("/healthz").json() == {"status": "ok"}
    ready = anon.get("/readyz")
    assert ready.status_code == 200
    assert ready.json()["status"] == "ready" and ready.json()["region"] == "local"
    assert ready.headers["x-request-id"]
    assert anon.get("/healthz", headers={"X-Request-Id": "trace-me"}).headers["x-request-id"] == "trace-me"

    spec = anon.get("/openapi.json").json()
    assert set(ROUTES) <= set(spec["paths"])
    assert {"post", "get"} <= set(spec["paths"]["/v1/workloads"])
    assert "delete" in spec["paths"]["/v1/workloads/{workload_id}"]
    assert "10-50x slower" in spec["info"]["description"]
    params = {p["name"] for p in spec["paths"]["/v1/workloads"]["post"].get("parameters", [])}
    assert "Idempotency-Key" in params

    docs = anon.get("/docs")
    assert docs.status_code == 200 and docs.headers["content-type"].startswith("text/html")
    assert "swagger" in docs.text.lower() and "/openapi.json" in docs.text
