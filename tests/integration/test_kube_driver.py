"""The Kubernetes driver over real HTTP against an API-server double (``kube_double``: a fake, said
plainly): capacity from its nodes and pods, replicas' objects made, adopted on a second start and by
a new driver (a controller restart), states read back, stopped, transient API errors redone; every
pod admitted by the double's Pod Security "restricted" check, as the workloads namespace enforces it.
And ``tensora serve --driver kubernetes``'s wiring: the controller places a workload through it,
under kata for an owner no admin trusted."""

from __future__ import annotations

import copy
import dataclasses
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from tensora.config.catalog import default_catalog
from tensora.drivers.base import ReplicaSpec
from tensora.drivers.kubernetes.driver import KubernetesDriver, connect
from tensora.drivers.kubernetes.render import KATA, home_claim_name, object_name
from tensora.placement.kinds import ReplicaState, WorkloadKind
from tensora.storage import owner_dir
from tensora.store.rows import WorkloadRecord
from tests.support import services
from tests.support.kube_double import ENFORCE, NAMESPACES, ApiServerDouble

pytest.importorskip("lightkube")

NS = "tensora"
FILES, CLAIM = Path("/var/lib/tensora/files"), "tensora-files"
CATALOG = default_catalog()
PODS, NODES = "api/v1/pods", "api/v1/nodes"
ISVC = "apis/serving.kserve.io/v1beta1/inferenceservices"
CLAIMS = "api/v1/persistentvolumeclaims"
GFD = {"nvidia.com/gpu.product": "NVIDIA-L40S", "nvidia.com/gpu.memory": "46068",
       "topology.kubernetes.io/region": "eu-west"}


def node(name: str, cpu: str, memory: str, gpus: int = 0, labels: dict[str, str] | None = None) -> dict[str, Any]:
    alloc = {"cpu": cpu, "memory": memory, **({"nvidia.com/gpu": str(gpus)} if gpus else {})}
    return {"metadata": {"name": name, "labels": labels or {"topology.kubernetes.io/region": "eu-west"}},
            "spec": {}, "status": {"allocatable": alloc, "conditions": [{"type": "Ready", "status": "True"}]}}


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[tuple[ApiServerDouble, Path]]:
    double = ApiServerDouble()
    double.seed(NAMESPACES, {"metadata": {"name": NS, "labels": {ENFORCE: "restricted"}}})  # as the overlay has it
    double.seed(NODES, node("gpu-1", "64", "512Gi", gpus=2, labels=GFD))
    double.seed(NODES, node("cpu-1", "64", "256Gi"))
    double.seed(NODES, node("elsewhere", "64", "256Gi", labels={"topology.kubernetes.io/region": "us-east"}))
    double.seed(PODS, {"metadata": {"name": "someone-else", "namespace": "ml"},
                       "spec": {"nodeName": "cpu-1",
                                "containers": [{"name": "c", "resources": {"requests": {"cpu": "8"}}}]},
                       "status": {"phase": "Running"}})
    with services.serving(double) as live:
        kubeconfig = tmp_path / "kubeconfig"
        kubeconfig.write_text(f"""apiVersion: v1
kind: Config
clusters: [{{name: double, cluster: {{server: "{live.url}"}}}}]
users: [{{name: tester, user: {{token: not-a-secret}}}}]
contexts: [{{name: double, context: {{cluster: double, user: tester, namespace: {NS}}}}}]
current-context: double
""")
        yield double, kubeconfig


_OPEN: list[KubernetesDriver] = []


def driver(kubeconfig: Path, **kw: Any) -> KubernetesDriver:
    d = connect(str(kubeconfig), CATALOG, "eu-west", NS, **{"files_root": FILES, "files_claim": CLAIM, **kw})
    _OPEN.append(d)
    return d


@pytest.fixture(autouse=True)
def _close_drivers() -> Iterator[None]:
    yield
    while _OPEN:
        _OPEN.pop().close()


NB = ReplicaSpec("rp_nb1", "wl_nb", WorkloadKind.NOTEBOOK, "cpu-4c-16g", "cpu-1", owner="alice@example.com")
EP = ReplicaSpec("rp_ep1", "wl_ep", WorkloadKind.ENDPOINT, "l40s-48gb", "gpu-1",
                 model=str(FILES / owner_dir(Path(), "bob").name / "m"), owner="bob")


