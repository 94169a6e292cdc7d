"""One replica's Kubernetes objects, rendered and validated offline: core kinds strictly with
kubernetes-validate, KServe's InferenceService and KubeVirt's VirtualMachine against their published
schemas from ``../shared/crds`` (skipped, saying why, where that folder is absent); then what the
ADR asks of them: GPUs only on GPU classes and hidden on CPU, the right serving runtime, the node
admission chose, labels to adopt by. And what a tenant is held to: every owner's pods under kata
unless an admin trusts it, every pod (a notebook's, and the pod KServe makes of a predictor) within
Pod Security "restricted", check by check, VMs given nothing beyond KubeVirt's launcher pod, and an
endpoint's model a ``pvc://`` path of the owner's own files, never a path of the API's pod."""

from __future__ import annotations

import copy
import dataclasses
import json
import re
from pathlib import Path, PurePosixPath
from typing import Any

import pytest

from tensora.config.catalog import default_catalog
from tensora.drivers.base import ReplicaSpec
from tensora.drivers.kubernetes.render import (
    CPU_RUNTIME,
    GPU_RUNTIME,
    KATA,
    Context,
    home_claim_name,
    label_value,
    replica_objects,
)
from tensora.placement.kinds import WorkloadKind
from tensora.storage import owner_dir
from tests.support.kube_double import RESTRICTED, violations
from tests.support.kube_schemas import validate

CATALOG = default_catalog()
FILES, CLAIM = PurePosixPath("/var/lib/tensora/files"), "tensora-files"
ALICE = "alice@example.com"
CTX = Context(namespace="tensora-eu-west", owner=ALICE, files_root=FILES, files_claim=CLAIM)
DNS1035 = re.compile(r"^[a-z]([-a-z0-9]{0,61}[a-z0-9])?$")


def model(name: str, owner: str = ALICE) -> str:
    """Where the API keeps ``owner``'s file ``name`` (what ``Storage.resolve`` returns)."""
    return str(FILES / owner_dir(Path(), owner).name / name)


def spec(kind: WorkloadKind, cls: str, **kw: Any) -> ReplicaSpec:
    return ReplicaSpec(id="rp_Ab3dE9", workload_id="wl_Xy7Zq2", kind=kind, cls=cls, node="gpu-l40s-1", owner=ALICE,
                       **kw)


RENDERED = {  # name: (replica, whether an admin marked its owner trusted)
    "notebook on a GPU class": (spec(WorkloadKind.NOTEBOOK, "l40s-48gb"), False),
    "notebook on a CPU class": (spec(WorkloadKind.NOTEBOOK, "cpu-16c-64g"), False),
    "notebook of a trusted owner": (spec(WorkloadKind.NOTEBOOK, "cpu-4c-16g"), True),
    "vm on a GPU class, with a disk": (spec(WorkloadKind.VM, "a100-80gb", image="quay.io/containerdisks/debian:12"),
                                       False),
    "vm on a CPU class": (spec(WorkloadKind.VM, "cpu-2c-8g"), False),
    "endpoint on a GPU class": (spec(WorkloadKind.ENDPOINT, "l40s-48gb", model=model("llama-8b")), False),
    "endpoint on a CPU class, a trusted owner's shared model": (
        spec(WorkloadKind.ENDPOINT, "cpu-32c-128g", model=str(FILES / "shared" / "pool" / "tiny")), True),
}


def pod_specs(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The pods these objects make, as pod specs: a notebook's Pod, and the pod KServe makes of a predictor
    (its pod fields, the model as the container: KServe merges the serving runtime's container into it)."""
    out = [d["spec"] for d in docs if d["kind"] == "Pod"]
    for d in docs:
        if d["kind"] == "InferenceService":
            out.append(predictor_pod(d)["spec"])
    return out


def predictor_pod(isvc: dict[str, Any]) -> dict[str, Any]:
    """The Pod KServe makes of an InferenceService's predictor, less what its serving runtime adds."""
    predictor = copy.deepcopy(isvc["spec"]["predictor"])
    kserve_only = {k: predictor.pop(k) for k in ("minReplicas", "maxReplicas", "model")}
    container = {k: v for k, v in kserve_only["model"].items() if k not in ("modelFormat", "runtime", "storageUri")}
    container.update(name="kserve-container", image="vllm/vllm-openai:v0.11.0")
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": f"{isvc['metadata']['name']}-predictor", "namespace": isvc["metadata"]["namespace"],
                         "labels": isvc["metadata"]["labels"]},
            "spec": {**predictor, "containers": [container]}}


