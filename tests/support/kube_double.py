"""An API-server double for the Kubernetes driver's tests: a fake, and the fake is the point.

It speaks the Kubernetes REST API over real HTTP for the calls the driver makes: list (cluster-wide
or in a namespace, with an equality ``labelSelector``), get, create, replace (PUT) and delete, for
core kinds and custom resources alike, answering with the API server's shapes: ``resourceVersion``
on every write and list, ``Status`` bodies with ``reason`` and ``code``, 409 AlreadyExists on a
create of an existing name, 404 NotFound. A replace must carry the ``resourceVersion`` it read
(stricter than the API server, which lets most kinds be replaced unconditionally: a driver that
forgot it is caught), and one that is not the current one is 409 Conflict ("the object has been
modified"); a replace keeps the stored ``status``, and a Pod's spec cannot be changed by one (422
Invalid, as pod updates may not change the spec). ``race_next`` plays another writer: right after
the next read of an object, it changes that object, so the reader's replace conflicts.
``fail_next`` injects a failure (e.g. a 500) for one matching call.
``set_status`` plays the kubelet / KServe / KubeVirt. Pod Security admission: a Pod created in a
namespace (seeded as a ``Namespace`` object) labelled ``pod-security.kubernetes.io/enforce: restricted``
is checked against the "restricted" profile (``RESTRICTED``, each check by the name the Pod Security
Standards give it) and refused with 403 Forbidden naming what it violates, as the API server does.
Watches (``?watch=true``) stream the events after ``resourceVersion`` (or, without one, ADDED for every
current object first), each stream ending after ``timeoutSeconds`` (at most a second here, so the client
re-watches from its last resourceVersion); ``compact()`` forgets the history, after which a watch from an
older resourceVersion gets an ERROR event with 410 Gone, as after etcd compaction. Not implemented:
server-side apply and PATCH (the driver uses neither), field selectors, and set-based selectors.
"""

from __future__ import annotations

import asyncio
import base64
import copy
import datetime as dt
import itertools
import threading
import uuid
from collections.abc import Callable
from typing import Any
from urllib.parse import parse_qs

import orjson

Key = tuple[str, str, str]  # (api prefix + plural, namespace, name)
NAMESPACES = "api/v1/namespaces"
ENFORCE = "pod-security.kubernetes.io/enforce"


# -- Pod Security Standards, "restricted" (which includes "baseline"), for a pod spec ------------------

SAFE_SYSCTLS = {"kernel.shm_rmid_forced", "net.ipv4.ip_local_port_range", "net.ipv4.ip_unprivileged_port_start",
                "net.ipv4.tcp_syncookies", "net.ipv4.ping_group_range", "net.ipv4.ip_local_reserved_ports",
                "net.ipv4.tcp_keepalive_time", "net.ipv4.tcp_fin_timeout", "net.ipv4.tcp_keepalive_intvl",
                "net.ipv4.tcp_keepalive_probes"}
RESTRICTED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim",
                      "projected", "secret"}
SELINUX_TYPES = {None, "", "container_t", "container_init_t", "container_kvm_t", "container_engine_t"}


def _containers(spec: dict[str, Any]) -> list[dict[str, Any]]:
    return [c for k in ("initContainers", "containers", "ephemeralContainers") for c in spec.get(k) or []]


def _contexts(spec: dict[str, Any]) -> list[dict[str, Any]]:
    """The pod's security context, then each container's (empty where unset)."""
    return [spec.get("securityContext") or {}, *(c.get("securityContext") or {} for c in _containers(spec))]


def _container_contexts(spec: dict[str, Any]) -> list[dict[str, Any]]:
    return [c.get("securityContext") or {} for c in _containers(spec)]


def _pod_or_every_container(spec: dict[str, Any], key: str, ok: Callable[[Any], bool]) -> bool:
    """``key`` passes ``ok`` in the pod's security context, or else in every container's."""
    return ok((spec.get("securityContext") or {}).get(key)) or all(
        ok(sc.get(key)) for sc in _container_contexts(spec))


def _non_root(spec: dict[str, Any]) -> bool:
    return _pod_or_every_container(spec, "runAsNonRoot", lambda v: v is True) and not any(
        sc.get("runAsNonRoot") is False for sc in _container_contexts(spec))


def _seccomp(spec: dict[str, Any]) -> bool:
    def confined(profile: Any) -> bool:
        return (profile or {}).get("type") in ("RuntimeDefault", "Localhost")

    return _pod_or_every_container(spec, "seccompProfile", confined) and not any(
        (sc.get("seccompProfile") or {}).get("type") == "Unconfined" for sc in _contexts(spec))