def test_capacity_comes_from_the_region_s_nodes_minus_other_pods(cluster: tuple[ApiServerDouble, Path]) -> None:
    _, kubeconfig = cluster
    nodes = {n.name: n for n in driver(kubeconfig).nodes()}
    assert set(nodes) == {"gpu-1", "cpu-1"}  # us-east's node belongs to another controller
    assert nodes["gpu-1"].gpus == {"L40S": 2} and nodes["cpu-1"].cpu == 56.0


def test_a_node_s_pod_limit_is_its_allocatable_pods_less_the_pods_of_others(
        cluster: tuple[ApiServerDouble, Path]) -> None:
    double, kubeconfig = cluster
    double.objects[(NODES, "", "cpu-1")]["status"]["allocatable"]["pods"] = "110"
    d = driver(kubeconfig)
    d.start(NB)  # a Tensora replica pod on cpu-1: a placement, counted from the store, not here
    nodes = {n.name: n for n in d.nodes()}
    assert nodes["cpu-1"].pods == 109  # someone-else's pod holds one
    assert nodes["gpu-1"].pods is None  # no allocatable pods: no limit


def test_a_replica_is_made_adopted_read_back_and_stopped(cluster: tuple[ApiServerDouble, Path]) -> None:
    double, kubeconfig = cluster
    d = driver(kubeconfig)
    assert d.start(NB).state is ReplicaState.STARTING
    name = object_name(NB.id)
    assert double.names(f"api/v1/{'secrets'}") == [name]
    assert double.names(CLAIMS) == [home_claim_name(NB.workload_id)]
    assert double.names(PODS)[-1] == name and double.names("api/v1/services") == [name]
    pod = double.objects[(PODS, NS, name)]
    assert pod["metadata"]["labels"]["tensora.io/owner"] == "alice-example.com"
    assert "nvidia.com/gpu" not in str(pod["spec"]["containers"][0]["resources"])
    assert pod["spec"]["runtimeClassName"] == KATA  # no admin trusted alice
    trusted = dataclasses.replace(NB, id="rp_nb9", trusted=True)
    d.start(trusted)
    assert "runtimeClassName" not in double.objects[(PODS, NS, object_name(trusted.id))]["spec"]
    d.stop(trusted.id)

    assert [(s.id, s.state) for s in d.observe()] == [(NB.id, ReplicaState.STARTING)]
    double.set_status(PODS, NS, name, {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]})
    [seen] = d.observe()
    assert seen.state is ReplicaState.RUNNING and seen.node == "cpu-1" and seen.url and name in seen.url

    d.start(NB)  # again (a redone cycle): the objects exist, adopted, not doubled
    assert double.names(PODS).count(name) == 1
    restarted = driver(kubeconfig)  # a new controller finds what the old one made
    assert [(s.id, s.workload_id, s.cls, s.state) for s in restarted.observe()] == [
        (NB.id, "wl_nb", "cpu-4c-16g", ReplicaState.RUNNING)]

    assert restarted.stop(NB.id).state is ReplicaState.STOPPING
    assert restarted.observe() == [] and name not in double.names(PODS)
    assert double.names("api/v1/secrets") == [] and double.names("api/v1/services") == []
    assert double.names(CLAIMS) == [home_claim_name(NB.workload_id)]  # the home is the workload's: kept
    assert restarted.stop(NB.id).state is ReplicaState.STOPPED  # nothing left: done