def containers(doc: dict[str, Any]) -> list[dict[str, Any]]:
    if doc["kind"] == "Pod":
        return list(doc["spec"]["containers"])
    if doc["kind"] == "InferenceService":
        return [doc["spec"]["predictor"]["model"]]
    return []


@pytest.mark.parametrize(("replica", "trusted"), RENDERED.values(), ids=RENDERED.keys())
def test_rendered_objects_validate_and_say_what_the_placement_means(replica: ReplicaSpec, trusted: bool) -> None:
    cls = CATALOG[replica.cls]
    ctx = dataclasses.replace(CTX, trusted=trusted)
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
    assert all(p.get("runtimeClassName") == (None if trusted else KATA) for p in pods)  # kata unless trusted
    if replica.kind is WorkloadKind.VM:
        assert "runtimeClassName" not in text  # a VM is a VM already: no kata around its launcher pod
    for d in docs:
        if d["kind"] == "InferenceService":
            assert d["spec"]["predictor"]["model"]["runtime"] == (GPU_RUNTIME if gpu else CPU_RUNTIME)
            rel = PurePosixPath(replica.model or "").relative_to(FILES)
            assert d["spec"]["predictor"]["model"]["storageUri"] == f"pvc://{CLAIM}/{rel}"
            assert str(FILES) not in text  # no path of the API's pod
            assert d["metadata"]["annotations"]["storage.kserve.io/readonly"] == "true"
        if d["kind"] == "VirtualMachine":
            gpus = d["spec"]["template"]["spec"]["domain"]["devices"].get("gpus", [])
            assert [g["deviceName"] for g in gpus] == ([f"nvidia.com/{cls.gpu_model}"] if gpu else [])


# -- Pod Security "restricted" --------------------------------------------------------------------

@pytest.mark.parametrize(("replica", "trusted"), RENDERED.values(), ids=RENDERED.keys())
def test_every_pod_meets_pod_security_restricted(replica: ReplicaSpec, trusted: bool) -> None:
    """Check by check (``kube_double.RESTRICTED``, as the API server's admission runs them in the
    workloads namespace), and Tensora's own: a non-root group and fsGroup, no service account token.
    The predictor's pod is validated strictly as the Pod it becomes."""
    docs = replica_objects(replica, CATALOG[replica.cls], dataclasses.replace(CTX, trusted=trusted))
    for d in docs:
        if d["kind"] == "InferenceService":
            validate(predictor_pod(d))
    for pod in pod_specs(docs):
        assert violations(pod) == []
        sc = pod["securityContext"]
        assert sc["runAsUser"] > 0 and sc["runAsGroup"] > 0 and sc["fsGroup"] > 0
        assert pod["automountServiceAccountToken"] is False
        assert all(c["securityContext"] == {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}
                   for c in pod["containers"])


def _edit(path: str, value: Any) -> Any:
    """A change to a pod spec at ``path`` (``containers/0/securityContext/privileged``); DELETE removes."""
    def edit(pod: dict[str, Any]) -> None:
        *parents, last = path.split("/")
        for p in parents:
            pod = pod[int(p)] if isinstance(pod, list) else pod.setdefault(p, {})
        if value is DELETE:
            del pod[last]
        elif isinstance(pod, list):
            pod.append(value)
        else:
            pod[last] = value
    return edit


