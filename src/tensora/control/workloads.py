"""What users do to workloads (create, stop, restart, delete) and how a workload reads back.

Each action is a few writes in the caller's transaction, plus an event; the controller does
the rest. Nothing here talks to a driver.
"""

from __future__ import annotations

from collections.abc import Sequence, Set
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import NotRequired, TypedDict

from sqlalchemy import Connection

from tensora.control.spec import WorkloadSpec, check_against
from tensora.errors import ModelFileError, SpecError, TensoraError
from tensora.models.isolated import read_model
from tensora.models.validator import missing_for_serving, read_context
from tensora.placement.capacity import Capacity, Node
from tensora.placement.catalog import Catalog
from tensora.placement.decisions import none_in_region_warning
from tensora.placement.fallback import ON_CPU, cpu_warning, is_gpu
from tensora.placement.kinds import ReplicaRole, ReplicaState, WorkloadKind, WorkloadState
from tensora.storage import NOT_FOUND, NotFound, Storage
from tensora.store import events as events_repo
from tensora.store import workloads as workloads_repo
from tensora.store.ids import new_id
from tensora.store.rows import ReplicaRow, Spec, WorkloadChanges, WorkloadRecord
from tensora.store.tables import ACTIVE_REPLICA
from tensora.units import format_clock


class StoppedBy(StrEnum):
    """Who stopped a workload; its reason names them until it is started again."""

    OWNER = "its owner"
    ADMIN = "an admin"


class InvalidState(Exception):
    """The action does not apply to the workload's current state (API: 409)."""


@dataclass(frozen=True, slots=True)
class Checked:
    """A create body checked for ``owner``: the spec as the client sent it (``model`` and ``image``
    are the owner's names, model size filled in), and the host paths those names resolved to.
    The paths are the server's own: they go into the row's ``spec`` and to the driver, never back
    to the client, and no client value ever stands in for them."""

    spec: WorkloadSpec
    owner: str
    model_path: str | None = None
    image_path: str | None = None
    context: int | None = None
    """The model's context length in tokens, as its config.json says (None: not known)."""


def validate(spec: WorkloadSpec, catalog: Catalog, owner: str, storage: Storage | None, *,
             runs_models: bool = False) -> Checked:
    """Check classes against the catalog, resolve ``model`` and ``image`` inside ``owner``'s files
    (or the operator's shared models) and read the model's size; SpecError names the field.
    ``runs_models``: the driver runs model servers (local, Kubernetes), so the model must also hold what
    they load (:func:`~tensora.models.validator.missing_for_serving`); a simulated fleet needs only its size.

    A name that resolves nowhere the owner may read is one message whatever the host holds
    (:data:`~tensora.storage.NOT_FOUND`). The model's headers are read only after that, so only
    files inside the resolved root are read, and a complaint about them names them by the
    owner's names, never by host paths."""
    problems = check_against(spec, catalog)
    if problems:
        field, message = problems[0]
        if field == "gpu_class":
            message += ": known classes are " + ", ".join(sorted(catalog))
        raise SpecError(message, field=field)
    model_path = image_path = None
    context = None
    if spec.kind == WorkloadKind.ENDPOINT:
        if spec.model is None and spec.model_params is None:
            raise SpecError("endpoints need a model: the name of a safetensors file or directory in your files "
                            "(tensora files upload) or shared/<root>/<path>", field="model")
        if spec.model is not None:
            if spec.model_params is not None:
                raise SpecError("give model or model_params, not both (the size is read from the model)",
                                field="model_params")
            found = _resolve(storage, owner, spec.model, "model")
            missing = missing_for_serving(found) if runs_models else None
            if missing is not None:  # a replica that could never start: say so now, not in a crash loop
                raise SpecError(f"model {spec.model!r} {missing}", field="model")
            try:
                size = read_model(found)
            except ModelFileError as exc:
                raise SpecError(f"{_shown(Path(exc.path), found, spec.model)}: {exc.message}", field="model") from None
            except OSError as exc:
                raise SpecError(f"{spec.model}: cannot read ({exc.strerror or type(exc).__name__})",
                                field="model") from None
            spec = spec.model_copy(update={"model_params": size.params, "model_bytes": size.bytes})
            model_path = str(found)
            context = read_context(found)
    if spec.image is not None:
        found = _resolve(storage, owner, spec.image, "image")
        if not found.is_file():  # a directory of the owner's is no disk either
            raise SpecError(NOT_FOUND, field="image")
        image_path = str(found)
    return Checked(spec, owner, model_path, image_path, context)