def _capabilities(spec: dict[str, Any]) -> bool:
    caps = [sc.get("capabilities") or {} for sc in _container_contexts(spec)]
    return all("ALL" in (c.get("drop") or []) and set(c.get("add") or []) <= {"NET_BIND_SERVICE"} for c in caps)


def _selinux(spec: dict[str, Any]) -> bool:
    options = [sc.get("seLinuxOptions") or {} for sc in _contexts(spec)]
    return all(o.get("type") in SELINUX_TYPES and not {"user", "role"} & set(o) for o in options)


def _apparmor(spec: dict[str, Any]) -> bool:
    return all((sc.get("appArmorProfile") or {}).get("type") in (None, "RuntimeDefault", "Localhost")
               for sc in _contexts(spec))


def _sysctls(spec: dict[str, Any]) -> bool:
    return {x["name"] for x in (spec.get("securityContext") or {}).get("sysctls") or []} <= SAFE_SYSCTLS


RESTRICTED: dict[str, Callable[[dict[str, Any]], bool]] = {
    # baseline
    "HostProcess": lambda s: not any((sc.get("windowsOptions") or {}).get("hostProcess") for sc in _contexts(s)),
    "Host Namespaces": lambda s: not any(s.get(k) for k in ("hostNetwork", "hostPID", "hostIPC")),
    "Privileged Containers": lambda s: not any(sc.get("privileged") for sc in _container_contexts(s)),
    "HostPath Volumes": lambda s: not any("hostPath" in v for v in s.get("volumes") or []),
    "Host Ports": lambda s: not any(p.get("hostPort") for c in _containers(s) for p in c.get("ports") or []),
    "AppArmor": _apparmor,
    "SELinux": _selinux,
    "/proc Mount Type": lambda s: all(sc.get("procMount") in (None, "Default") for sc in _container_contexts(s)),
    "Sysctls": _sysctls,
    # restricted
    "Volume Types": lambda s: all(set(v) - {"name"} <= RESTRICTED_VOLUMES for v in s.get("volumes") or []),
    "Privilege Escalation": lambda s: all(sc.get("allowPrivilegeEscalation") is False
                                          for sc in _container_contexts(s)),
    "Running as Non-root": _non_root,
    "Running as Non-root user": lambda s: all(sc.get("runAsUser") != 0 for sc in _contexts(s)),
    "Seccomp": _seccomp,
    "Capabilities": _capabilities,
}
"""The checks of the Pod Security Standards' "restricted" profile (v1.32), each by the name the standard
gives it: True when a pod spec passes. (The AppArmor annotations of older clusters are not read.)"""


def violations(spec: dict[str, Any]) -> list[str]:
    """The "restricted" checks a pod spec fails, by name; [] when it may run in a restricted namespace."""
    return [name for name, passes in RESTRICTED.items() if not passes(spec)]


def _status(code: int, reason: str, message: str) -> dict[str, Any]:
    return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "message": message,
            "reason": reason, "code": code}


