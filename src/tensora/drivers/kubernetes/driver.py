"""The Kubernetes driver: replicas as the objects ``render`` makes, on the nodes ``cluster`` reads.

Behind the same ``Driver`` protocol as the local and simulated drivers. Everything it makes carries
Tensora's labels, so ``observe`` after a controller restart lists (adopts) what an earlier one
made; a ``start`` that finds its objects already there (409 AlreadyExists) adopts them too, and a
``stop`` that finds nothing (404) is done. Transient API errors propagate: the controller redoes the
work next cycle. It talks to the API server with lightkube (sync client).

State is always read by listing (``observe``: one list per kind a cycle, by label), which is correct
whatever was missed; ``watch(on_change)`` adds a watch per kind that wakes the controller as soon as a
replica's object changes (a pod turns Ready), so it need not wait for its next tick. A watch whose
resourceVersion is too old (410 Gone) restarts from the current state (lightkube's retry), and any
other error is retried after a second. Move-back is the controller's, as on every driver: start the
preferred replica, wait until it is ready, shift routes, stop the old one.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

from tensora.admission import WorkloadKind
from tensora.capacity import Node
from tensora.catalog import Catalog
from tensora.drivers.base import ReplicaSpec, ReplicaState, ReplicaStatus
from tensora.drivers.kubernetes.cluster import REPLICA_LABEL, nodes_from_cluster
from tensora.drivers.kubernetes.render import (
    CLASS_LABEL,
    NOTEBOOK_PORT,
    WORKLOAD_LABEL,
    Context,
    object_name,
    replica_objects,
)

MANAGED = {"app.kubernetes.io/managed-by": "tensora"}
KINDS_BY_WORKLOAD = {WorkloadKind.NOTEBOOK: ("Service", "Pod", "PersistentVolumeClaim", "Secret"),
                     WorkloadKind.VM: ("VirtualMachine",), WorkloadKind.ENDPOINT: ("InferenceService",)}


def _resources() -> dict[str, Any]:
    from lightkube.generic_resource import create_namespaced_resource
    from lightkube.resources.core_v1 import Node as KNode
    from lightkube.resources.core_v1 import PersistentVolumeClaim, Pod, Secret, Service

    return {"Node": KNode, "Pod": Pod, "Service": Service, "Secret": Secret, "PersistentVolumeClaim":
            PersistentVolumeClaim,
            "InferenceService": create_namespaced_resource("serving.kserve.io", "v1beta1", "InferenceService",
                                                           "inferenceservices"),
            "VirtualMachine": create_namespaced_resource("kubevirt.io", "v1", "VirtualMachine", "virtualmachines")}


def _dict(obj: Any) -> dict[str, Any]:
    out: dict[str, Any] = obj.to_dict() if hasattr(obj, "to_dict") else dict(obj)
    return out


class KubernetesDriver:
    """``client``: a lightkube ``Client``; replicas live in ``namespace``."""

    def __init__(self, client: Any, catalog: Catalog, region: str, namespace: str,
                 untrusted_owners: frozenset[str] = frozenset()) -> None:
        self.client, self.catalog, self.region, self.namespace = client, catalog, region, namespace
        self.untrusted = untrusted_owners
        self.res = _resources()
        self._closing = threading.Event()
        self._watchers: list[threading.Thread] = []

    def close(self) -> None:
        self._closing.set()
        self.client.close()
        for t in self._watchers:
            t.join(timeout=5)

    def watch(self, on_change: Callable[[], None]) -> None:
        """Call ``on_change`` whenever a replica's Pod, InferenceService or VirtualMachine changes."""
        for kind in ("Pod", "InferenceService", "VirtualMachine"):
            t = threading.Thread(target=self._watch, args=(kind, on_change), name=f"watch-{kind}", daemon=True)
            self._watchers.append(t)
            t.start()

    def _on_watch_error(self, exc: Exception, count: int) -> Any:
        """lightkube's hook: stop when closing; a 410 Gone at once (it restarts from the current state);
        anything else after a growing pause, so an API server that is away is not hammered."""
        from lightkube import ApiError
        from lightkube.types import OnErrorAction, OnErrorResult

        if self._closing.is_set():
            return OnErrorResult(OnErrorAction.STOP)
        gone = isinstance(exc, ApiError) and exc.status.code == 410
        return OnErrorResult(OnErrorAction.RETRY, sleep=0 if gone else min(5.0, 0.5 * count))

    def _watch(self, kind: str, on_change: Callable[[], None]) -> None:
        while not self._closing.is_set():
            try:
                for _event in self.client.watch(self.res[kind], namespace=self.namespace, labels=MANAGED,
                                                on_error=self._on_watch_error):
                    if self._closing.is_set():
                        return
                    on_change()
            except Exception:  # closed, or the API server away: the lists stay correct; try again
                self._closing.wait(1.0)

    # -- capacity ---------------------------------------------------------------------------

    def nodes(self) -> Sequence[Node]:
        nodes = [_dict(n) for n in self.client.list(self.res["Node"])]
        pods = [_dict(p) for p in self.client.list(self.res["Pod"], namespace="*")]
        return [n for n in nodes_from_cluster(nodes, pods, self.catalog, self.region) if n.region == self.region]

    # -- replicas ---------------------------------------------------------------------------

    def start(self, spec: ReplicaSpec) -> ReplicaStatus:
        from lightkube import ApiError, codecs

        ctx = Context(self.namespace, spec.owner, untrusted=spec.owner in self.untrusted)
        try:
            docs = replica_objects(spec, self.catalog[spec.cls], ctx)
        except (ValueError, KeyError) as exc:
            return ReplicaStatus(spec.id, spec.workload_id, spec.cls, spec.node, ReplicaState.FAILED, detail=str(exc))
        for doc in docs:
            try:
                self.client.create(codecs.from_dict(doc), namespace=self.namespace)
            except ApiError as exc:
                if exc.status.code != 409:  # 409 AlreadyExists: made by an earlier start; adopt it
                    raise
        return ReplicaStatus(spec.id, spec.workload_id, spec.cls, spec.node, ReplicaState.STARTING)

    def stop(self, replica_id: str) -> ReplicaStatus:
        """Delete the replica's objects: STOPPING while any was still there, STOPPED when none was."""
        from lightkube import ApiError

        name = object_name(replica_id)
        deleted = 0
        for kind in ("Service", "Pod", "PersistentVolumeClaim", "Secret", "VirtualMachine", "InferenceService"):
            for n in (name, f"{name}-home") if kind == "PersistentVolumeClaim" else (name,):
                try:
                    self.client.delete(self.res[kind], n, namespace=self.namespace)
                    deleted += 1
                except ApiError as exc:
                    if exc.status.code != 404:  # 404: never made, or already gone
                        raise
        return ReplicaStatus(replica_id, "", "", "", ReplicaState.STOPPING if deleted else ReplicaState.STOPPED)

    def observe(self) -> Sequence[ReplicaStatus]:
        out = []
        for kind in ("Pod", "VirtualMachine", "InferenceService"):
            for obj in self.client.list(self.res[kind], namespace=self.namespace, labels=MANAGED):
                status = self._status(kind, _dict(obj))
                if status is not None:
                    out.append(status)
        return out

    def _status(self, kind: str, d: dict[str, Any]) -> ReplicaStatus | None:
        meta = d.get("metadata") or {}
        labels = meta.get("labels") or {}
        rid, wid, cls = labels.get(REPLICA_LABEL), labels.get(WORKLOAD_LABEL), labels.get(CLASS_LABEL)
        if not rid or not wid or not cls:
            return None
        node = _node(d, kind)
        st = d.get("status") or {}
        state, url, detail = ReplicaState.STARTING, None, ""
        if meta.get("deletionTimestamp"):
            state = ReplicaState.STOPPING
        elif kind == "Pod":
            phase = st.get("phase")
            pod_ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in st.get("conditions") or [])
            if phase == "Running" and pod_ready:
                state = ReplicaState.RUNNING
                url = f"http://{meta['name']}.{self.namespace}.svc:{NOTEBOOK_PORT}/lab"
            elif phase == "Failed":
                state, detail = ReplicaState.FAILED, st.get("message") or st.get("reason") or "the pod failed"
            elif phase == "Succeeded":
                state = ReplicaState.STOPPED
        elif kind == "InferenceService":
            ready = [c for c in st.get("conditions") or [] if c.get("type") == "Ready"]
            if ready and ready[0].get("status") == "True" and st.get("url"):
                state, url = ReplicaState.RUNNING, st["url"].rstrip("/") + "/v1"
            elif ready and ready[0].get("status") == "False" and ready[0].get("reason") == "Failed":
                state, detail = ReplicaState.FAILED, ready[0].get("message", "the inference service failed")
        else:  # VirtualMachine
            printable = st.get("printableStatus")
            if st.get("ready"):
                state, url = ReplicaState.RUNNING, f"kubevirt://{self.namespace}/{meta['name']}"
            elif printable in ("CrashLoopBackOff", "ErrorUnschedulable", "ErrImagePull", "DataVolumeError"):
                state, detail = ReplicaState.FAILED, printable
            elif printable == "Stopped":
                state = ReplicaState.STOPPED
        return ReplicaStatus(rid, wid, cls, node, state, url, detail)


def _node(d: dict[str, Any], kind: str) -> str:
    spec = d.get("spec") or {}
    if kind == "Pod" and spec.get("nodeName"):
        return str(spec["nodeName"])
    pod_spec = spec.get("predictor") or (spec.get("template") or {}).get("spec") or spec
    terms = (((pod_spec.get("affinity") or {}).get("nodeAffinity") or {})
             .get("requiredDuringSchedulingIgnoredDuringExecution") or {}).get("nodeSelectorTerms") or []
    for t in terms:
        for e in t.get("matchExpressions") or []:
            if e.get("key") == "kubernetes.io/hostname" and e.get("values"):
                return str(e["values"][0])
    return ""


def connect(kubeconfig: str | None, catalog: Catalog, region: str, namespace: str,
            untrusted_owners: frozenset[str] = frozenset()) -> KubernetesDriver:
    """A driver for the cluster of ``kubeconfig`` (default: in-cluster, then ~/.kube/config)."""
    from lightkube import Client
    from lightkube.config.kubeconfig import KubeConfig

    config = KubeConfig.from_file(kubeconfig) if kubeconfig else None
    return KubernetesDriver(Client(config), catalog, region, namespace, untrusted_owners)