def test_a_restarted_notebook_keeps_its_home_until_the_workload_is_released(
        cluster: tuple[ApiServerDouble, Path]) -> None:
    double, kubeconfig = cluster
    d = driver(kubeconfig)
    home = home_claim_name(NB.workload_id)
    d.start(NB)
    double.objects[(CLAIMS, NS, home)]["status"] = {"phase": "Bound"}  # what the storage made of it
    d.stop(NB.id)
    on_gpu = dataclasses.replace(NB, id="rp_nb2", cls="l40s-48gb", node="gpu-1")  # "Restart on GPU"
    d.start(on_gpu)
    pod = double.objects[(PODS, NS, object_name(on_gpu.id))]
    assert pod["spec"]["volumes"][0]["persistentVolumeClaim"]["claimName"] == home  # the same files
    assert double.names(CLAIMS) == [home] and double.objects[(CLAIMS, NS, home)]["status"] == {"phase": "Bound"}
    d.stop(on_gpu.id)

    someone = {"metadata": {"name": home_claim_name("wl_theirs"), "namespace": NS, "labels": {"app": "theirs"}},
               "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "1Gi"}}}}
    double.seed(CLAIMS, copy.deepcopy(someone))
    d.release(NB.workload_id)
    d.release(NB.workload_id)  # again (a redone cycle): nothing there, done
    d.release("wl_theirs")  # a claim of that name that Tensora did not make stays
    assert double.names(CLAIMS) == [someone["metadata"]["name"]]


def test_the_home_claim_takes_the_configured_storage_class_and_size(cluster: tuple[ApiServerDouble, Path]) -> None:
    double, kubeconfig = cluster
    driver(kubeconfig, storage_class="ceph-rbd", home_size="50Gi").start(NB)
    claim = double.objects[(CLAIMS, NS, home_claim_name(NB.workload_id))]["spec"]
    assert claim["storageClassName"] == "ceph-rbd" and claim["resources"]["requests"]["storage"] == "50Gi"


def test_an_endpoint_is_an_inference_service_on_the_gpu_runtime(cluster: tuple[ApiServerDouble, Path]) -> None:
    double, kubeconfig = cluster
    d = driver(kubeconfig)
    d.start(EP)
    name = object_name(EP.id)
    isvc = double.objects[(ISVC, NS, name)]
    assert isvc["spec"]["predictor"]["model"]["runtime"] == "tensora-vllm"
    assert isvc["spec"]["predictor"]["model"]["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert isvc["spec"]["predictor"]["model"]["storageUri"] == f"pvc://{CLAIM}/{owner_dir(Path(), 'bob').name}/m"
    assert isvc["spec"]["predictor"]["runtimeClassName"] == KATA
    double.set_status(ISVC, NS, name, {"url": f"http://{name}.{NS}.example", "conditions": [
        {"type": "Ready", "status": "True"}]})
    [seen] = d.observe()
    assert (seen.state, seen.url, seen.node) == (ReplicaState.RUNNING, f"http://{name}.{NS}.example/v1", "gpu-1")
    # the runtimes serve the model as the InferenceService's name: what the gateway must send upstream
    assert seen.served_model == name
    double.set_status(ISVC, NS, name, {"conditions": [{"type": "Ready", "status": "False", "reason": "Failed",
                                                       "message": "model download failed"}]})
    [seen] = d.observe()
    assert seen.state is ReplicaState.FAILED and "download" in seen.detail


def test_a_transient_api_error_is_raised_and_the_redo_completes(cluster: tuple[ApiServerDouble, Path]) -> None:
    from lightkube import ApiError

    double, kubeconfig = cluster
    d = driver(kubeconfig)
    double.fail_next("POST", "/pods", 500)
    with pytest.raises(ApiError):
        d.start(NB)  # the Secret and PVC were made; the Pod was not
    d.start(NB)  # the controller's next cycle
    name = object_name(NB.id)
    assert double.names("api/v1/secrets") == [name] and name in double.names(PODS)


def test_the_controller_places_through_it(cluster: tuple[ApiServerDouble, Path], tmp_path: Path) -> None:
    from tensora.config.settings import ServeSettings
    from tensora.control import workloads
    from tensora.control.spec import parse_spec
    from tensora.serve import build

    double, kubeconfig = cluster
    settings = ServeSettings(data_dir=tmp_path / "data", driver="kubernetes", kubeconfig=kubeconfig, region="eu-west",
                             namespace=NS)
    svc = build(settings)
    assert svc.controller is not None
    try:
        with svc.db.write() as conn:
            from tensora.store import owners as owners_repo
            from tensora.store import workloads as workloads_repo

            owners_repo.set_owner(conn, "tom", True, svc.clock.now())  # as PUT /v1/owners/tom {"trusted": true} does
            w = workloads.create(conn, workloads.validate(parse_spec(
                {"kind": "notebook", "name": "nb", "region": "eu-west", "gpu_class": "l40s-48gb"}), svc.catalog,
                "alice", svc.storage), svc.clock.now())
            toms = workloads.create(conn, workloads.validate(parse_spec(
                {"kind": "notebook", "name": "nb", "region": "eu-west", "gpu_class": "cpu-2c-8g"}), svc.catalog,
                "tom", svc.storage), svc.clock.now())
        svc.controller.run_once()
        pods = {p["metadata"]["labels"]["tensora.io/workload"]: p for (c, _, n), p in double.objects.items()
                if c == PODS and n.startswith("tensora-")}
        assert set(pods) == {w.id, toms.id}
        pod, pod_name = pods[w.id], pods[w.id]["metadata"]["name"]
        assert pod["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "1"
        assert pod["spec"]["runtimeClassName"] == KATA  # alice: no admin trusted her, so she is not
        assert "runtimeClassName" not in pods[toms.id]["spec"]  # an admin trusted tom
        double.set_status(PODS, NS, pod_name, {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]})
        svc.controller.run_once()
        with svc.db.read() as conn:
            got = workloads_repo.get_workload(conn, w.id)
        assert got is not None and got.state == "running" and got.placed_class == "l40s-48gb"
    finally:
        svc.controller.driver.close()  # type: ignore[attr-defined]
        svc.db.dispose()


def test_the_double_admits_pods_as_a_restricted_namespace_does(cluster: tuple[ApiServerDouble, Path]) -> None:
    """Every driver test's pods pass the double's Pod Security check; here is one that does not."""
    double, _ = cluster
    root = {"metadata": {"name": "root-pod"},
            "spec": {"containers": [{"name": "c", "image": "busybox", "securityContext": {"privileged": True}}]}}
    code, body = double._answer("POST", f"/api/v1/namespaces/{NS}/pods", {}, orjson.dumps(root))
    assert code == 403 and body["reason"] == "Forbidden"
    assert 'violates PodSecurity "restricted:latest"' in body["message"] and "Privileged Containers" in body["message"]
    assert (PODS, NS, "root-pod") not in double.objects
    code, _ = double._answer("POST", "/api/v1/namespaces/ml/pods", {}, orjson.dumps(root))
    assert code == 201  # a namespace without the label admits it


def test_the_double_enforces_what_the_api_server_does_on_a_replace(cluster: tuple[ApiServerDouble, Path]) -> None:
    double, _ = cluster
    path = "/api/v1/namespaces/ml/pods/someone-else"
    current = double.objects[(PODS, "ml", "someone-else")]
    rv = current["metadata"]["resourceVersion"]

    def put(obj: dict[str, Any]) -> tuple[int, Any]:
        return double._answer("PUT", path, {}, orjson.dumps(obj))

    relabelled = {**current, "metadata": {**current["metadata"], "labels": {"team": "ml"}}}
    no_rv = {**relabelled, "metadata": {k: v for k, v in relabelled["metadata"].items() if k != "resourceVersion"}}
    assert put(no_rv)[0] == 422  # stricter than the API server: a replace must say what it read
    assert put({**relabelled, "metadata": {**relabelled["metadata"], "name": "other"}})[0] == 400
    respec = {**relabelled, "spec": {**current["spec"], "nodeName": "gpu-1"}}
    code, body = put(respec)
    assert code == 422 and "Forbidden" in body["message"]  # a pod's spec cannot be replaced
    code, body = put({**relabelled, "status": {"phase": "Failed"}})
    assert code == 200 and body["metadata"]["labels"] == {"team": "ml"}
    assert body["status"] == {"phase": "Running"} and body["metadata"]["resourceVersion"] != rv  # status kept
    code, body = put(relabelled)  # what was read before that write: stale now
    assert code == 409 and body["reason"] == "Conflict" and "has been modified" in body["message"]
    assert double.conflicts == 1
    code, body = double._answer("PATCH", path, {}, b"{}")
    assert code == 405 and body["reason"] == "MethodNotAllowed"
    code, body = double._answer("GET", "/api/v1/nodes/nowhere", {}, b"")
    assert code == 404 and body["reason"] == "NotFound"


def _edited(double: ApiServerDouble, name: str) -> None:
    """Someone edits the endpoint's InferenceService by hand: another runtime, a label of theirs."""
    isvc = copy.deepcopy(double.objects[(ISVC, NS, name)])
    isvc["spec"]["predictor"]["model"]["runtime"] = "somebody-elses-runtime"
    isvc["metadata"]["labels"]["team"] = "ml"
    double.seed(ISVC, isvc)


def test_a_start_again_brings_a_drifted_object_back_keeping_what_others_added(
        cluster: tuple[ApiServerDouble, Path]) -> None:
    double, kubeconfig = cluster
    d = driver(kubeconfig)
    d.start(EP)
    name = object_name(EP.id)
    double.set_status(ISVC, NS, name, {"url": "http://x.example", "conditions": [{"type": "Ready", "status": "True"}]})
    puts = [c for c in double.calls if c[0] == "PUT"]
    d.start(EP)  # as rendered already: adopted as it is, nothing written
    assert [c for c in double.calls if c[0] == "PUT"] == puts == []

    _edited(double, name)
    d.start(EP)
    isvc = double.objects[(ISVC, NS, name)]
    assert isvc["spec"]["predictor"]["model"]["runtime"] == "tensora-vllm"  # Tensora's part, as rendered
    assert isvc["metadata"]["labels"]["team"] == "ml"  # theirs, kept
    assert isvc["status"]["url"] == "http://x.example"  # a replace never writes status
    assert [c for c in double.calls if c[0] == "PUT"] == [("PUT", f"/apis/serving.kserve.io/v1beta1/namespaces/{NS}"
                                                                 f"/inferenceservices/{name}")]


def test_a_replace_that_conflicts_reads_again_and_keeps_the_other_writer_s_change(
        cluster: tuple[ApiServerDouble, Path]) -> None:
    double, kubeconfig = cluster
    d = driver(kubeconfig)
    d.start(EP)
    name = object_name(EP.id)
    _edited(double, name)
    double.race_next(ISVC, NS, name, {"autoscaler": "touched"})  # another writer, between our read and write
    d.start(EP)
    assert double.conflicts == 1
    isvc = double.objects[(ISVC, NS, name)]
    assert isvc["spec"]["predictor"]["model"]["runtime"] == "tensora-vllm"
    assert isvc["metadata"]["annotations"]["autoscaler"] == "touched"  # not overwritten by a blind write

    _edited(double, name)
    double.race_next(ISVC, NS, name, {"autoscaler": "again"}, times=5)  # it never settles: give up, bounded
    with pytest.raises(RuntimeError, match="conflicting"):
        d.start(EP)
    assert double.conflicts == 6
    d.start(EP)  # the controller's next cycle
    assert double.objects[(ISVC, NS, name)]["spec"]["predictor"]["model"]["runtime"] == "tensora-vllm"


def test_an_object_of_that_name_that_is_not_tensora_s_is_left_alone_and_the_replica_fails(
        cluster: tuple[ApiServerDouble, Path]) -> None:
    double, kubeconfig = cluster
    name = object_name(NB.id)
    theirs = {"metadata": {"name": name, "namespace": NS, "labels": {"app": "theirs"}},
              "spec": {"selector": {"app": "theirs"}, "ports": [{"name": "http", "port": 80}]}}
    double.seed("api/v1/services", copy.deepcopy(theirs))
    d = driver(kubeconfig)
    status = d.start(NB)
    assert status.state is ReplicaState.FAILED and "left alone" in status.detail and name in status.detail
    kept = double.objects[("api/v1/services", NS, name)]
    assert kept["spec"] == theirs["spec"] and kept["metadata"]["labels"] == {"app": "theirs"}
    assert name not in double.names(PODS)  # nothing started
    assert double.names("api/v1/secrets") == []  # cleaned (the home claim is the workload's: released with it)
    assert [(s.id, s.state) for s in d.observe()] == [(NB.id, ReplicaState.FAILED)]  # reported to the controller
    assert d.observe() == []  # once
    assert d.stop(NB.id).state is ReplicaState.STOPPED  # and a stop never deletes their Service
    assert ("api/v1/services", NS, name) in double.objects


def test_a_running_notebook_s_url_carries_its_token(cluster: tuple[ApiServerDouble, Path]) -> None:
    import base64

    double, kubeconfig = cluster
    d = driver(kubeconfig)
    d.start(NB)
    name = object_name(NB.id)
    token = base64.b64decode(double.objects[("api/v1/secrets", NS, name)]["data"]["token"]).decode()
    double.set_status(PODS, NS, name, {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]})
    d.start(NB)  # a redo renders a fresh token, but the Secret's data is never replaced: the URL stays valid
    [seen] = d.observe()
    assert seen.url == f"http://{name}.{NS}.svc:8888/lab?token={token}"


def test_with_a_notebook_domain_the_url_is_the_ingress_s_and_stop_removes_it(
        cluster: tuple[ApiServerDouble, Path]) -> None:
    double, kubeconfig = cluster
    d = driver(kubeconfig, notebook_domain="nb.example.org")
    d.start(NB)
    name = object_name(NB.id)
    ingresses = "apis/networking.k8s.io/v1/ingresses"
    assert double.names(ingresses) == [name]
    assert double.objects[(ingresses, NS, name)]["spec"]["rules"][0]["host"] == f"{name}.nb.example.org"
    double.set_status(PODS, NS, name, {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]})
    [seen] = d.observe()
    assert seen.url is not None and seen.url.startswith(f"https://{name}.nb.example.org/lab?token=")
    d.stop(NB.id)
    assert double.names(ingresses) == [] and name not in double.names(PODS)


