"""The Kubernetes deployment as operators build it: ``kubectl kustomize`` of each region overlay and
of the serving runtimes, every document validated offline, strictly (no API server can run here):
core kinds with kubernetes-validate, KServe's ClusterServingRuntime against its published CRD schema
from ``../shared/crds`` (skipped, saying why, where that folder is absent). Then the properties an
operator relies on: the region everywhere, one namespace, least-privilege service accounts,
requests and probes on every container."""

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
    namespace = f"tensora-{region}"
    for d in docs:
        if d["kind"] not in CLUSTER_SCOPED:
            assert d["metadata"]["namespace"] == namespace, d["metadata"]
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
