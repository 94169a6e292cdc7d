"""The Kubernetes deployment as operators build it: ``kubectl kustomize`` of each region overlay and
of the serving runtimes, every document validated offline, strictly (no API server can run here):
core kinds with kubernetes-validate, KServe's ClusterServingRuntime against its published CRD schema
from ``../shared/crds`` (skipped, saying why, where that folder is absent). Then the properties an
operator relies on: the region everywhere, one namespace, least-privilege service accounts,
requests and probes on every container, and the controller allowed exactly what its driver does to
replicas' objects, in the region's workloads namespace where it makes them. And what holds tenants in:
both namespaces enforce Pod Security "restricted" (and every pod of the manifests meets it), the
workloads namespace denies all egress but DNS and the internet beyond the private and link-local
ranges, and takes ingress only from the gateway, Knative and the ingress controller, each to its kind;
owners' files are one share, read-write in the API's pods, read-only in the workloads namespace."""

from __future__ import annotations

import copy
import shutil
import subprocess
from pathlib import Path, PurePosixPath
from typing import Any

import pytest
import yaml

from tests.support.kube_double import violations
from tests.support.kube_schemas import validate

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy" / "kubernetes"
REGIONS = ["eu-west", "us-east"]
CLUSTER_SCOPED = {"Namespace", "ClusterRole", "ClusterRoleBinding", "ClusterServingRuntime"}