DELETE = object()
BREAKS = {  # the check named, the change that breaks it, every check that change fails
    "HostProcess": (_edit("securityContext/windowsOptions/hostProcess", True), ["HostProcess"]),
    "Host Namespaces": (_edit("hostNetwork", True), ["Host Namespaces"]),
    "Privileged Containers": (_edit("containers/0/securityContext/privileged", True), ["Privileged Containers"]),
    "HostPath Volumes": (_edit("volumes/-", {"name": "h", "hostPath": {"path": "/var/lib/tensora"}}),
                         ["HostPath Volumes", "Volume Types"]),
    "Host Ports": (_edit("containers/0/ports/0/hostPort", 8888), ["Host Ports"]),
    "AppArmor": (_edit("containers/0/securityContext/appArmorProfile", {"type": "Unconfined"}), ["AppArmor"]),
    "SELinux": (_edit("securityContext/seLinuxOptions", {"type": "spc_t"}), ["SELinux"]),
    "/proc Mount Type": (_edit("containers/0/securityContext/procMount", "Unmasked"), ["/proc Mount Type"]),
    "Sysctls": (_edit("securityContext/sysctls", [{"name": "kernel.msgmax", "value": "1"}]), ["Sysctls"]),
    "Volume Types": (_edit("volumes/-", {"name": "n", "nfs": {"server": "nfs", "path": "/"}}), ["Volume Types"]),
    "Privilege Escalation": (_edit("containers/0/securityContext/allowPrivilegeEscalation", DELETE),
                             ["Privilege Escalation"]),
    "Running as Non-root": (_edit("securityContext/runAsNonRoot", DELETE), ["Running as Non-root"]),
    "Running as Non-root user": (_edit("containers/0/securityContext/runAsUser", 0), ["Running as Non-root user"]),
    "Seccomp": (_edit("containers/0/securityContext/seccompProfile", {"type": "Unconfined"}), ["Seccomp"]),
    "Capabilities": (_edit("containers/0/securityContext/capabilities/add", ["SYS_ADMIN"]), ["Capabilities"]),
}


@pytest.mark.parametrize(("edit", "failed"), BREAKS.values(), ids=BREAKS.keys())
def test_each_restricted_check_refuses_what_it_names(edit: Any, failed: list[str]) -> None:
    """So a pass above means something: the notebook's pod, changed in one way, fails exactly the checks
    the standard would fail it on."""
    pod = copy.deepcopy(pod_specs(replica_objects(spec(WorkloadKind.NOTEBOOK, "l40s-48gb"), CATALOG["l40s-48gb"],
                                                  CTX))[0])
    edit(pod)
    assert violations(pod) == failed


def test_every_restricted_check_has_a_case() -> None:
    assert set(BREAKS) == set(RESTRICTED)


def test_a_notebook_s_token_never_reaches_its_command_line() -> None:
    docs = replica_objects(spec(WorkloadKind.NOTEBOOK, "cpu-4c-16g"), CATALOG["cpu-4c-16g"], CTX)
    [secret] = [d for d in docs if d["kind"] == "Secret"]
    [container] = next(d for d in docs if d["kind"] == "Pod")["spec"]["containers"]
    token = secret["stringData"]["token"]
    assert not any(token in a or "token" in a.lower() for a in container["args"])
    env = {e["name"]: e for e in container["env"]}
    assert env["JUPYTER_TOKEN"]["valueFrom"] == {"secretKeyRef": {"name": secret["metadata"]["name"], "key": "token"}}
    assert not [n for n in env if n.startswith("TENSORA_")]  # nothing of Tensora's in a tenant's environment


# -- VMs ----------------------------------------------------------------------------------------------

