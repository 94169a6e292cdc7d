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

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy" / "kubernetes"
CRDS = ROOT.parent / "shared" / "crds"
REGIONS = ["eu-west", "us-east"]
CLUSTER_SCOPED = {"Namespace", "ClusterRole", "ClusterRoleBinding", "ClusterServingRuntime"}


def build(path: Path) -> list[dict[str, Any]]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed: the overlays are built with its built-in kustomize")
    out = subprocess.run([kubectl, "kustomize", str(path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def validate_core(doc: dict[str, Any]) -> None:
    import kubernetes_validate

    kubernetes_validate.validate(doc, kubernetes_validate.latest_version(), strict=True)


def strict(schema: Any) -> Any:
    """A CRD schema that, like the API server's pruning plus strict field validation, refuses
    fields it does not declare (except where it preserves unknown fields)."""
    if isinstance(schema, dict):
        out = {k: strict(v) for k, v in schema.items()}
        if "properties" in out and "additionalProperties" not in out \
                and not out.get("x-kubernetes-preserve-unknown-fields"):
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [strict(v) for v in schema]
    return schema


def crd_schema(name: str, version: str) -> dict[str, Any]:
    path = CRDS / "kserve" / f"serving.kserve.io_{name}.yaml"
    if not path.exists():
        pytest.skip(f"{path} is absent: the published CRD schemas live in ../shared/crds, beside the project")
    crd = yaml.safe_load(path.read_text())
    [v] = [v for v in crd["spec"]["versions"] if v["name"] == version]
    schema: dict[str, Any] = strict(copy.deepcopy(v["schema"]["openAPIV3Schema"]))
    return schema


@pytest.mark.parametrize("region", REGIONS)
def test_a_region_overlay_builds_and_every_document_validates(region: str) -> None:
    docs = build(DEPLOY / "overlays" / region)
    kinds = sorted({d["kind"] for d in docs})
    assert kinds == ["ClusterRole", "ClusterRoleBinding", "Deployment", "Namespace", "NetworkPolicy", "Role",
                     "RoleBinding", "Service", "ServiceAccount"]
    for d in docs:
        validate_core(d)
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
    schema = crd_schema("clusterservingruntimes", "v1alpha1")
    for d in docs:
        assert d["kind"] == "ClusterServingRuntime" and "namespace" not in d["metadata"]
        jsonschema.validate(d, schema)
    broken = copy.deepcopy(docs[0])
    broken["spec"]["containers"][0]["imagePolicy"] = "Always"  # a typo'd field is caught
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, schema)


def test_strict_validation_catches_a_misspelt_core_field() -> None:
    import kubernetes_validate

    docs = build(DEPLOY / "overlays" / "eu-west")
    d = copy.deepcopy(next(d for d in docs if d["kind"] == "Deployment"))
    d["spec"]["template"]["spec"]["containers"][0]["resource"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        validate_core(d)