def build(path: Path) -> list[dict[str, Any]]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed: the overlays are built with its built-in kustomize")
    out = subprocess.run([kubectl, "kustomize", str(path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


@pytest.mark.parametrize("region", REGIONS)
def test_a_region_overlay_builds_and_every_document_validates(region: str) -> None:
    docs = build(DEPLOY / "overlays" / region)
    kinds = sorted({d["kind"] for d in docs})
    assert kinds == ["ClusterRole", "ClusterRoleBinding", "Deployment", "Namespace", "NetworkPolicy",
                     "PersistentVolumeClaim", "Role", "RoleBinding", "Service", "ServiceAccount"]
    for d in docs:
        validate(d)
    namespace, workloads = f"tensora-{region}", f"tensora-{region}-workloads"
    assert sorted(d["metadata"]["name"] for d in docs if d["kind"] == "Namespace") == [namespace, workloads]
    namespaced = [d for d in docs if d["kind"] not in CLUSTER_SCOPED]
    assert {d["metadata"]["namespace"] for d in namespaced} == {namespace, workloads}
    beside_replicas = sorted((d["kind"], d["metadata"]["name"]) for d in namespaced
                             if d["metadata"]["namespace"] == workloads)
    assert beside_replicas == [
        ("NetworkPolicy", "default-deny-egress"), ("NetworkPolicy", "default-deny-ingress"),
        ("NetworkPolicy", "endpoints-from-gateway"), ("NetworkPolicy", "notebooks-from-ingress"),
        ("NetworkPolicy", "replicas-to-dns"), ("NetworkPolicy", "replicas-to-internet"),
        ("PersistentVolumeClaim", "tensora-files"), ("Role", "tensora-controller"),
        ("RoleBinding", "tensora-controller")]
    for b in (d for d in docs if d["kind"] in ("RoleBinding", "ClusterRoleBinding")):
        assert all(s.get("namespace", namespace) == namespace for s in b["subjects"]), b
    deployments = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Deployment"}
    assert set(deployments) == {"tensora-api", "tensora-controller", "tensora-gateway"}
    assert deployments["tensora-gateway"]["spec"]["replicas"] == 3
    for name, d in deployments.items():
        pod = d["spec"]["template"]["spec"]
        for c in pod["containers"]:
            env = {e["name"]: e for e in c["env"]}
            assert env["TENSORA_REGION"]["value"] == region, name
            assert c["resources"]["requests"]["cpu"] and c["resources"]["requests"]["memory"], name
            assert c["readinessProbe"] and c["livenessProbe"], name
            assert c["securityContext"]["allowPrivilegeEscalation"] is False, name
            assert ":" in c["image"], name
            assert not any("value" in e and "key" in e["name"].lower() for e in c["env"]), "secrets come from Secrets"
        # only the controller talks to the Kubernetes API
        assert pod.get("automountServiceAccountToken", True) == (name == "tensora-controller"), name
        assert violations(pod) == [], name  # Tensora's own namespace enforces "restricted" too
    role = next(d for d in docs if d["kind"] == "ClusterRole")
    assert {v for r in role["rules"] for v in r["verbs"]} == {"get", "list", "watch"}  # nodes and pods: read only
    controller = deployments["tensora-controller"]["spec"]["template"]["spec"]["containers"][0]
    assert {e["name"]: e.get("value") for e in controller["env"]}["TENSORA_NAMESPACE"] == workloads
    gateway_from = next(d for d in docs if d["metadata"]["name"] == "endpoints-from-gateway")["spec"]["ingress"][0]
    assert gateway_from["from"][0]["namespaceSelector"]["matchLabels"] == {"kubernetes.io/metadata.name": namespace}


RESTRICTED_NS = {"pod-security.kubernetes.io/enforce": "restricted", "pod-security.kubernetes.io/enforce-version":
                 "latest", "pod-security.kubernetes.io/warn": "restricted", "pod-security.kubernetes.io/audit":
                 "restricted"}
PRIVATE_AND_LINK_LOCAL = ["10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "100.64.0.0/10", "169.254.0.0/16"]


def _policies(docs: list[dict[str, Any]], namespace: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d["spec"] for d in docs
            if d["kind"] == "NetworkPolicy" and d["metadata"]["namespace"] == namespace}


@pytest.mark.parametrize("region", REGIONS)
def test_both_namespaces_enforce_pod_security_restricted(region: str) -> None:
    docs = build(DEPLOY / "overlays" / region)
    labels = {d["metadata"]["name"]: d["metadata"]["labels"] for d in docs if d["kind"] == "Namespace"}
    for name in (f"tensora-{region}", f"tensora-{region}-workloads"):
        assert RESTRICTED_NS.items() <= labels[name].items(), name


@pytest.mark.parametrize("region", REGIONS)
def test_replicas_egress_only_to_dns_and_the_internet_beyond_private_and_link_local_ranges(region: str) -> None:
    """Every replica's egress is denied but for what is allowed here (policies add up: a pod may send what any
    policy selecting it allows): kube-dns on port 53, and 0.0.0.0/0 except the cluster's and cloud metadata
    ranges, on any port. Nothing else in the namespace allows egress."""
    workloads = f"tensora-{region}-workloads"
    policies = _policies(build(DEPLOY / "overlays" / region), workloads)
    assert policies["default-deny-egress"] == {"podSelector": {}, "policyTypes": ["Egress"]}
    assert policies["default-deny-ingress"] == {"podSelector": {}, "policyTypes": ["Ingress"]}
    egress = {name: p for name, p in policies.items() if "Egress" in p["policyTypes"] and p.get("egress")}
    assert set(egress) == {"replicas-to-dns", "replicas-to-internet"}
    [dns] = egress["replicas-to-dns"]["egress"]
    assert dns["to"] == [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "kube-system"}},
                          "podSelector": {"matchLabels": {"k8s-app": "kube-dns"}}}]
    assert sorted((p["port"], p["protocol"]) for p in dns["ports"]) == [(53, "TCP"), (53, "UDP")]
    [internet] = egress["replicas-to-internet"]["egress"]
    assert internet == {"to": [{"ipBlock": {"cidr": "0.0.0.0/0", "except": PRIVATE_AND_LINK_LOCAL}}]}
    assert all(p["podSelector"] == {} for p in egress.values())  # every pod of the namespace: all are tenants'


@pytest.mark.parametrize("region", REGIONS)
def test_replicas_take_traffic_only_from_where_each_kind_is_reached(region: str) -> None:
    namespace = f"tensora-{region}"
    policies = _policies(build(DEPLOY / "overlays" / region), f"{namespace}-workloads")
    ingress = {name: p for name, p in policies.items() if "Ingress" in p["policyTypes"] and p.get("ingress")}
    assert set(ingress) == {"endpoints-from-gateway", "notebooks-from-ingress"}  # VMs' launcher pods: none

    def selects(name: str, labels: dict[str, str]) -> bool:
        ops = {"Exists": lambda k, _: k in labels, "DoesNotExist": lambda k, _: k not in labels}
        return all(ops[e["operator"]](e["key"], e) for e in ingress[name]["podSelector"]["matchExpressions"])

    replica = {"tensora.io/replica": "rp_1", "app.kubernetes.io/managed-by": "tensora"}
    kinds = {"endpoint": {**replica, "serving.kserve.io/inferenceservice": "x"}, "notebook": replica,
             "vm": {**replica, "kubevirt.io": "virt-launcher"}}
    assert {k: [n for n in sorted(ingress) if selects(n, labels)] for k, labels in kinds.items()} == {
        "endpoint": ["endpoints-from-gateway"], "notebook": ["notebooks-from-ingress"], "vm": []}
    [endpoints] = ingress["endpoints-from-gateway"]["ingress"]
    assert endpoints["from"] == [
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": namespace}},
         "podSelector": {"matchLabels": {"app.kubernetes.io/name": "tensora-gateway"}}},
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "knative-serving"}}}]
    [notebooks] = ingress["notebooks-from-ingress"]["ingress"]
    assert notebooks == {"from": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name":
                                                                         "ingress-nginx"}}}],
                         "ports": [{"port": 8888, "protocol": "TCP"}]}


