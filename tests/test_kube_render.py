"""One replica's Kubernetes objects, rendered and validated offline: core kinds strictly with
kubernetes-validate, KServe's InferenceService and KubeVirt's VirtualMachine against their published
schemas from ``../shared/crds`` (skipped, saying why, where that folder is absent); then what the
ADR asks of them: GPUs only on GPU classes and hidden on CPU, the right serving runtime, the node
admission chose, labels to adopt by, kata for untrusted tenants."""

from __future__ import annotations

import copy
import dataclasses
import json
import re
from typing import Any

import pytest

from kube_schemas import validate
from tensora.admission import WorkloadKind
from tensora.catalog import default_catalog
from tensora.drivers.base import ReplicaSpec
from tensora.drivers.kubernetes.render import (
    CPU_RUNTIME,
    GPU_RUNTIME,
    Context,
    home_claim_name,
    label_value,
    replica_objects,
)

CATALOG = default_catalog()
CTX = Context(namespace="tensora-eu-west", owner="alice@example.com")
DNS1035 = re.compile(r"^[a-z]([-a-z0-9]{0,61}[a-z0-9])?$")


def spec(kind: WorkloadKind, cls: str, **kw: Any) -> ReplicaSpec:
    return ReplicaSpec(id="rp_Ab3dE9", workload_id="wl_Xy7Zq2", kind=kind, cls=cls, node="gpu-l40s-1", **kw)


RENDERED = {
    "notebook on a GPU class": (spec(WorkloadKind.NOTEBOOK, "l40s-48gb"), False),
    "notebook on a CPU class": (spec(WorkloadKind.NOTEBOOK, "cpu-16c-64g"), False),
    "notebook of an untrusted tenant": (spec(WorkloadKind.NOTEBOOK, "cpu-4c-16g"), True),
    "vm on a GPU class, with a disk": (spec(WorkloadKind.VM, "a100-80gb", image="quay.io/containerdisks/debian:12"),
                                       False),
    "vm on a CPU class": (spec(WorkloadKind.VM, "cpu-2c-8g"), False),
    "endpoint on a GPU class": (spec(WorkloadKind.ENDPOINT, "l40s-48gb", model="s3://models/llama-8b"), False),
    "endpoint on a CPU class, untrusted": (spec(WorkloadKind.ENDPOINT, "cpu-32c-128g", model="pvc://models/tiny"),
                                           True),
}


def containers(doc: dict[str, Any]) -> list[dict[str, Any]]:
    if doc["kind"] == "Pod":
        return list(doc["spec"]["containers"])
    if doc["kind"] == "InferenceService":
        return [doc["spec"]["predictor"]["model"]]
    return []


@pytest.mark.parametrize(("replica", "untrusted"), RENDERED.values(), ids=RENDERED.keys())
def test_rendered_objects_validate_and_say_what_the_placement_means(replica: ReplicaSpec, untrusted: bool) -> None:
    cls = CATALOG[replica.cls]
    ctx = Context(CTX.namespace, CTX.owner, untrusted=untrusted)
    docs = replica_objects(replica, cls, ctx)
    want = {WorkloadKind.NOTEBOOK: ["Secret", "PersistentVolumeClaim", "Pod", "Service"],
            WorkloadKind.VM: ["VirtualMachine"], WorkloadKind.ENDPOINT: ["InferenceService"]}[replica.kind]
    assert [d["kind"] for d in docs] == want
    for d in docs:
        validate(d)
        meta = d["metadata"]
        assert DNS1035.match(meta["name"]) and meta["namespace"] == ctx.namespace
        assert meta["labels"]["tensora.io/workload"] == replica.workload_id
        if d["kind"] == "PersistentVolumeClaim":  # the home: the workload's, whichever replica mounts it
            assert "tensora.io/replica" not in meta["labels"] and "tensora.io/class" not in meta["labels"]
        else:
            assert meta["labels"]["tensora.io/replica"] == "rp_Ab3dE9"
            assert meta["labels"]["tensora.io/class"] == cls.name
        assert meta["labels"]["tensora.io/owner"] == "alice-example.com"
        assert meta["annotations"]["tensora.io/owner"] == "alice@example.com"
    gpu = cls.gpu_count > 0
    for c in (c for d in docs for c in containers(d)):
        assert ("nvidia.com/gpu" in c["resources"]["limits"]) == gpu
        env = {e["name"]: e.get("value") for e in c.get("env", [])}
        assert (env.get("NVIDIA_VISIBLE_DEVICES") == "void") == (not gpu)  # CPU: every GPU hidden
    text = json.dumps(docs)
    assert '"values": ["gpu-l40s-1"]' in text  # pinned to the node admission chose
    pods = [d["spec"] for d in docs if d["kind"] == "Pod"] + [d["spec"]["predictor"] for d in docs
                                                               if d["kind"] == "InferenceService"]
    assert all((p.get("runtimeClassName") == "kata") == untrusted for p in pods)
    for d in docs:
        if d["kind"] == "InferenceService":
            assert d["spec"]["predictor"]["model"]["runtime"] == (GPU_RUNTIME if gpu else CPU_RUNTIME)
            assert d["spec"]["predictor"]["model"]["storageUri"] == replica.model
        if d["kind"] == "VirtualMachine":
            gpus = d["spec"]["template"]["spec"]["domain"]["devices"].get("gpus", [])
            assert [g["deviceName"] for g in gpus] == ([f"nvidia.com/{cls.gpu_model}"] if gpu else [])