def _resolve(storage: Storage | None, owner: str, name: str, field: str) -> Path:
    """The host path of the owner's ``name``, or SpecError with the one message (also when this
    server keeps no storage)."""
    if storage is None:
        raise SpecError(NOT_FOUND, field=field)
    try:
        return storage.resolve(owner, name)
    except NotFound:
        raise SpecError(NOT_FOUND, field=field) from None


def _shown(where: Path, found: Path, name: str) -> str:
    """A path the validator complains about, as the owner names it: ``tiny/model.safetensors``
    for ``<host>/tiny/model.safetensors``; the name alone for anything not under it."""
    if where != found and where.is_relative_to(found):
        return f"{name}/{where.relative_to(found).as_posix()}"
    return name


class NotAllowed(TensoraError):
    """The caller's key may not do this: an admin's right, or a host that runs only the admin owner's
    workloads (the API answers 403 naming ``field``)."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


@dataclass(frozen=True, slots=True)
class Caller:
    """Who creates: the key's owner, whether it is an admin key, and this server's region and isolation."""

    owner: str
    admin: bool
    region: str
    isolation: str | None = None
    isolation_reason: str | None = None


def authorize_create(spec: WorkloadSpec, given: Set[str], caller: Caller) -> tuple[WorkloadSpec, str]:
    """Who may create what, before the spec is checked: the spec with this server's region filled in, and the
    owner it is created for. ``given``: the fields the body set (an owner or region left out means the caller's
    own). Raises NotAllowed (403) or SpecError (422), each naming the field."""
    if "owner" in given and spec.owner != caller.owner and not caller.admin:
        raise NotAllowed("only admin keys may create workloads for another owner", "owner")
    owner = spec.owner if "owner" in given else caller.owner
    if "region" not in given:
        spec = spec.model_copy(update={"region": caller.region})
    elif spec.region != caller.region:
        raise SpecError(f"this server serves region {caller.region!r}", field="region")
    if spec.spec.get("serverless") and not caller.admin:
        raise NotAllowed("only admin keys may run serverless (shared) endpoints", "spec.serverless")
    if caller.isolation == "admin-only" and not (caller.admin and owner == caller.owner):
        raise NotAllowed(f"this host cannot sandbox workloads ({caller.isolation_reason}), so it runs the admin "
                         "owner's only; its operator may set isolation: none to run every owner's unsandboxed")
    return spec, owner


class NameTaken(TensoraError):
    """Another of the owner's workloads not deleted has the name (the API answers 409 ``name_taken``)."""

    def __init__(self, name: str, holder: str) -> None:
        super().__init__(f"a workload called {name!r} already exists ({holder}): names are unique among your "
                         f"workloads until they are deleted; choose another name, or delete {holder} first")
        self.holder = holder


def create(conn: Connection, checked: Checked, now: float) -> WorkloadRecord:
    """Insert a queued workload of ``checked.owner`` and its first event; returns the row. NameTaken when one of
    the owner's workloads not deleted has its name: looked up and inserted under the owner's lock, so that two
    creates of one name at once are one workload and one NameTaken."""
    spec, owner = checked.spec, checked.owner
    workloads_repo.lock_owner_names(conn, owner)
    holder = workloads_repo.live_named(conn, owner, spec.name)
    if holder is not None:
        raise NameTaken(spec.name, holder)
    row = WorkloadRecord(
        id=new_id("wl_"), owner=owner, kind=spec.kind, region=spec.region, gpu_class=spec.gpu_class,
        requested_class=spec.gpu_class, placed_class=None, fallback=tuple(spec.fallback),
        fallback_after_s=spec.fallback_after_s, placement="policy", state=WorkloadState.QUEUED,
        reason=f"queued for {spec.gpu_class}", fallback_eligible_at=None, restart_available=False,
        replicas=spec.replicas, model_params=spec.model_params, model_bytes=spec.model_bytes, created_at=now,
        updated_at=now, queued_since=now, deleted_at=None, released_at=None, failures=0, last_failure="",
        retry_at=None, name=spec.name, model=spec.model,
        restart_reason="",
        spec={"kind_spec": spec.spec, "image": spec.image, "fallback_models": spec.fallback_models,
              "allow_cross_region": spec.allow_cross_region, "model_path": checked.model_path,
              "image_path": checked.image_path, "context": checked.context},
    )
    workloads_repo.insert_workload(conn, {**row._asdict(), "fallback": list(row.fallback)})
    policy = f"; fallback to {', '.join(spec.fallback)} after {spec.fallback_after_s:g}s" if spec.fallback else ""
    events_repo.add_event(conn, row.id, now, "transition", f"created: queued for {spec.gpu_class}{policy}",
                          None, WorkloadState.QUEUED)
    return row