def test_an_endpoint_on_cpu_moves_back_to_its_gpu_on_kubernetes(cluster: tuple[ApiServerDouble, Path],
                                                                  tmp_path: Path) -> None:
    """The L40S GPUs are taken by someone else's pod: the endpoint starts on CPU (tensora-vllm-cpu).
    That pod goes: a tensora-vllm InferenceService starts beside it; once Ready it takes the traffic
    and the CPU one is deleted. The endpoint stays running throughout."""
    from tensora.config.settings import ServeSettings
    from tensora.control import workloads
    from tensora.control.spec import parse_spec
    from tensora.models.tinymodel import write_tiny_model
    from tensora.serve import build
    from tensora.store import events as events_repo
    from tensora.store import workloads as workloads_repo

    double, kubeconfig = cluster
    double.seed(PODS, {"metadata": {"name": "gpu-hog", "namespace": "ml"},
                       "spec": {"nodeName": "gpu-1", "containers": [
                           {"name": "c", "resources": {"requests": {"nvidia.com/gpu": "2"}}}]},
                       "status": {"phase": "Running"}})
    pool = tmp_path / "data" / "files" / "shared" / "pool"  # an operator's shared root, on the files claim
    settings = ServeSettings(data_dir=tmp_path / "data", driver="kubernetes", kubeconfig=kubeconfig, region="eu-west",
                             namespace=NS, drain_s=0, shared_models={"pool": pool}, files_claim=CLAIM)
    write_tiny_model(pool / "tiny")  # an operator's shared model: model names never host paths
    svc = build(settings)
    assert svc.controller is not None

    def ready_all() -> None:
        for name in double.names(ISVC):
            double.set_status(ISVC, NS, name, {"url": f"http://{name}.example", "conditions": [
                {"type": "Ready", "status": "True"}]})

    def runtimes() -> list[str]:
        models = {double.objects[(ISVC, NS, n)]["spec"]["predictor"]["model"]["storageUri"]
                  for n in double.names(ISVC)}
        assert models == {f"pvc://{CLAIM}/shared/pool/tiny"}  # the claim's path, never the API's
        return sorted(double.objects[(ISVC, NS, n)]["spec"]["predictor"]["model"]["runtime"]
                      for n in double.names(ISVC))

    def state() -> WorkloadRecord:
        with svc.db.read() as conn:
            w = workloads_repo.get_workload(conn, ep.id)
        assert w is not None
        return w

    try:
        with svc.db.write() as conn:
            ep = workloads.create(conn, workloads.validate(parse_spec(
                {"kind": "endpoint", "name": "chat", "region": "eu-west", "gpu_class": "l40s-48gb",
                 "fallback": ["cpu"], "fallback_after": 0, "model": "shared/pool/tiny"}), svc.catalog,
                "alice", svc.storage), svc.clock.now())
        svc.controller.run_once()
        assert runtimes() == ["tensora-vllm-cpu"]
        ready_all()
        svc.controller.run_once()
        assert state().state == "running" and state().placed_class.startswith("cpu-")

        del double.objects[(PODS, "ml", "gpu-hog")]  # the GPUs free up
        seen_states = []
        for _ in range(8):
            svc.controller.run_once()
            ready_all()
            seen_states.append(state().state)
            if runtimes() == ["tensora-vllm"] and state().placed_class == "l40s-48gb":
                break
        assert runtimes() == ["tensora-vllm"], runtimes()
        assert state().placed_class == "l40s-48gb" and set(seen_states) == {"running"}
        with svc.db.read() as conn:
            reasons = [e.reason for e in events_repo.list_events(conn, ep.id)]
        assert any("l40s-48gb" in r and ("move" in r or "promot" in r) for r in reasons), reasons
    finally:
        svc.controller.driver.close()  # type: ignore[attr-defined]
        svc.db.dispose()