def test_a_vm_asks_for_nothing_beyond_kubevirt_s_launcher_pod() -> None:
    """Its launcher pod is KubeVirt's (non-root, within "restricted" since KubeVirt v0.59); what the
    VirtualMachine could add to it is not asked for: no host disk or file system (virtiofs), no passt or
    host network, no hook sidecar, no runtime class; GPUs only by name through permittedHostDevices."""
    [doc] = replica_objects(spec(WorkloadKind.VM, "l40s-48gb", image="quay.io/containerdisks/debian:12"),
                            CATALOG["l40s-48gb"], CTX)
    template = doc["spec"]["template"]
    assert set(template["metadata"]) == {"labels"}  # no annotations: no hook sidecars, no launcher overrides
    vmi = template["spec"]
    assert set(vmi) == {"affinity", "tolerations", "domain", "networks", "volumes"}
    assert set(vmi["domain"]) == {"cpu", "resources", "devices"}
    devices = vmi["domain"]["devices"]
    assert set(devices) == {"disks", "interfaces", "gpus"}
    assert devices["interfaces"] == [{"name": "default", "masquerade": {}}] and vmi["networks"] == [
        {"name": "default", "pod": {}}]
    assert [set(v) - {"name"} for v in vmi["volumes"]] == [{"containerDisk"}]
    assert devices["gpus"] == [{"name": "gpu0", "deviceName": "nvidia.com/L40S"}]


def test_a_vm_s_disk_from_the_owner_s_files_is_refused_not_rendered_as_a_host_path() -> None:
    with pytest.raises(ValueError, match="cannot boot a disk image from your files") as exc:
        replica_objects(spec(WorkloadKind.VM, "cpu-2c-8g", image=model("disk.qcow2")), CATALOG["cpu-2c-8g"], CTX)
    assert str(FILES) not in str(exc.value)


# -- an endpoint's model -------------------------------------------------------------------------------

ALICE_DIR = owner_dir(Path(), ALICE).name
STORAGE_URIS: dict[str, tuple[dict[str, Any], str | None]] = {
    # name: (the replica's model and the context's files, the storageUri or None for refused)
    "the owner's model directory": ({"model": model("tiny")}, f"pvc://{CLAIM}/{ALICE_DIR}/tiny"),
    "a nested name": ({"model": model("llama/3.1/8b-instruct")}, f"pvc://{CLAIM}/{ALICE_DIR}/llama/3.1/8b-instruct"),
    "an operator's shared root on the claim": ({"model": str(FILES / "shared/pool/tiny")},
                                               f"pvc://{CLAIM}/shared/pool/tiny"),
    "another owner's directory": ({"model": model("tiny", owner="bob")}, None),
    "a host path elsewhere": ({"model": "/etc/shadow"}, None),
    "the API's admin key, beside the files": ({"model": "/var/lib/tensora/admin-key"}, None),
    "out of the owner's dir by ..": ({"model": model("../../admin-key")}, None),
    "the files root itself": ({"model": str(FILES)}, None),
    "a relative path": ({"model": f"{ALICE_DIR}/tiny"}, None),
    "a URI, not a path the API resolved": ({"model": "s3://bucket/tiny"}, None),
    "no files claim configured": ({"model": model("tiny"), "files_claim": None}, None),
    "no files root configured": ({"model": model("tiny"), "files_root": None}, None),
}


@pytest.mark.parametrize(("given", "want"), STORAGE_URIS.values(), ids=STORAGE_URIS.keys())
def test_an_endpoint_s_model_is_a_pvc_path_of_the_owner_s_files(given: dict[str, Any], want: str | None) -> None:
    replica = spec(WorkloadKind.ENDPOINT, "l40s-48gb", model=given["model"])
    ctx = dataclasses.replace(CTX, **{k: v for k, v in given.items() if k != "model"})
    if want is None:
        with pytest.raises(ValueError, match="files") as exc:
            replica_objects(replica, CATALOG["l40s-48gb"], ctx)
        assert "/var" not in str(exc.value) and "/etc" not in str(exc.value)  # says no host path
        return
    [isvc] = replica_objects(replica, CATALOG["l40s-48gb"], ctx)
    assert isvc["spec"]["predictor"]["model"]["storageUri"] == want


