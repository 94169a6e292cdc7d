"""The object graph of one replica on Kubernetes, rendered as plain dicts: pure, so the driver only
applies what this returns, and the tests validate it offline.

- notebook -> a Secret (its token), a Pod running JupyterLab, a Service, and where a notebook domain
  is set, an Ingress (``https://<name>.<domain>/``) so its owner can reach it from outside the
  cluster; and the workload's PersistentVolumeClaim (the home dir), which is the workload's, not the
  replica's: each replica mounts the same one, so a restart (on GPU after a CPU fallback, say) keeps
  the owner's files, and it goes only when the workload is deleted (``home_claim_name``);
- VM -> a KubeVirt ``VirtualMachine`` (the GPU passed through via ``spec.domain.devices.gpus``, only
  on GPU classes);
- endpoint -> a KServe ``InferenceService`` on the ClusterServingRuntime ``tensora-vllm`` (GPU
  classes) or ``tensora-vllm-cpu`` (CPU classes), its model read-only from the owner's files:
  ``pvc://<files claim>/<owner dir>/<name>`` (``storage_uri``), never a path of the API's pod.

Every object carries the labels ``tensora.io/workload``, ``tensora.io/replica``, ``tensora.io/class``
and ``tensora.io/owner`` (the owner, made a valid label value; the exact one is in an annotation;
the home claim only the workload's and the owner's),
so a restarted controller finds and adopts what it made. The replica is pinned to the node that
admission chose (required node affinity on ``kubernetes.io/hostname``); GPU resources are asked for
only on GPU classes, and on a CPU class every GPU is hidden.

Every owner is untrusted unless an admin marked it trusted: its notebook and endpoint pods run under
``runtimeClassName: kata`` (VMs are isolated already, and get nothing more than KubeVirt gives a
launcher pod). Every pod meets Pod Security "restricted" (never root, no privilege escalation, no
capabilities, the runtime's default seccomp profile) and gets no service account token.
"""

from __future__ import annotations

import copy
import hashlib
import re
import secrets
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from tensora.drivers.base import ReplicaSpec
from tensora.drivers.kubernetes.cluster import GPU_RESOURCE, REPLICA_LABEL
from tensora.placement.catalog import ComputeClass
from tensora.placement.kinds import WorkloadKind
from tensora.storage import owner_dir
from tensora.units import format_memory

WORKLOAD_LABEL, CLASS_LABEL, OWNER_LABEL = "tensora.io/workload", "tensora.io/class", "tensora.io/owner"
OWNER_ANNOTATION = "tensora.io/owner"
READONLY_ANNOTATION = "storage.kserve.io/readonly"
GPU_RUNTIME, CPU_RUNTIME = "tensora-vllm", "tensora-vllm-cpu"
NOTEBOOK_PORT = 8888
KATA = "kata"
"""The RuntimeClass of untrusted owners' pods: each pod in its own lightweight VM (Kata Containers)."""
NOTEBOOK_UID, NOTEBOOK_GID = 1000, 100
"""The Jupyter images' ``jovyan:users``: the home's files stay theirs from one replica to the next."""
SERVER_UID = 1000
"""The model server's uid and gid: never 0 (the serving runtimes set HOME to a writable /tmp)."""
CONTAINER_SECURITY: dict[str, Any] = {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}
"""Each container's part of Pod Security "restricted"; the pod's part is ``_pod_security``."""
OWNER_DIR = re.compile(r"[0-9a-f]{32}")
"""How an owner's directory under the files root is named (``storage.owner_dir``: a hash of the owner)."""


