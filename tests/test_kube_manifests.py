"""The Kubernetes deployment as operators build it: ``kubectl kustomize`` of each region overlay and
of the serving runtimes, every document validated offline, strictly (no API server can run here):
core kinds with kubernetes-validate, KServe's ClusterServingRuntime against its published CRD schema
from ``../shared/crds`` (skipped, saying why, where that folder is absent). Then the properties an
operator relies on: the region everywhere, one namespace, least-privilege service accounts,
requests and probes on every container, and the controller allowed exactly what its driver does to
replicas' objects, in the region's workloads namespace where it makes them."""

from __future__ import annotations

import copy
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from kube_schemas import validate

ROOT = Path(__file__).resolve().parent.parent
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
    assert kinds == ["ClusterRole", "ClusterRoleBinding", "Deployment", "Namespace", "NetworkPolicy", "Role",
                     "RoleBinding", "Service", "ServiceAccount"]
    for d in docs:
        validate(d)
    namespace, workloads = f"tensora-{region}", f"tensora-{region}-workloads"
    assert sorted(d["metadata"]["name"] for d in docs if d["kind"] == "Namespace") == [namespace, workloads]
    namespaced = [d for d in docs if d["kind"] not in CLUSTER_SCOPED]
    assert {d["metadata"]["namespace"] for d in namespaced} == {namespace, workloads}
    beside_replicas = sorted((d["kind"], d["metadata"]["name"]) for d in namespaced
                             if d["metadata"]["namespace"] == workloads)
    assert beside_replicas == [("NetworkPolicy", "default-deny-ingress"), ("NetworkPolicy", "replicas-from-tensora"),
                               ("Role", "tensora-controller"), ("RoleBinding", "tensora-controller")]
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
    role = next(d for d in docs if d["kind"] == "ClusterRole")
    assert {v for r in role["rules"] for v in r["verbs"]} == {"get", "list", "watch"}  # nodes and pods: read only
    controller = deployments["tensora-controller"]["spec"]["template"]["spec"]["containers"][0]
    assert {e["name"]: e.get("value") for e in controller["env"]}["TENSORA_NAMESPACE"] == workloads
    gateway_from = next(d for d in docs if d["metadata"]["name"] == "replicas-from-tensora")["spec"]["ingress"][0]
    assert gateway_from["from"][0]["namespaceSelector"]["matchLabels"] == {"kubernetes.io/metadata.name": namespace}


def _granted(role: dict[str, Any]) -> dict[tuple[str, str], set[str]]:
    return {(g, r): set(rule["verbs"]) for rule in role["rules"] for g in rule["apiGroups"] for r in rule["resources"]}


def test_the_controller_may_do_exactly_what_its_driver_does_to_replicas_objects() -> None:
    """Every kind the driver renders for a notebook (with its Ingress), a VM and an endpoint is granted the verbs it
    uses (create; get, list, watch; update for a replace; delete) in the workloads namespace, and
    nothing else is granted there."""
    from tensora.admission import WorkloadKind
    from tensora.catalog import default_catalog
    from tensora.drivers.base import ReplicaSpec
    from tensora.drivers.kubernetes.driver import _resources
    from tensora.drivers.kubernetes.render import Context, replica_objects

    catalog = default_catalog()
    rendered = [doc for kind, cls in ((WorkloadKind.NOTEBOOK, "cpu-4c-16g"), (WorkloadKind.VM, "l40s-48gb"),
                                      (WorkloadKind.ENDPOINT, "l40s-48gb"))
                for doc in replica_objects(ReplicaSpec("rp_x", "wl_x", kind, cls, "n", model="s3://m"),
                                           catalog[cls], Context("tensora-eu-west-workloads", "alice",
                                                                          notebook_domain="nb.example.org"))]
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
