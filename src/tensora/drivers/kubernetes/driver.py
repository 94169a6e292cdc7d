"""The Kubernetes driver: replicas as the objects ``render`` makes, on the nodes ``cluster`` reads.

Behind the same ``Driver`` protocol as the local and simulated drivers, which the controller calls
from its thread. Inside, the driver is async: lightkube's ``AsyncClient`` on one event loop of the
driver's own thread, so the lists a cycle needs go out together (nodes with pods; pods, VMs,
inference services and notebook secrets) and the watches are tasks on that loop, not a thread each.

Everything it makes carries Tensora's labels, so ``observe`` after a controller restart lists
(adopts) what an earlier one made. ``start`` reconciles each object with what ``render`` wants:
made when missing; when already there (409 AlreadyExists: an earlier start, or a replica whose pod
went away and is being started again), read, and if what Tensora manages in it differs, replaced
with the resourceVersion that was read; a 409 Conflict (someone wrote it in between) reads again
and re-merges, so the other writer's change is kept. An object of that name that is not Tensora's
is never touched: the replica fails, saying so. A ``stop`` that finds nothing (404) is done;
it leaves a notebook's home claim, which is the workload's (``release`` deletes it once the
workload is deleted).
Transient API errors propagate: the controller redoes the work next cycle.

State is always read by listing (``observe``), which is correct whatever was missed; ``watch``
wakes the controller as soon as a replica's object changes (a pod turns Ready), so it need not wait
for its next tick. A watch whose resourceVersion is too old (410 Gone) restarts from the current
state (lightkube's retry), and any other error is retried after a growing pause. Move-back is the
controller's, as on every driver: start the preferred replica, wait until it is ready, shift
routes, stop the old one.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import threading
from collections.abc import Callable, Coroutine, Sequence
from pathlib import Path, PurePosixPath
from typing import Any, TypeVar

from tensora.drivers.base import ReplicaSpec, ReplicaStatus
from tensora.drivers.kubernetes.cluster import REPLICA_LABEL, nodes_from_cluster
from tensora.drivers.kubernetes.render import (
    CLASS_LABEL,
    WORKLOAD_LABEL,
    Context,
    NotOurs,
    home_claim_name,
    label_value,
    notebook_url,
    object_name,
    ours,
    reconciled,
    replica_objects,
)
from tensora.placement.capacity import Node
from tensora.placement.catalog import Catalog
from tensora.placement.kinds import ReplicaState

MANAGED = {"app.kubernetes.io/managed-by": "tensora"}
CONFLICT_RETRIES = 5
"""Replaces that may conflict in a row before ``start`` gives up (the next cycle tries again)."""
T = TypeVar("T")


def _resources() -> dict[str, Any]:
    from lightkube.generic_resource import create_namespaced_resource
    from lightkube.resources.core_v1 import Node as KNode
    from lightkube.resources.core_v1 import PersistentVolumeClaim, Pod, Secret, Service
    from lightkube.resources.networking_v1 import Ingress

    return {"Node": KNode, "Pod": Pod, "Service": Service, "Secret": Secret, "PersistentVolumeClaim":
            PersistentVolumeClaim, "Ingress": Ingress,
            "InferenceService": create_namespaced_resource("serving.kserve.io", "v1beta1", "InferenceService",
                                                           "inferenceservices"),
            "VirtualMachine": create_namespaced_resource("kubevirt.io", "v1", "VirtualMachine", "virtualmachines")}


def _dict(obj: Any) -> dict[str, Any]:
    out: dict[str, Any] = obj.to_dict() if hasattr(obj, "to_dict") else dict(obj)
    return out


class KubernetesDriver:
    """``make_client``: returns a lightkube ``AsyncClient`` (called on the driver's loop);
    replicas live in ``namespace``. ``files_root`` (``DATA_DIR/files``, where the API's pods mount the
    owners' files) and ``files_claim`` (that storage's claim in ``namespace``): endpoints' models."""

    def __init__(self, make_client: Callable[[], Any], catalog: Catalog, region: str, namespace: str, *,
                 notebook_domain: str | None = None, ingress_class: str | None = None,
                 storage_class: str | None = None, home_size: str = "10Gi",
                 files_root: Path | None = None, files_claim: str | None = None) -> None:
        self.catalog, self.region, self.namespace = catalog, region, namespace
        # resolved as the API resolves the paths it records (storage.resolve), so the two compare
        root = PurePosixPath(files_root.resolve()) if files_root is not None else None
        self.context = Context(namespace, "", notebook_domain=notebook_domain, ingress_class=ingress_class,
                               storage_class=storage_class, home_size=home_size, files_root=root,
                               files_claim=files_claim)
        self.res = _resources()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="kubernetes-driver", daemon=True)
        self._thread.start()
        self._closing = asyncio.Event()
        self._watches: list[asyncio.Task[None]] = []
        self._failed: dict[str, ReplicaStatus] = {}

        async def made() -> Any:
            return make_client()

        self.client = self._run(made())

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the driver's loop and wait for it (the client's own timeouts bound it)."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def close(self) -> None:
        async def shut() -> None:
            self._closing.set()
            for t in self._watches:
                t.cancel()
            await asyncio.gather(*self._watches, return_exceptions=True)
            await self.client.close()

        if self._loop.is_running():
            self._run(shut())
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=5)
        self._loop.close()

    def watch(self, on_change: Callable[[], None]) -> None:
        """Call ``on_change`` whenever a replica's Pod, InferenceService or VirtualMachine changes."""
        async def begin() -> None:
            for kind in ("Pod", "InferenceService", "VirtualMachine"):
                self._watches.append(asyncio.create_task(self._watch(kind, on_change), name=f"watch-{kind}"))

        self._run(begin())

    def _on_watch_error(self, exc: Exception, count: int) -> Any:
        """lightkube's hook: stop when closing; a 410 Gone at once (it restarts from the current state);
        anything else after a growing pause, so an API server that is away is not hammered."""
        from lightkube import ApiError
        from lightkube.types import OnErrorAction, OnErrorResult

        if self._closing.is_set():
            return OnErrorResult(OnErrorAction.STOP)
        gone = isinstance(exc, ApiError) and exc.status.code == 410
        return OnErrorResult(OnErrorAction.RETRY, sleep=0 if gone else min(5.0, 0.5 * count))

    async def _watch(self, kind: str, on_change: Callable[[], None]) -> None:
        while not self._closing.is_set():
            try:
                async for _event in self.client.watch(self.res[kind], namespace=self.namespace, labels=MANAGED,
                                                      on_error=self._on_watch_error):
                    on_change()
            except Exception:  # the API server away (a refused connection): the lists stay correct; try again
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._closing.wait(), 1.0)

    async def _list(self, kind: str, **kw: Any) -> list[dict[str, Any]]:
        return [_dict(o) async for o in self.client.list(self.res[kind], **kw)]

    # -- capacity ---------------------------------------------------------------------------

    def nodes(self) -> Sequence[Node]:
        async def read() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
            nodes, pods = await asyncio.gather(self._list("Node"), self._list("Pod", namespace="*"))
            return nodes, pods

        nodes, pods = self._run(read())
        return [n for n in nodes_from_cluster(nodes, pods, self.catalog, self.region) if n.region == self.region]

    # -- replicas ---------------------------------------------------------------------------

    def start(self, spec: ReplicaSpec) -> ReplicaStatus:
        ctx = dataclasses.replace(self.context, owner=spec.owner, trusted=spec.trusted)
        try:
            docs = replica_objects(spec, self.catalog[spec.cls], ctx)
        except (ValueError, KeyError) as exc:
            return self._failed_start(spec, str(exc))

        async def apply() -> None:
            # what the pod needs (its secret and volume claim) and its service together, then the pod
            first = [d for d in docs if d["kind"] != "Pod"]
            for wave in (first, [d for d in docs if d["kind"] == "Pod"]):
                results = await asyncio.gather(*(self._ensure(d) for d in wave), return_exceptions=True)
                for r in results:
                    if isinstance(r, BaseException):
                        raise r

        try:
            self._run(apply())
        except NotOurs as exc:
            self._run(self._delete_replica(spec.id))  # what this start made; the other object is left alone
            return self._failed_start(spec, str(exc))
        return ReplicaStatus(spec.id, spec.workload_id, spec.cls, spec.node, ReplicaState.STARTING)

    def _failed_start(self, spec: ReplicaSpec, why: str) -> ReplicaStatus:
        """A start that can never succeed: reported by the next ``observe`` (the controller then
        records it as failed, with ``why``), so it is not started again and again."""
        status = ReplicaStatus(spec.id, spec.workload_id, spec.cls, spec.node, ReplicaState.FAILED, detail=why)
        self._failed[spec.id] = status
        return status

    async def _ensure(self, desired: dict[str, Any]) -> None:
        """Make ``desired``, or bring the existing object of its name to it (see the module's text)."""
        from lightkube import ApiError, codecs

        try:
            await self.client.create(codecs.from_dict(desired), namespace=self.namespace)
            return
        except ApiError as exc:
            if exc.status.code != 409:
                raise
        kind, name = desired["kind"], desired["metadata"]["name"]
        for _ in range(CONFLICT_RETRIES):
            current = _dict(await self.client.get(self.res[kind], name, namespace=self.namespace))
            update = reconciled(current, desired)
            if update is None:
                return  # as wanted: adopted as it is
            try:
                await self.client.replace(codecs.from_dict(update), namespace=self.namespace)
                return
            except ApiError as exc:
                if exc.status.code != 409:  # 409 Conflict: changed since it was read; read it again
                    raise
        raise RuntimeError(f"{kind} {name}: still conflicting after {CONFLICT_RETRIES} replaces; next cycle")

    def stop(self, replica_id: str) -> ReplicaStatus:
        """Delete the replica's objects: STOPPING while any was still there, STOPPED when none was."""
        self._failed.pop(replica_id, None)
        deleted = self._run(self._delete_replica(replica_id))
        return ReplicaStatus(replica_id, "", "", "", ReplicaState.STOPPING if deleted else ReplicaState.STOPPED)

    async def _delete_replica(self, replica_id: str) -> int:
        """Delete each object of the replica's names that is Tensora's for this replica; the
        workload's home claim stays (``release``). How many were deleted."""
        name, mine = object_name(replica_id), label_value(replica_id)
        kinds = ("Ingress", "Service", "Pod", "Secret", "VirtualMachine", "InferenceService")
        return sum(await asyncio.gather(*(self._delete_if(k, name, mine) for k in kinds)))

    async def _delete_if(self, kind: str, name: str, value: str, label: str = REPLICA_LABEL) -> int:
        """Delete ``kind``/``name`` if it is Tensora's for ``value`` (read first: an object of that
        name that is someone else's stays); 1 if it was deleted."""
        from lightkube import ApiError

        try:
            if not ours(_dict(await self.client.get(self.res[kind], name, namespace=self.namespace)), value, label):
                return 0
            await self.client.delete(self.res[kind], name, namespace=self.namespace)
            return 1
        except ApiError as exc:
            if exc.status.code != 404:  # 404: never made, or already gone
                raise
            return 0

    def release(self, workload_id: str) -> None:
        """Delete a deleted notebook's home claim (the volume goes as its storage class's
        reclaim policy says); one that is not this workload's is left alone."""
        self._run(self._delete_if("PersistentVolumeClaim", home_claim_name(workload_id),
                                  label_value(workload_id), WORKLOAD_LABEL))

    def prune(self, ended_before: float) -> int:
        """A stopped replica's objects are deleted as it stops: the cluster keeps nothing to forget."""
        return 0

    def observe(self) -> Sequence[ReplicaStatus]:
        kinds = ("Pod", "VirtualMachine", "InferenceService")

        async def read() -> list[list[dict[str, Any]]]:
            return list(await asyncio.gather(*(self._list(k, namespace=self.namespace, labels=MANAGED)
                                               for k in (*kinds, "Secret"))))

        *lists, secrets = self._run(read())
        tokens = {s["metadata"]["name"]: _token(s) for s in secrets}
        out = [self._failed.pop(rid) for rid in list(self._failed)]  # reported once; the controller records it
        for kind, objs in zip(kinds, lists, strict=True):
            for obj in objs:
                status = self._status(kind, obj, tokens)
                if status is not None:
                    out.append(status)
        return out

    def _status(self, kind: str, d: dict[str, Any], tokens: dict[str, str | None]) -> ReplicaStatus | None:
        meta = d.get("metadata") or {}
        labels = meta.get("labels") or {}
        rid, wid, cls = labels.get(REPLICA_LABEL), labels.get(WORKLOAD_LABEL), labels.get(CLASS_LABEL)
        if not rid or not wid or not cls:
            return None
        node = _node(d, kind)
        st = d.get("status") or {}
        state, url, detail, served = ReplicaState.STARTING, None, "", None
        if meta.get("deletionTimestamp"):
            state = ReplicaState.STOPPING
        elif kind == "Pod":
            phase = st.get("phase")
            pod_ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in st.get("conditions") or [])
            if phase == "Running" and pod_ready:
                state = ReplicaState.RUNNING
                url = notebook_url(meta["name"], self.context)
                if token := tokens.get(meta["name"]):
                    url += f"?token={token}"
            elif phase == "Failed":
                state, detail = ReplicaState.FAILED, st.get("message") or st.get("reason") or "the pod failed"
            elif phase == "Succeeded":
                state = ReplicaState.STOPPED
        elif kind == "InferenceService":
            ready = [c for c in st.get("conditions") or [] if c.get("type") == "Ready"]
            if ready and ready[0].get("status") == "True" and st.get("url"):
                # the serving runtimes serve the model as the InferenceService's name (--served-model-name {{.Name}})
                state, url, served = ReplicaState.RUNNING, st["url"].rstrip("/") + "/v1", meta["name"]
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
        return ReplicaStatus(rid, wid, cls, node, state, url, detail, served_model=served)


def _token(secret: dict[str, Any]) -> str | None:
    data = (secret.get("data") or {}).get("token")
    return base64.b64decode(data).decode() if data else None


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


def connect(kubeconfig: str | None, catalog: Catalog, region: str, namespace: str, *,
            notebook_domain: str | None = None, ingress_class: str | None = None,
            storage_class: str | None = None, home_size: str = "10Gi",
            files_root: Path | None = None, files_claim: str | None = None) -> KubernetesDriver:
    """A driver for the cluster of ``kubeconfig`` (default: in-cluster, then ~/.kube/config)."""
    from lightkube import AsyncClient
    from lightkube.config.kubeconfig import KubeConfig

    config = KubeConfig.from_file(kubeconfig) if kubeconfig else KubeConfig.from_env()
    return KubernetesDriver(lambda: AsyncClient(config), catalog, region, namespace,
                            notebook_domain=notebook_domain, ingress_class=ingress_class,
                            storage_class=storage_class, home_size=home_size, files_root=files_root,
                            files_claim=files_claim)