@dataclass(frozen=True, slots=True)
class Context:
    """What a replica's objects need besides its spec and class."""

    namespace: str
    owner: str
    trusted: bool = False
    """An admin marked the owner trusted: its pods run without Kata. Everyone else's run under it."""
    notebook_image: str = "quay.io/jupyter/base-notebook:2025-10-20"
    home_size: str = "10Gi"
    storage_class: str | None = None
    notebook_domain: str | None = None
    """Notebooks get an Ingress at ``<object name>.<notebook_domain>`` (TLS at the ingress controller)."""
    ingress_class: str | None = None
    files_root: PurePosixPath | None = None
    """Where the API's pods keep owners' files (``DATA_DIR/files``, resolved): the mount of ``files_claim``."""
    files_claim: str | None = None
    """The claim, in ``namespace`` (read-only there), of the share mounted at ``files_root``: endpoints' models."""


def notebook_url(name: str, ctx: Context) -> str:
    """Where a notebook's owner opens it: through the Ingress, or the Service's cluster address."""
    if ctx.notebook_domain:
        return f"https://{name}.{ctx.notebook_domain}/lab"
    return f"http://{name}.{ctx.namespace}.svc:{NOTEBOOK_PORT}/lab"


def label_value(text: str) -> str:
    """``text`` as a Kubernetes label value: [A-Za-z0-9._-], at most 63, starting and ending alnum."""
    value = re.sub(r"[^A-Za-z0-9._-]", "-", text)[:63].strip("-._")
    return value or "x"


def object_name(replica_id: str) -> str:
    """A DNS-1035 name for the replica's objects (``rp_Ab3`` -> ``tensora-rp-ab3-<hash>``)."""
    base = re.sub(r"[^a-z0-9-]", "-", replica_id.lower()).strip("-")
    suffix = hashlib.sha256(replica_id.encode()).hexdigest()[:6]  # ids differing only in case stay apart
    return f"tensora-{base}"[:52].rstrip("-") + f"-{suffix}"


def home_claim_name(workload_id: str) -> str:
    """The workload's home claim: one name for all its replicas."""
    return f"{object_name(workload_id)}-home"


def _meta(spec: ReplicaSpec, cls: ComputeClass, ctx: Context, name: str) -> dict[str, Any]:
    return {"name": name, "namespace": ctx.namespace,
            "labels": {WORKLOAD_LABEL: label_value(spec.workload_id), REPLICA_LABEL: label_value(spec.id),
                       CLASS_LABEL: label_value(cls.name), OWNER_LABEL: label_value(ctx.owner),
                       "app.kubernetes.io/managed-by": "tensora"},
            "annotations": {OWNER_ANNOTATION: ctx.owner}}


def _affinity(node: str) -> dict[str, Any]:
    return {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchExpressions": [{"key": "kubernetes.io/hostname", "operator": "In", "values": [node]}]}]}}}


def _tolerations(cls: ComputeClass) -> list[dict[str, Any]]:
    return [{"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"}] if cls.gpu_count else []


def _resources(cls: ComputeClass) -> dict[str, Any]:
    requests: dict[str, Any] = {"cpu": f"{cls.cpu:g}", "memory": format_memory(cls.memory)}
    limits: dict[str, Any] = {"memory": format_memory(cls.memory)}
    if cls.gpu_count:  # GPU resources only for GPU classes
        requests[GPU_RESOURCE] = str(cls.gpu_count)
        limits[GPU_RESOURCE] = str(cls.gpu_count)
    return {"requests": requests, "limits": limits}


def _hide_gpus(cls: ComputeClass) -> list[dict[str, str]]:
    # On a CPU class no GPU is visible, even on a GPU node with idle CPU (the device plugin would
    # otherwise expose them all to a container that asks for none).
    return [] if cls.gpu_count else [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "void"},
                                     {"name": "CUDA_VISIBLE_DEVICES", "value": ""}]


def _pod_security(uid: int, gid: int) -> dict[str, Any]:
    """The pod's part of Pod Security "restricted": never root (a fixed uid, gid and fsGroup, none 0) and
    the container runtime's default seccomp profile."""
    return {"runAsNonRoot": True, "runAsUser": uid, "runAsGroup": gid, "fsGroup": gid,
            "seccompProfile": {"type": "RuntimeDefault"}}