def stop(conn: Connection, w: WorkloadRecord, now: float, by: StoppedBy = StoppedBy.OWNER, *,
         deleting: bool = False) -> WorkloadRecord:
    """Ask the workload's replicas to stop. Its reason reads ``stopped by its owner`` (while
    ``stopping`` too: the state says how far it got) until a restart queues it again."""
    if w.state in (WorkloadState.STOPPED, WorkloadState.FAILED, WorkloadState.STOPPING):
        return w
    active = workloads_repo.replicas_of(conn, [w.id])
    target = WorkloadState.STOPPING if active else WorkloadState.STOPPED
    reason = f"{'deleted' if deleting else 'stopped'} by {by}"
    values: WorkloadChanges = {"state": target, "updated_at": now, "restart_available": False, "reason": reason}
    if not workloads_repo.update_workload(conn, w.id, values, expect_state=w.state):
        raise InvalidState("the workload changed meanwhile; try again")
    for r in active:
        workloads_repo.update_replica(conn, r.id, {"state": ReplicaState.STOPPING, "updated_at": now})
    asked = "deleted" if deleting else "stop requested"
    events_repo.add_event(conn, w.id, now, "transition", f"{target}: {asked} by {by}", w.state, target)
    return w._replace(**values)


def restart(conn: Connection, w: WorkloadRecord, now: float, placement: str) -> WorkloadRecord:
    """Stop what runs and queue again. ``placement="requested"``: only the requested class
    this time (the ADR's "restart on GPU"); ``"policy"``: the class, then the fallback list."""
    if w.state == WorkloadState.STOPPING:
        raise InvalidState("the workload is stopping; restart it once it has stopped")
    for r in workloads_repo.replicas_of(conn, [w.id]):
        workloads_repo.update_replica(conn, r.id, {"state": ReplicaState.STOPPING, "updated_at": now})
    values: WorkloadChanges = {
        "state": WorkloadState.QUEUED, "placement": placement, "placed_class": None, "queued_since": now,
        "updated_at": now, "restart_available": False, "restart_reason": "", "reason": f"queued for {w.gpu_class}",
        "fallback_eligible_at": None,
        "failures": 0, "last_failure": "", "retry_at": None}  # an owner's restart ends a crash loop
    if not workloads_repo.update_workload(conn, w.id, values, expect_state=w.state):
        raise InvalidState("the workload changed meanwhile; try again")
    on = f"on {w.gpu_class} only" if placement == "requested" else "with its placement policy"
    events_repo.add_event(conn, w.id, now, "transition", f"queued: restart requested {on}", w.state,
                          WorkloadState.QUEUED)
    return w._replace(**values)


def delete(conn: Connection, w: WorkloadRecord, now: float, by: StoppedBy = StoppedBy.OWNER) -> None:
    w = stop(conn, w, now, by, deleting=True)
    workloads_repo.update_workload(conn, w.id, {"deleted_at": now, "updated_at": now})


class Condition(TypedDict):
    """A visible condition of a workload (``conditions``)."""

    type: str
    reason: str
    message: str
    count: NotRequired[int]


ReplicaView = TypedDict("ReplicaView", {"id": str, "class": str, "node": str, "state": ReplicaState,
                                        "url": str | None, "role": ReplicaRole})
"""An endpoint's replica as the API shows it."""


class Access(TypedDict):
    """Where a notebook or VM is reached: its primary replica's URL and node (None until it runs)."""

    url: str | None
    node: str | None


class WorkloadView(TypedDict):
    """The API shape of a workload (``view``), timestamps as epoch seconds (the API writes them ISO 8601)."""

    id: str
    name: str
    kind: WorkloadKind
    owner: str
    region: str
    state: WorkloadState
    gpu_class: str
    requested_class: str
    placed_class: str | None
    fallback: list[str]
    fallback_after_s: float
    placement: str
    conditions: list[Condition]
    reason: str
    fallback_eligible_at: float | None
    restart_available: bool
    restart_reason: str | None
    created_at: float
    updated_at: float
    queued_since: float | None
    spec: Spec
    warning: NotRequired[str]
    model: NotRequired[str | None]
    """Endpoints only, as the four keys below."""
    model_params: NotRequired[int | None]
    replicas: NotRequired[list[ReplicaView]]
    fallback_models: NotRequired[list[str]]
    allow_cross_region: NotRequired[bool]
    access: NotRequired[Access]
    """Notebooks and VMs only."""
    image: NotRequired[str | None]
    """VMs only."""