def test_a_model_in_the_owner_s_storage_is_served_from_its_claim(tmp_path: Path) -> None:
    """From ``tensora.storage`` itself: the path ``Storage.resolve`` gives the API is the claim's path."""
    from tensora.models.tinymodel import write_tiny_model
    from tensora.storage import Storage

    storage = Storage(tmp_path / "data" / "files", shared={"pool": tmp_path / "data" / "files" / "shared" / "pool"})
    write_tiny_model(storage.dir_of(ALICE) / "tiny")
    write_tiny_model(tmp_path / "data" / "files" / "shared" / "pool" / "tiny")
    ctx = dataclasses.replace(CTX, files_root=PurePosixPath(storage.root.resolve()))
    for name, want in (("tiny", f"{storage.dir_of(ALICE).name}/tiny"), ("shared/pool/tiny", "shared/pool/tiny")):
        replica = spec(WorkloadKind.ENDPOINT, "l40s-48gb", model=str(storage.resolve(ALICE, name)))
        [isvc] = replica_objects(replica, CATALOG["l40s-48gb"], ctx)
        assert isvc["spec"]["predictor"]["model"]["storageUri"] == f"pvc://{CLAIM}/{want}"
        assert str(tmp_path) not in json.dumps(isvc)
    bobs = dataclasses.replace(spec(WorkloadKind.ENDPOINT, "l40s-48gb", model=str(storage.resolve(ALICE, "tiny"))),
                               owner="bob")
    with pytest.raises(ValueError, match="not in the owners' files"):  # alice's file, in bob's replica
        replica_objects(bobs, CATALOG["l40s-48gb"], dataclasses.replace(ctx, owner="bob"))


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

    [isvc] = replica_objects(spec(WorkloadKind.ENDPOINT, "l40s-48gb", model=model("m")), CATALOG["l40s-48gb"], CTX)
    bad = copy.deepcopy(isvc)
    bad["spec"]["predictor"]["model"]["storageURI"] = bad["spec"]["predictor"]["model"].pop("storageUri")
    with pytest.raises(jsonschema.ValidationError):
        validate(bad)


def test_an_endpoint_without_a_model_is_refused() -> None:
    with pytest.raises(ValueError, match="needs a model"):
        replica_objects(spec(WorkloadKind.ENDPOINT, "l40s-48gb"), CATALOG["l40s-48gb"], CTX)


LABELS = {"plain": ("alice", "alice"), "an email": ("a@b.c", "a-b.c"), "too long": ("x" * 80, "x" * 63),
          "nothing valid": ("@@@", "x")}


@pytest.mark.parametrize(("text", "want"), LABELS.values(), ids=LABELS.keys())
def test_label_value(text: str, want: str) -> None:
    assert label_value(text) == want


# -- reconciling an object that exists with what is rendered --------------------------------------

NB_DOCS = {d["kind"]: d for d in replica_objects(spec(WorkloadKind.NOTEBOOK, "cpu-4c-16g"), CATALOG["cpu-4c-16g"], CTX)}
EP_DOC = replica_objects(spec(WorkloadKind.ENDPOINT, "l40s-48gb", model=model("m")), CATALOG["l40s-48gb"], CTX)[0]


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


def test_each_notebook_replica_gets_a_host_name_of_its_own_under_the_domain() -> None:
    """Browsers send cookies by host: two notebooks (two owners', or one restarted) never share one, and none is
    the domain itself, where a page of the operator's could be."""
    ctx = Context(CTX.namespace, CTX.owner, notebook_domain="nb.example.org")
    ids = ["rp_Ab3", "rp_aB3", "rp_Later1"]  # the first two differ only in case, as base-62 ids may
    hosts = [next(d for d in replica_objects(dataclasses.replace(spec(WorkloadKind.NOTEBOOK, "cpu-2c-8g"), id=i),
                                             CATALOG["cpu-2c-8g"], ctx) if d["kind"] == "Ingress"
                  )["spec"]["rules"][0]["host"] for i in ids]
    assert len(set(hosts)) == len(ids)
    for host in hosts:
        label, _, domain = host.partition(".")
        assert domain == "nb.example.org" and label  # one label of its own, right under the domain