def _isolation(ctx: Context) -> dict[str, Any]:
    """The pod fields that keep an owner's code from the node: no service account token, and unless an
    admin trusts the owner, Kata's VM around the pod."""
    return {"automountServiceAccountToken": False, **({} if ctx.trusted else {"runtimeClassName": KATA})}


def storage_uri(spec: ReplicaSpec, ctx: Context) -> str:
    """Where KServe reads an endpoint's model: ``pvc://<files_claim>/<owner dir>/<name>``, the files the
    API resolved the owner's ``model`` to (``spec.model``, a path under ``files_root``, the claim's mount
    in the API's pods); an operator's shared model likewise, when its root lies on the claim. KServe
    mounts only that directory, read-only, into the model server. Pure.

    ValueError (the replica fails, saying so) when no files claim is configured, or for a path outside
    the files root or inside another owner's directory: a path of the API's pod never reaches the
    cluster. The message names no host path."""
    claim, root = ctx.files_claim, ctx.files_root
    if not claim or root is None:
        raise ValueError(f"replica {spec.id}: endpoints on Kubernetes serve models from the owners' files claim, "
                         "and none is configured (files_claim, docs/kubernetes.md)")
    path = PurePosixPath(spec.model or "")
    rel = path.relative_to(root) if path.is_absolute() and path.is_relative_to(root) else None
    if rel is None or not rel.parts or ".." in rel.parts:
        raise ValueError(f"replica {spec.id}: its model is not in the owners' files (claim {claim})")
    if OWNER_DIR.fullmatch(rel.parts[0]) and rel.parts[0] != owner_dir(Path(), spec.owner).name:
        raise ValueError(f"replica {spec.id}: its model is not in the owners' files (claim {claim})")
    return f"pvc://{claim}/{rel.as_posix()}"


def notebook(spec: ReplicaSpec, cls: ComputeClass, ctx: Context, token: str | None = None) -> list[dict[str, Any]]:
    name = object_name(spec.id)
    token = token or secrets.token_urlsafe(24)
    secret = {"apiVersion": "v1", "kind": "Secret", "metadata": _meta(spec, cls, ctx, name), "type": "Opaque",
              "stringData": {"token": token}}
    claim = home_claim_name(spec.workload_id)
    claim_meta = _meta(spec, cls, ctx, claim)
    for outlived in (REPLICA_LABEL, CLASS_LABEL):  # the claim outlives this replica and its class
        del claim_meta["labels"][outlived]
    pvc: dict[str, Any] = {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": claim_meta,
                           "spec": {"accessModes": ["ReadWriteOnce"],
                                    "resources": {"requests": {"storage": ctx.home_size}}}}
    if ctx.storage_class:
        pvc["spec"]["storageClassName"] = ctx.storage_class
    pod_spec: dict[str, Any] = {
        "affinity": _affinity(spec.node), "tolerations": _tolerations(cls), "restartPolicy": "Always",
        **_isolation(ctx), "enableServiceLinks": False,
        "securityContext": _pod_security(NOTEBOOK_UID, NOTEBOOK_GID),
        "containers": [{
            "name": "jupyterlab", "image": ctx.notebook_image,
            # the token reaches Jupyter by its environment (JUPYTER_TOKEN), never on the command line
            "args": ["start-notebook.py", "--ServerApp.ip=0.0.0.0", f"--ServerApp.port={NOTEBOOK_PORT}",
                     "--ServerApp.open_browser=False"],
            "env": [{"name": "JUPYTER_TOKEN", "valueFrom": {"secretKeyRef": {"name": name, "key": "token"}}},
                    *_hide_gpus(cls)],
            "ports": [{"name": "http", "containerPort": NOTEBOOK_PORT}],
            "resources": _resources(cls),
            "readinessProbe": {"httpGet": {"path": "/api/status", "port": "http"}, "periodSeconds": 5},
            "securityContext": copy.deepcopy(CONTAINER_SECURITY),
            "volumeMounts": [{"name": "home", "mountPath": "/home/jovyan"}]}],
        "volumes": [{"name": "home", "persistentVolumeClaim": {"claimName": claim}}]}
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": _meta(spec, cls, ctx, name), "spec": pod_spec}
    service = {"apiVersion": "v1", "kind": "Service", "metadata": _meta(spec, cls, ctx, name),
               "spec": {"selector": {REPLICA_LABEL: label_value(spec.id)},
                        "ports": [{"name": "http", "port": NOTEBOOK_PORT, "targetPort": "http"}]}}
    if not ctx.notebook_domain:
        return [secret, pvc, pod, service]
    host = f"{name}.{ctx.notebook_domain}"
    ingress: dict[str, Any] = {
        "apiVersion": "networking.k8s.io/v1", "kind": "Ingress", "metadata": _meta(spec, cls, ctx, name),
        "spec": {"tls": [{"hosts": [host]}], "rules": [{"host": host, "http": {"paths": [
            {"path": "/", "pathType": "Prefix",
             "backend": {"service": {"name": name, "port": {"name": "http"}}}}]}}]}}
    if ctx.ingress_class:
        ingress["spec"]["ingressClassName"] = ctx.ingress_class
    return [secret, pvc, pod, service, ingress]