def test_every_replica_of_a_notebook_mounts_the_workloads_one_home_claim() -> None:
    first = replica_objects(spec(WorkloadKind.NOTEBOOK, "cpu-2c-8g"), CATALOG["cpu-2c-8g"], CTX)
    again = dataclasses.replace(spec(WorkloadKind.NOTEBOOK, "l40s-48gb"), id="rp_Later1")  # restart on GPU
    second = replica_objects(again, CATALOG["l40s-48gb"], CTX)
    claims = [next(d for d in docs if d["kind"] == "PersistentVolumeClaim") for docs in (first, second)]
    mounts = [next(d for d in docs if d["kind"] == "Pod")["spec"]["volumes"][0]["persistentVolumeClaim"]["claimName"]
              for docs in (first, second)]
    assert claims[0] == claims[1]  # the same object, so the second start adopts it as it is
    assert mounts == [claims[0]["metadata"]["name"]] * 2 == [home_claim_name(again.workload_id)] * 2
    other = dataclasses.replace(again, workload_id="wl_Other")
    assert home_claim_name(other.workload_id) != claims[0]["metadata"]["name"]
    pods = [d["metadata"]["name"] for docs in (first, second) for d in docs if d["kind"] == "Pod"]
    assert pods[0] != pods[1]  # while the rest is each replica's own


def test_with_a_notebook_domain_a_notebook_gets_an_ingress_to_its_service() -> None:
    from tensora.drivers.kubernetes.render import notebook_url

    ctx = Context(CTX.namespace, CTX.owner, notebook_domain="nb.example.org", ingress_class="nginx")
    docs = replica_objects(spec(WorkloadKind.NOTEBOOK, "l40s-48gb"), CATALOG["l40s-48gb"], ctx)
    assert [d["kind"] for d in docs] == ["Secret", "PersistentVolumeClaim", "Pod", "Service", "Ingress"]
    ingress, service = docs[4], docs[3]
    validate(ingress)
    name = service["metadata"]["name"]
    [rule] = ingress["spec"]["rules"]
    assert rule["host"] == f"{name}.nb.example.org" and ingress["spec"]["tls"] == [{"hosts": [rule["host"]]}]
    assert rule["http"]["paths"][0]["backend"]["service"] == {"name": name, "port": {"name": "http"}}
    assert ingress["spec"]["ingressClassName"] == "nginx"
    assert notebook_url(name, ctx) == f"https://{name}.nb.example.org/lab"
    assert notebook_url(name, CTX) == f"http://{name}.tensora-eu-west.svc:8888/lab"  # no domain: in the cluster
    vm = replica_objects(spec(WorkloadKind.VM, "cpu-2c-8g"), CATALOG["cpu-2c-8g"], ctx)
    assert [d["kind"] for d in vm] == ["VirtualMachine"]  # notebooks only


def test_a_misspelt_field_fails_validation() -> None:
    import jsonschema

    [isvc] = replica_objects(spec(WorkloadKind.ENDPOINT, "l40s-48gb", model="s3://m"), CATALOG["l40s-48gb"], CTX)
    bad = copy.deepcopy(isvc)
    bad["spec"]["predictor"]["model"]["storageURI"] = bad["spec"]["predictor"]["model"].pop("storageUri")
    with pytest.raises(jsonschema.ValidationError):
        validate(bad)


def test_an_endpoint_without_a_model_is_refused() -> None:
    with pytest.raises(ValueError, match="storage URI"):
        replica_objects(spec(WorkloadKind.ENDPOINT, "l40s-48gb"), CATALOG["l40s-48gb"], CTX)


LABELS = {"plain": ("alice", "alice"), "an email": ("a@b.c", "a-b.c"), "too long": ("x" * 80, "x" * 63),
          "nothing valid": ("@@@", "x")}


@pytest.mark.parametrize(("text", "want"), LABELS.values(), ids=LABELS.keys())
def test_label_value(text: str, want: str) -> None:
    assert label_value(text) == want