def conditions(w: WorkloadRecord, replicas: Sequence[ReplicaRow], catalog: Catalog) -> list[Condition]:
    """Visible conditions: ``degraded`` (cpu_fallback / class_fallback), ``moving`` and ``crash_loop``
    (its replicas failed ``count`` times in a row; the next try waits out the back-off).

    A ``cpu_fallback`` message says what CPU means for the kind (:data:`ON_CPU`)."""
    out: list[Condition] = []
    placed = w.placed_class
    if placed and placed != w.gpu_class and w.state in (WorkloadState.STARTING, WorkloadState.RUNNING):
        # cpu_fallback: a GPU class asked for, a CPU class placed; else a class fallback
        on_cpu = is_gpu(w.gpu_class, catalog) and placed in catalog and catalog[placed].is_cpu
        message = f"placed on {placed} instead of {w.gpu_class}"
        if on_cpu:
            message += f": {ON_CPU[w.kind]}"
        out.append({"type": "degraded", "reason": "cpu_fallback" if on_cpu else "class_fallback",
                    "message": message})
    movers = [r for r in replicas if r.role == ReplicaRole.CANDIDATE and r.state in ACTIVE_REPLICA]
    if movers:
        out.append({"type": "moving", "reason": "move_back",
                    "message": f"starting a replica on {movers[0].cls}; traffic shifts when it is ready"})
    if w.failures and w.state in (WorkloadState.QUEUED, WorkloadState.STARTING, WorkloadState.RUNNING):
        message = f"failed {w.failures} time{'s' if w.failures != 1 else ''}: {w.last_failure}"
        if w.retry_at is not None:
            message += f"; next try at {format_clock(w.retry_at)}"
        out.append({"type": "crash_loop", "reason": "back_off", "message": message, "count": w.failures})
    return out


def shown_reason(w: WorkloadRecord, replicas: Sequence[ReplicaRow]) -> str:
    """Its reason, or while it starts the step its primary replica waits on (its runtime's install). The step is
    the replica's (its ``detail`` while it starts, cleared when the step ends), so the placement's reason shows
    again once it runs, and a further replica installing never covers the reason of a workload that serves."""
    if w.state == WorkloadState.STARTING:
        for r in replicas:
            if r.role == ReplicaRole.PRIMARY and r.state == ReplicaState.STARTING and r.detail:
                return r.detail
    return w.reason


def create_warnings(w: WorkloadRecord, nodes: Sequence[Node], catalog: Catalog) -> list[str]:
    """What the creator of ``w`` should know now (the create answer's ``warnings``): the CPU warning, and a
    class its region (``nodes``: the region's, as last observed) has none of at all. A region with no node
    known yet says nothing: there is nothing to judge from."""
    out: list[str] = []
    cpu = cpu_warning(w.kind, w.gpu_class, w.fallback, catalog)
    if cpu:
        out.append(cpu)
    cls = catalog.get(w.gpu_class)
    if cls is not None and nodes and Capacity(nodes, (), catalog).none_in_region(w.region, cls):
        out.append(none_in_region_warning(cls.name, w.fallback))
    return out


def view(w: WorkloadRecord, replicas: Sequence[ReplicaRow], catalog: Catalog) -> WorkloadView:
    """The API shape of a workload."""
    spec = w.spec or {}
    out: WorkloadView = {
        "id": w.id, "name": w.name, "kind": w.kind, "owner": w.owner, "region": w.region, "state": w.state,
        "gpu_class": w.gpu_class, "requested_class": w.requested_class, "placed_class": w.placed_class,
        "fallback": list(w.fallback), "fallback_after_s": w.fallback_after_s, "placement": w.placement,
        "conditions": conditions(w, replicas, catalog), "reason": shown_reason(w, replicas),
        "fallback_eligible_at": w.fallback_eligible_at, "restart_available": bool(w.restart_available),
        "restart_reason": w.restart_reason or None, "created_at": w.created_at, "updated_at": w.updated_at,
        "queued_since": w.queued_since, "spec": spec.get("kind_spec") or {},
    }
    warning = cpu_warning(w.kind, w.gpu_class, w.fallback, catalog)
    if warning:
        out["warning"] = warning
    active = [r for r in replicas if r.state in ACTIVE_REPLICA]
    if w.kind == WorkloadKind.ENDPOINT:
        out["model"], out["model_params"] = w.model, w.model_params
        out["replicas"] = [{"id": r.id, "class": r.cls, "node": r.node, "state": r.state, "url": r.url, "role": r.role}
                           for r in active]
        out["fallback_models"] = spec.get("fallback_models", [])
        out["allow_cross_region"] = spec.get("allow_cross_region", False)
    else:
        primary = next((r for r in active if r.role == ReplicaRole.PRIMARY), None)
        out["access"] = {"url": primary.url if primary else None, "node": primary.node if primary else None}
        if w.kind == WorkloadKind.VM:
            out["image"] = spec.get("image")
    return out