def rewatched(double: ApiServerDouble, since: int) -> None:
    """Until every path watched so far has a stream again, opened after the double's ``since``-th watch and not
    answered 410 Gone (each stream ends within a second; one from a too old resourceVersion comes back first)."""
    deadline = time.monotonic() + 15
    while True:
        paths = {path for path, _ in double.watches}
        if paths and paths <= {path for path, gone in double.watches[since:] if not gone}:
            return
        assert time.monotonic() < deadline, double.watches
        time.sleep(0.02)


def test_a_watch_wakes_the_controller_when_a_replica_changes_and_survives_410(
        cluster: tuple[ApiServerDouble, Path]) -> None:
    import threading

    double, kubeconfig = cluster
    d = driver(kubeconfig)
    woken = threading.Event()
    d.watch(woken.set)
    d.start(NB)
    assert woken.wait(10), "no wake-up on the new pod"
    name = object_name(NB.id)
    rewatched(double, len(double.watches))  # each watch stream ended and re-watched from its resourceVersion
    compacted = len(double.watches)
    double.compact()  # etcd compaction: those resourceVersions are now too old (410 Gone)
    rewatched(double, compacted)
    woken.clear()
    double.set_status(PODS, NS, name, {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]})
    assert woken.wait(10), "no wake-up after the 410"
    assert double.gone >= 1  # a watch did come back with a too-old resourceVersion, and recovered
    watches = [p for m, p in double.calls if m == "GET" and p.endswith("/pods")]
    assert len(watches) >= 3  # re-watched after each stream ended, and after the 410
    [seen] = d.observe()
    assert seen.state is ReplicaState.RUNNING  # the state itself always comes from a list