def vm(spec: ReplicaSpec, cls: ComputeClass, ctx: Context) -> list[dict[str, Any]]:
    """The VM as KubeVirt runs it: its launcher pod is KubeVirt's own (non-root, restricted), and this
    asks for nothing beyond it: the pod network by masquerade (no passt, no host network), a container
    disk, no host disks or file systems, no hook sidecars; GPUs only through ``permittedHostDevices``."""
    name = object_name(spec.id)
    devices: dict[str, Any] = {"disks": [], "interfaces": [{"name": "default", "masquerade": {}}]}
    volumes: list[dict[str, Any]] = []
    if spec.image and PurePosixPath(spec.image).is_absolute():
        raise ValueError(f"replica {spec.id}: a VM cannot boot a disk image from your files on Kubernetes yet; "
                         "create it without an image")
    if spec.image:
        devices["disks"].append({"name": "root", "disk": {"bus": "virtio"}})
        volumes.append({"name": "root", "containerDisk": {"image": spec.image}})
    if cls.gpu_count and cls.gpu_model:  # passthrough only on GPU classes
        devices["gpus"] = [{"name": f"gpu{i}", "deviceName": f"nvidia.com/{cls.gpu_model}"}
                           for i in range(cls.gpu_count)]
    template: dict[str, Any] = {
        "metadata": {"labels": _meta(spec, cls, ctx, name)["labels"]},
        "spec": {"affinity": _affinity(spec.node), "tolerations": _tolerations(cls),
                 "domain": {"cpu": {"cores": max(1, int(cls.cpu))},
                            "resources": {"requests": {"memory": format_memory(cls.memory)}}, "devices": devices},
                 "networks": [{"name": "default", "pod": {}}], "volumes": volumes}}
    return [{"apiVersion": "kubevirt.io/v1", "kind": "VirtualMachine", "metadata": _meta(spec, cls, ctx, name),
             "spec": {"runStrategy": "Always", "template": template}}]


def endpoint(spec: ReplicaSpec, cls: ComputeClass, ctx: Context) -> list[dict[str, Any]]:
    if not spec.model:
        raise ValueError(f"replica {spec.id}: an endpoint needs a model")
    name = object_name(spec.id)
    predictor: dict[str, Any] = {
        "minReplicas": 1, "maxReplicas": 1, "affinity": _affinity(spec.node), "tolerations": _tolerations(cls),
        **_isolation(ctx), "securityContext": _pod_security(SERVER_UID, SERVER_UID),
        "model": {"modelFormat": {"name": "safetensors"}, "runtime": GPU_RUNTIME if cls.gpu_count else CPU_RUNTIME,
                  "storageUri": storage_uri(spec, ctx), "resources": _resources(cls), "env": _hide_gpus(cls),
                  "securityContext": copy.deepcopy(CONTAINER_SECURITY)}}
    meta = _meta(spec, cls, ctx, name)
    meta["annotations"][READONLY_ANNOTATION] = "true"  # KServe's default, said: the owner's files mount read-only
    return [{"apiVersion": "serving.kserve.io/v1beta1", "kind": "InferenceService", "metadata": meta,
             "spec": {"predictor": predictor}}]