@pytest.mark.parametrize("region", REGIONS)
def test_owners_files_are_one_share_read_write_for_the_api_and_read_only_for_replicas(region: str) -> None:
    """The API's pods mount the control plane's claim at DATA_DIR/files; the controller, with the same
    DATA_DIR, names the workloads namespace's claim in storageUris; each claim binds a PersistentVolume
    of the region's (the two of one share, docs/kubernetes.md), and the replicas' one is read-only."""
    namespace, workloads = f"tensora-{region}", f"tensora-{region}-workloads"
    docs = build(DEPLOY / "overlays" / region)
    claims = {d["metadata"]["namespace"]: d for d in docs if d["kind"] == "PersistentVolumeClaim"}
    assert set(claims) == {namespace, workloads}
    assert claims[namespace]["spec"]["accessModes"] == ["ReadWriteMany"]
    assert claims[workloads]["spec"]["accessModes"] == ["ReadOnlyMany"]
    assert claims[namespace]["spec"]["volumeName"] == f"tensora-{region}-files"
    assert claims[workloads]["spec"]["volumeName"] == f"tensora-{region}-files-workloads"
    assert all(c["spec"]["storageClassName"] == "" for c in claims.values())  # bound to those volumes only
    deployments = {d["metadata"]["name"]: d["spec"]["template"]["spec"] for d in docs if d["kind"] == "Deployment"}
    env = {name: {e["name"]: e.get("value") for e in pod["containers"][0]["env"]} for name, pod in deployments.items()}
    data_dir = env["tensora-api"]["TENSORA_DATA_DIR"]
    assert env["tensora-controller"]["TENSORA_DATA_DIR"] == data_dir  # models are recorded as paths under it
    assert env["tensora-controller"]["TENSORA_FILES_CLAIM"] == claims[workloads]["metadata"]["name"]
    api = deployments["tensora-api"]
    [files] = [v["name"] for v in api["volumes"]
               if v.get("persistentVolumeClaim", {}).get("claimName") == claims[namespace]["metadata"]["name"]]
    assert {"name": files, "mountPath": f"{data_dir}/files"} in api["containers"][0]["volumeMounts"]
    assert not any("persistentVolumeClaim" in v for name, pod in deployments.items() if name != "tensora-api"
                   for v in pod["volumes"])  # the gateway and the controller never see owners' files


def _granted(role: dict[str, Any]) -> dict[tuple[str, str], set[str]]:
    return {(g, r): set(rule["verbs"]) for rule in role["rules"] for g in rule["apiGroups"] for r in rule["resources"]}


def test_the_controller_may_do_exactly_what_its_driver_does_to_replicas_objects() -> None:
    """Every kind the driver renders for a notebook (with its Ingress), a VM and an endpoint is granted the verbs it
    uses (create; get, list, watch; update for a replace; delete) in the workloads namespace, and
    nothing else is granted there."""
    from tensora.config.catalog import default_catalog
    from tensora.drivers.base import ReplicaSpec
    from tensora.drivers.kubernetes.driver import _resources
    from tensora.drivers.kubernetes.render import Context, replica_objects
    from tensora.placement.kinds import WorkloadKind

    catalog = default_catalog()
    rendered = [doc for kind, cls in ((WorkloadKind.NOTEBOOK, "cpu-4c-16g"), (WorkloadKind.VM, "l40s-48gb"),
                                      (WorkloadKind.ENDPOINT, "l40s-48gb"))
                for doc in replica_objects(ReplicaSpec("rp_x", "wl_x", kind, cls, "n", model="/files/shared/m"),
                                           catalog[cls], Context("tensora-eu-west-workloads", "alice",
                                                                 notebook_domain="nb.example.org",
                                                                 files_root=PurePosixPath("/files"),
                                                                 files_claim="tensora-files"))]
    res = _resources()  # the lightkube resources the driver calls, which name their group and plural
    used = {(res[d["kind"]]._api_info.resource.group, res[d["kind"]]._api_info.plural) for d in rendered}
    assert ("", "secrets") in used and ("kubevirt.io", "virtualmachines") in used
    assert ("networking.k8s.io", "ingresses") in used  # a notebook's, where a notebook domain is set
    docs = build(DEPLOY / "overlays" / "eu-west")
    [role] = [d for d in docs if d["kind"] == "Role"]
    assert role["metadata"]["namespace"] == "tensora-eu-west-workloads"
    granted = _granted(role)
    assert set(granted) == used
    assert all(verbs == {"get", "list", "watch", "create", "update", "delete"} for verbs in granted.values())


def test_the_serving_runtimes_validate_against_kserve_s_schema() -> None:
    import jsonschema

    docs = build(DEPLOY / "runtimes")
    assert sorted(d["metadata"]["name"] for d in docs) == ["tensora-vllm", "tensora-vllm-cpu"]
    for d in docs:
        assert d["kind"] == "ClusterServingRuntime" and "namespace" not in d["metadata"]
        validate(d)
        # what KServe merges into a predictor's container meets "restricted" on its own too (non-root uid)
        assert violations({"containers": d["spec"]["containers"]}) == [], d["metadata"]["name"]
        assert all(c["securityContext"]["runAsUser"] > 0 for c in d["spec"]["containers"])
    broken = copy.deepcopy(docs[0])
    broken["spec"]["containers"][0]["imagePolicy"] = "Always"  # a typo'd field is caught
    with pytest.raises(jsonschema.ValidationError):
        validate(broken)


def test_strict_validation_catches_a_misspelt_core_field() -> None:
    import kubernetes_validate

    docs = build(DEPLOY / "overlays" / "eu-west")
    d = copy.deepcopy(next(d for d in docs if d["kind"] == "Deployment"))
    d["spec"]["template"]["spec"]["containers"][0]["resource"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(d)