# -- reconciling an object that exists with what is rendered --------------------------------------

NB_DOCS = {d["kind"]: d for d in replica_objects(spec(WorkloadKind.NOTEBOOK, "cpu-4c-16g"), CATALOG["cpu-4c-16g"], CTX)}
EP_DOC = replica_objects(spec(WorkloadKind.ENDPOINT, "l40s-48gb", model="s3://m"), CATALOG["l40s-48gb"], CTX)[0]


def stored(doc: dict[str, Any], **edits: Any) -> dict[str, Any]:
    """``doc`` as the API server returns it: a resourceVersion, a status, fields it fills in; then ``edits``
    (a function of the copy, applied in place)."""
    out = copy.deepcopy(doc)
    out["metadata"]["resourceVersion"], out["status"] = "41", {"phase": "Running"}
    if out["kind"] == "Service":
        out["spec"]["clusterIP"] = "10.0.0.7"
        out["spec"]["ports"][0]["protocol"] = "TCP"
    if out["kind"] == "Secret":
        out["data"] = {"token": "b2xk"}
        out.pop("stringData")
    for edit in edits.values():
        edit(out)
    return out


def _set(path: str, value: Any) -> Any:
    def edit(d: dict[str, Any]) -> None:
        *parents, last = path.split("/")
        for p in parents:
            d = d[p]
        d[last] = value
    return edit


RECONCILED: dict[str, tuple[dict[str, Any], dict[str, Any], dict[str, Any] | None]] = {
    # name: (desired, stored, what the update must contain, or None for "nothing to write")
    "as rendered": (EP_DOC, stored(EP_DOC), None),
    "someone else's label only": (EP_DOC, stored(EP_DOC, e=_set("metadata/labels/team", "ml")), None),
    "server-filled service fields": (NB_DOCS["Service"], stored(NB_DOCS["Service"]), None),
    "pod spec differs (immutable: never replaced)": (
        NB_DOCS["Pod"], stored(NB_DOCS["Pod"], e=_set("spec/schedulerName", "default-scheduler")), None),
    "secret's token differs (never rewritten)": (NB_DOCS["Secret"], stored(NB_DOCS["Secret"]), None),
    "inference service edited by hand": (
        EP_DOC, stored(EP_DOC, e=_set("spec/predictor/model/runtime", "theirs"), f=_set("metadata/labels/team", "ml")),
        {"runtime": GPU_RUNTIME, "team": "ml"}),
    "tensora's class label removed": (
        NB_DOCS["Pod"], stored(NB_DOCS["Pod"], e=lambda d: d["metadata"]["labels"].pop("tensora.io/class")),
        {"class": "cpu-4c-16g"}),
    "service selector changed": (
        NB_DOCS["Service"], stored(NB_DOCS["Service"], e=_set("spec/selector", {"app": "x"})),
        {"selector": {"tensora.io/replica": "rp_Ab3dE9"}, "clusterIP": "10.0.0.7"}),
}


@pytest.mark.parametrize(("desired", "current", "expect"), RECONCILED.values(), ids=RECONCILED.keys())
def test_reconciled_writes_only_what_tensora_manages(desired: dict[str, Any], current: dict[str, Any],
                                                     expect: dict[str, Any] | None) -> None:
    from tensora.drivers.kubernetes.render import reconciled

    before = copy.deepcopy(current)
    update = reconciled(current, desired)
    assert current == before  # pure
    if expect is None:
        assert update is None
        return
    assert update is not None
    assert update["metadata"]["resourceVersion"] == "41" and "status" not in update  # a conditional replace
    labels, spec_ = update["metadata"]["labels"], update["spec"]
    for key, value in expect.items():
        got = {"runtime": lambda: spec_["predictor"]["model"]["runtime"], "team": lambda: labels["team"],
               "class": lambda: labels["tensora.io/class"], "selector": lambda: spec_["selector"],
               "clusterIP": lambda: spec_["clusterIP"]}[key]()
        assert got == value, key
    assert reconciled(update, desired) is None  # once written, nothing more to do
    validate(update)


@pytest.mark.parametrize("labels", [{"app": "theirs"}, {"app.kubernetes.io/managed-by": "tensora",
                                                        "tensora.io/replica": "rp_other"}],
                         ids=["not tensora's", "another replica's"])
def test_an_object_that_is_not_this_replica_s_is_refused(labels: dict[str, str]) -> None:
    from tensora.drivers.kubernetes.render import NotOurs, reconciled

    current = stored(EP_DOC)
    current["metadata"]["labels"] = labels
    with pytest.raises(NotOurs, match="left alone"):
        reconciled(current, EP_DOC)