class NotOurs(Exception):
    """An object of the name a replica's object needs exists, and Tensora did not make it for that
    replica: it is left alone."""


SPEC_OWNED = {"InferenceService", "VirtualMachine", "Ingress"}
"""Kinds whose whole spec is Tensora's to keep as rendered (mutable, and nobody else's to change)."""


def ours(obj: dict[str, Any], value: str, label: str = REPLICA_LABEL) -> bool:
    """Whether ``obj`` is one Tensora made for the replica (or, with ``label=WORKLOAD_LABEL``, the
    workload) labelled ``value``."""
    labels = (obj.get("metadata") or {}).get("labels") or {}
    return labels.get("app.kubernetes.io/managed-by") == "tensora" and labels.get(label) == value


def reconciled(current: dict[str, Any], desired: dict[str, Any]) -> dict[str, Any] | None:
    """What to replace ``current`` with so that what Tensora manages in it is as ``desired``, or None
    when it is already. Pure. Managed: the labels and annotations Tensora sets (others' are kept);
    the whole spec of an InferenceService, VirtualMachine or Ingress; a Service's selector and ports. Never
    touched: a Secret's data (the notebook's token, which the owner already has), a claim's spec
    (immutable, and the home dir), a Pod's spec (immutable: a pod that must change is made anew).
    The result carries ``current``'s resourceVersion, so a write in between is a 409 Conflict.
    Raises NotOurs when ``current`` is not Tensora's object for the same replica (for the home
    claim, which has no replica label: the same workload)."""
    meta, want = current.get("metadata") or {}, desired["metadata"]
    labels = meta.get("labels") or {}
    whose = REPLICA_LABEL if REPLICA_LABEL in want["labels"] else WORKLOAD_LABEL
    if not ours(current, want["labels"][whose], whose):
        raise NotOurs(f"a {desired['kind']} named {want['name']} already exists in namespace "
                      f"{meta.get('namespace') or want.get('namespace')} and Tensora did not make it for this "
                      f"{'replica' if whose == REPLICA_LABEL else 'workload'}; it was left alone")
    out = copy.deepcopy(current)
    out.pop("status", None)
    out["metadata"]["labels"] = {**labels, **want["labels"]}
    out["metadata"]["annotations"] = {**(meta.get("annotations") or {}), **want.get("annotations", {})}
    if desired["kind"] in SPEC_OWNED:
        out["spec"] = copy.deepcopy(desired["spec"])
    elif desired["kind"] == "Service":
        out["spec"] = {**(current.get("spec") or {}), "selector": desired["spec"]["selector"],
                       "ports": [{**_port(current, p["name"]), **p} for p in desired["spec"]["ports"]]}
    before = {k: v for k, v in current.items() if k != "status"}
    before["metadata"] = {**meta, "labels": labels, "annotations": meta.get("annotations") or {}}
    return None if out == before else out


def _port(current: dict[str, Any], name: str) -> dict[str, Any]:
    """A Service port as stored, so defaults the API server filled in (protocol) are not a change."""
    return next((p for p in (current.get("spec") or {}).get("ports") or [] if p.get("name") == name), {})


def replica_objects(spec: ReplicaSpec, cls: ComputeClass, ctx: Context) -> list[dict[str, Any]]:
    """Everything to apply for one replica, in apply order."""
    if spec.kind == WorkloadKind.NOTEBOOK:
        return notebook(spec, cls, ctx)
    if spec.kind == WorkloadKind.VM:
        return vm(spec, cls, ctx)
    return endpoint(spec, cls, ctx)