@pytest.mark.slow
def test_tensora_serve_starts_against_a_kubeconfig(cluster: tuple[ApiServerDouble, Path], tmp_path: Path) -> None:
    """The real entry point: ``tensora serve --driver kubernetes`` leads its region, reads the
    cluster's nodes, and a notebook created over HTTP becomes a Pod in the namespace."""
    import httpx

    from tests.support.serve import served

    double, kubeconfig = cluster
    env = {"TENSORA_KUBECONFIG": str(kubeconfig), "TENSORA_NAMESPACE": NS, "TENSORA_REGION": "eu-west"}
    with served(tmp_path, tmp_path / "data", "--driver", "kubernetes", env=env) as proc:
        key = (tmp_path / "data" / "admin-key").read_text().strip()
        with httpx.Client(base_url=proc.url, headers={"Authorization": f"Bearer {key}"}, timeout=10) as c:
            cat = c.get("/v1/catalog").json()
            by = {x["name"]: x["capacity"]["eu-west"] for x in cat["data"]}
            assert by["l40s-48gb"] == {"free": 2, "total": 2}  # gpu-1's two L40S, from the double
            w = c.post("/v1/workloads", json={"kind": "notebook", "name": "nb", "gpu_class": "cpu-2c-8g"}).json()
            deadline = time.monotonic() + 30
            while not [n for n in double.names(PODS) if n.startswith("tensora-")]:
                assert time.monotonic() < deadline, proc.output()
                time.sleep(0.2)
            [name] = [n for n in double.names(PODS) if n.startswith("tensora-")]
            assert double.objects[(PODS, NS, name)]["metadata"]["labels"]["tensora.io/workload"] == w["id"]
            double.set_status(PODS, NS, name, {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]})
            deadline = time.monotonic() + 30
            while c.get(f"/v1/workloads/{w['id']}").json()["state"] != "running":
                assert time.monotonic() < deadline, proc.output()
                time.sleep(0.2)