class ApiServerDouble:
    """An ASGI app; serve it with ``services.serving``."""

    def __init__(self) -> None:
        self.objects: dict[Key, dict[str, Any]] = {}
        self.calls: list[tuple[str, str]] = []
        self._rv = itertools.count(1)
        self._failures: list[tuple[str, str, int]] = []
        self._lock = threading.Lock()
        self.events: list[tuple[int, str, str, dict[str, Any]]] = []  # (rv, type, collection, object)
        self.oldest = 0  # watches from before this resourceVersion are 410 Gone
        self.gone = 0  # how many watches were answered 410 Gone
        self.watches: list[tuple[str, bool]] = []  # each watch asked for, in order: (its path, answered 410 Gone)
        self.conflicts = 0  # how many replaces were answered 409 Conflict
        self._races: dict[Key, tuple[dict[str, str], int]] = {}

    def compact(self) -> None:
        with self._lock:
            self.events.clear()
            self.oldest = next(self._rv)

    def _event(self, kind: str, collection: str, obj: dict[str, Any]) -> None:
        self.events.append((int(obj["metadata"]["resourceVersion"]), kind, collection, copy.deepcopy(obj)))

    # -- test controls ---------------------------------------------------------------------

    def seed(self, collection: str, obj: dict[str, Any]) -> None:
        meta = obj["metadata"]
        self._put((collection, meta.get("namespace", ""), meta["name"]), obj)

    def fail_next(self, method: str, path_contains: str, code: int = 500) -> None:
        self._failures.append((method, path_contains, code))

    def race_next(self, collection: str, namespace: str, name: str, annotations: dict[str, str],
                  times: int = 1) -> None:
        """After each of the next ``times`` GETs of this object, another writer adds ``annotations`` to it."""
        self._races[(collection, namespace, name)] = (annotations, times)

    def set_status(self, collection: str, namespace: str, name: str, status: dict[str, Any]) -> None:
        with self._lock:
            obj = self.objects[(collection, namespace, name)]
            obj["status"] = status
            obj["metadata"]["resourceVersion"] = str(next(self._rv))
            self._event("MODIFIED", collection, obj)

    def names(self, collection: str) -> list[str]:
        return sorted(k[2] for k in self.objects if k[0] == collection)

    # -- the API ----------------------------------------------------------------------------

    def _put(self, key: Key, obj: dict[str, Any]) -> dict[str, Any]:
        if key[0] == "api/v1/secrets" and "stringData" in obj:  # as the API server stores it: base64 in data
            obj.setdefault("data", {}).update({k: base64.b64encode(v.encode()).decode()
                                               for k, v in obj.pop("stringData").items()})
        meta = obj.setdefault("metadata", {})
        meta.setdefault("uid", str(uuid.uuid4()))
        meta.setdefault("creationTimestamp", dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"))
        meta["resourceVersion"] = str(next(self._rv))
        if key[1]:
            meta["namespace"] = key[1]
        self._event("MODIFIED" if key in self.objects else "ADDED", key[0], obj)
        self.objects[key] = obj
        return obj

    def _replace(self, key: Key, obj: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        current = self.objects[key]
        meta = obj.get("metadata") or {}
        if meta.get("name") != key[2]:
            return 400, _status(400, "BadRequest", f"the name of the object ({meta.get('name')}) does not match "
                                                   f"the name on the URL ({key[2]})")
        rv = meta.get("resourceVersion")
        if not rv:
            return 422, _status(422, "Invalid", "metadata.resourceVersion: Invalid value: 0x0: must be specified "
                                                "for an update")
        if rv != current["metadata"]["resourceVersion"]:
            self.conflicts += 1
            return 409, _status(409, "Conflict", f"Operation cannot be fulfilled on {key[0].rsplit('/', 1)[-1]} "
                                                 f'"{key[2]}": the object has been modified; please apply your '
                                                 "changes to the latest version and try again")
        if key[0] == "api/v1/pods" and obj.get("spec") != current.get("spec"):
            return 422, _status(422, "Invalid", f'Pod "{key[2]}" is invalid: spec: Forbidden: pod updates may '
                                                "not change fields other than the mutable ones")
        obj = copy.deepcopy(obj)
        for kept in ("uid", "creationTimestamp"):
            obj["metadata"][kept] = current["metadata"].get(kept)
        if "status" in current:
            obj["status"] = current["status"]
        else:
            obj.pop("status", None)
        return 200, self._put(key, obj)

    @staticmethod
    def _route(path: str) -> tuple[str, str, str | None] | None:
        """(collection, namespace or '' for all, name or None) from a REST path."""
        parts = [p for p in path.split("/") if p]
        if parts[:2] == ["api", "v1"]:
            prefix, rest = "api/v1", parts[2:]
        elif parts[:1] == ["apis"] and len(parts) >= 3:
            prefix, rest = "/".join(parts[:3]), parts[3:]
        else:
            return None
        namespace = ""
        if len(rest) >= 3 and rest[0] == "namespaces":
            namespace, rest = rest[1], rest[2:]
        if not rest or len(rest) > 2:
            return None
        return f"{prefix}/{rest[0]}", namespace, rest[1] if len(rest) == 2 else None

    def _answer(self, method: str, path: str, query: dict[str, list[str]], body: bytes) -> tuple[int, Any]:
        for i, (m, frag, code) in enumerate(self._failures):
            if m == method and frag in path:
                del self._failures[i]
                return code, _status(code, "InternalError", "injected failure")
        route = self._route(path)
        if route is None:
            return 404, _status(404, "NotFound", f"the server could not find the requested resource {path}")
        collection, namespace, name = route
        with self._lock:
            if method == "GET" and name is None:
                wanted = dict(s.split("=", 1) for s in query.get("labelSelector", [""])[0].split(",") if "=" in s)
                items = [o for (c, ns, _), o in sorted(self.objects.items())
                         if c == collection and (not namespace or ns == namespace)
                         and all((o["metadata"].get("labels") or {}).get(k) == v for k, v in wanted.items())]
                return 200, {"kind": "List", "apiVersion": "v1",
                             "metadata": {"resourceVersion": str(next(self._rv))}, "items": items}
            if method == "POST" and name is None:
                obj = orjson.loads(body)
                key = (collection, namespace, obj["metadata"]["name"])
                if key in self.objects:
                    return 409, _status(409, "AlreadyExists", f"{key[2]} already exists")
                if refused := self._admit(collection, namespace, obj):
                    return 403, _status(403, "Forbidden", refused)
                return 201, self._put(key, obj)
            key = (collection, namespace, name or "")
            if key not in self.objects:
                return 404, _status(404, "NotFound", f"{name} not found")
            if method == "GET":
                got = copy.deepcopy(self.objects[key])
                if key in self._races:  # another writer, just after this read
                    annotations, times = self._races.pop(key)
                    if times > 1:
                        self._races[key] = (annotations, times - 1)
                    other = self.objects[key]
                    other["metadata"].setdefault("annotations", {}).update(annotations)
                    self._put(key, other)
                return 200, got
            if method == "PUT":
                return self._replace(key, orjson.loads(body))
            if method == "DELETE":
                gone = self.objects.pop(key)
                gone["metadata"]["resourceVersion"] = str(next(self._rv))
                self._event("DELETED", key[0], gone)
                return 200, gone
        return 405, _status(405, "MethodNotAllowed", f"{method} is not supported by this double")

    def _admit(self, collection: str, namespace: str, obj: dict[str, Any]) -> str | None:
        """Pod Security admission: why a Pod is refused in its namespace, or None when it may run."""
        ns = self.objects.get((NAMESPACES, "", namespace))
        level = ((ns or {}).get("metadata", {}).get("labels") or {}).get(ENFORCE)
        if collection != "api/v1/pods" or level != "restricted":
            return None
        failed = violations(obj.get("spec") or {})
        if not failed:
            return None
        return f'pods "{obj["metadata"]["name"]}" is forbidden: violates PodSecurity "restricted:latest": ' + ", ".join(
            failed)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        body = b""
        while True:
            msg = await receive()
            body += msg.get("body", b"")
            if not msg.get("more_body"):
                break
        method, path = scope["method"], scope["path"]
        self.calls.append((method, path))
        query = parse_qs(scope.get("query_string", b"").decode())
        if method == "GET" and query.get("watch", [""])[0] in ("true", "1"):
            await self._watch(path, query, send)
            return
        code, payload = self._answer(method, path, parse_qs(scope.get("query_string", b"").decode()), body)
        data = orjson.dumps(payload)
        await send({"type": "http.response.start", "status": code,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]})
        await send({"type": "http.response.body", "body": data})

    def _matches(self, collection: str, namespace: str, obj: dict[str, Any], wanted: dict[str, str]) -> bool:
        meta = obj.get("metadata") or {}
        return (not namespace or meta.get("namespace", "") == namespace) and all(
            (meta.get("labels") or {}).get(k) == v for k, v in wanted.items())

    async def _watch(self, path: str, query: dict[str, list[str]], send: Any) -> None:
        route = self._route(path)
        assert route is not None and route[2] is None, path
        collection, namespace, _ = route
        wanted = dict(s.split("=", 1) for s in query.get("labelSelector", [""])[0].split(",") if "=" in s)
        since = query.get("resourceVersion", [""])[0]
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
        too_old = bool(since) and int(since) < self.oldest
        self.watches.append((path, too_old))
        if too_old:  # as the API server does: an ERROR event carrying 410 Gone
            self.gone += 1
            gone = _status(410, "Expired", f"too old resource version: {since} ({self.oldest})")
            await send({"type": "http.response.body", "body": orjson.dumps({"type": "ERROR", "object": gone}) + b"\n"})
            return
        with self._lock:  # a snapshot: the lock is never held across an await
            current = [] if since else [copy.deepcopy(o) for (c, _, _), o in sorted(self.objects.items())
                                        if c == collection and self._matches(collection, namespace, o, wanted)]
            last = int(since) if since else max((e[0] for e in self.events), default=self.oldest)
        for o in current:  # no resourceVersion: the current state first, as ADDED events
            line = orjson.dumps({"type": "ADDED", "object": o}) + b"\n"
            await send({"type": "http.response.body", "body": line, "more_body": True})
        deadline = asyncio.get_running_loop().time() + min(float(query.get("timeoutSeconds", ["1"])[0]), 1.0)
        while asyncio.get_running_loop().time() < deadline:
            fresh = [e for e in list(self.events) if e[0] > last and e[2] == collection
                     and self._matches(collection, namespace, e[3], wanted)]
            for rv, kind, _, obj in fresh:
                last = rv
                await send({"type": "http.response.body", "more_body": True,
                            "body": orjson.dumps({"type": kind, "object": obj}) + b"\n"})
            await asyncio.sleep(0.02)
        await send({"type": "http.response.body", "body": b""})
