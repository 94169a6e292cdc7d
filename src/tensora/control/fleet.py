"""The simulated fleet: ``nodes.yaml`` + ``workloads.yaml`` -> who gets placed where, when, and why.

``tensora plan`` is capacity planning without hardware: it replays the workloads'
submissions and stops against the nodes, on a fake clock, with the controller's own
steps (reconcile, snapshot, admission, apply) over rows in memory, and reports each
workload's state at ``--at``.

Formats (other tools drive them; keep them stable):

``nodes.yaml``::

    nodes:
      - {name: gpu-1, region: local, labels: {}, allocatable: {cpu: 32, memory: 256Gi, gpus: {L40S: 1}}}
      - {name: cpu-1, region: local, allocatable: {cpu: 64, memory: 256Gi, pods: 110}}  # pods: optional limit

``workloads.yaml``: the control API's create-workload body, plus ``submitted_at`` and
optional ``stop_at`` (offsets such as ``0s``, ``2m``)::

    workloads:
      - {kind: notebook, name: nb, gpu_class: l40s-48gb, fallback: [cpu], fallback_after: 10m, submitted_at: 0s}
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Annotated

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, TypeAdapter, ValidationError

from tensora.config import yamlsource
from tensora.control.replay import PlannedWorkload, PlanRow, replay, report
from tensora.control.spec import WorkloadSpec, check_against
from tensora.errors import FleetError, ModelFileError
from tensora.models.validator import read_model
from tensora.placement.admission import Policy, collector_paused
from tensora.placement.capacity import Node
from tensora.placement.catalog import Catalog
from tensora.units import parse_duration, parse_memory

Memory = Annotated[int, BeforeValidator(parse_memory)]
Offset = Annotated[float, BeforeValidator(parse_duration)]


class _Allocatable(BaseModel):
    model_config = ConfigDict(extra="forbid")
    cpu: float = Field(ge=0)
    memory: Memory = Field(ge=0)
    gpus: dict[str, Annotated[int, Field(ge=0)]] = Field(default_factory=dict)
    pods: int | None = Field(default=None, ge=0)
    """How many replicas the node can hold (a Kubernetes node's allocatable pods); unset: no limit."""


class _NodeSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(min_length=1, max_length=253)
    region: str = "local"
    labels: dict[str, str] = Field(default_factory=dict)
    allocatable: _Allocatable
    schedulable: bool = True


class _NodesFile(BaseModel):
    model_config = ConfigDict(extra="forbid")
    nodes: list[_NodeSpec]


class _PlannedWorkload(WorkloadSpec):
    submitted_at: Offset = 0.0
    stop_at: Offset | None = None


class _WorkloadsFile(BaseModel):
    """The file's model: what it accepts, and its first problem as the error (see :func:`_validated`)."""

    model_config = ConfigDict(extra="forbid")
    workloads: list[_PlannedWorkload]


class _Offsets(BaseModel):
    """A planned workload's fields beyond its create body, validated as :class:`_PlannedWorkload` validates them."""

    model_config = ConfigDict(extra="ignore")
    submitted_at: Offset = 0.0
    stop_at: Offset | None = None


_BODIES = TypeAdapter(list[WorkloadSpec])
_OFFSETS = TypeAdapter(list[_Offsets])
_OFFSET_KEYS = frozenset(_Offsets.model_fields)


def _read(path: Path, key: str) -> tuple[dict[str, object], yamlsource.Lines]:
    data, lines = yamlsource.load(path, FleetError)
    if not isinstance(data, dict):
        raise FleetError(f"expected a mapping with a '{key}' list", source=str(path), line=1)
    return data, lines


def _error(exc: ValidationError, path: Path, lines: yamlsource.Lines) -> FleetError:
    return yamlsource.validation_error(exc, source=str(path), lines=lines, error=FleetError)


def load_nodes(path: Path | str) -> list[Node]:
    """Nodes of a ``nodes.yaml``; errors name the file, line and field."""
    with collector_paused():  # loading makes many objects and frees few: see load_workloads
        return _nodes(Path(path))


def _nodes(path: Path) -> list[Node]:
    data, lines = _read(path, "nodes")
    try:
        parsed = _NodesFile.model_validate(data)
    except ValidationError as exc:
        raise _error(exc, path, lines) from None
    seen: set[str] = set()
    out = []
    for i, n in enumerate(parsed.nodes):
        if n.name in seen:
            raise FleetError(f"duplicate node name {n.name!r}", source=str(path),
                             line=lines.line(("nodes", i, "name")), field=f"nodes[{i}].name")
        seen.add(n.name)
        a = n.allocatable
        out.append(Node(n.name, n.region, a.cpu, a.memory, dict(a.gpus), dict(n.labels), n.schedulable, a.pods))
    return out


def _validated(data: dict[str, object], path: Path, lines: yamlsource.Lines) -> list[tuple[WorkloadSpec, _Offsets]]:
    """Each workload's create body and offsets, as the file's model (:class:`_WorkloadsFile`) validates them.

    One pass over all the bodies (the offsets set apart) and one over the offsets: the file's model would make
    each workload a :class:`_PlannedWorkload`, whose body must then be made again without its offsets. Both
    accept the same workloads (the same fields, validators and order), so a file refused here is refused by
    the file's model too, which names its first problem as the error, in its own order of fields."""
    items = data.get("workloads")
    if data.keys() == {"workloads"} and type(items) is list and all(type(w) is dict for w in items):
        try:
            bodies = _BODIES.validate_python([{k: v for k, v in w.items() if k not in _OFFSET_KEYS} for w in items])
            return list(zip(bodies, _OFFSETS.validate_python(items), strict=True))
        except ValidationError:
            pass
    try:
        _WorkloadsFile.model_validate(data)
    except ValidationError as exc:
        raise _error(exc, path, lines) from None
    raise AssertionError(f"{path}: the file's model accepts workloads that their create bodies refuse")


def load_workloads(path: Path | str, catalog: Catalog) -> list[PlannedWorkload]:
    """Workloads of a ``workloads.yaml``, validated like create bodies; errors name file, line, field."""
    # loading makes many objects and frees few: the cycle collector, run as objects are made, would walk the
    # growing file again and again (half the time of loading 10,000 workloads)
    with collector_paused():
        return _workloads(Path(path), catalog)


def _workloads(path: Path, catalog: Catalog) -> list[PlannedWorkload]:
    data, lines = _read(path, "workloads")
    seen: set[str] = set()
    out = []
    for i, (spec, at) in enumerate(_validated(data, path, lines)):
        where = ("workloads", i)
        if spec.name in seen:
            raise FleetError(f"duplicate workload name {spec.name!r}", source=str(path),
                             line=lines.line((*where, "name")), field=f"workloads[{i}].name")
        seen.add(spec.name)
        for field, message in check_against(spec, catalog):
            key = field.split("[")[0]
            raise FleetError(message, source=str(path), line=lines.line((*where, key)), field=f"workloads[{i}].{field}")
        if at.stop_at is not None and at.stop_at < at.submitted_at:
            raise FleetError("stop_at is before submitted_at", source=str(path),
                             line=lines.line((*where, "stop_at")), field=f"workloads[{i}].stop_at")
        if spec.model is not None and spec.model_params is None:
            model_path = (path.parent / spec.model) if not Path(spec.model).is_absolute() else Path(spec.model)
            try:
                size = read_model(model_path)
            except ModelFileError as exc:
                raise FleetError(str(exc), source=str(path), line=lines.line((*where, "model")),
                                 field=f"workloads[{i}].model") from None
            spec = spec.model_copy(update={"model_params": size.params, "model_bytes": size.bytes})
        out.append(PlannedWorkload(spec, at.submitted_at, at.stop_at))
    return out


def plan(
    nodes: Sequence[Node], workloads: Sequence[PlannedWorkload], catalog: Catalog, at: float,
    policy: Policy | None = None,
) -> list[PlanRow]:
    """Replay ``workloads`` on ``nodes`` up to offset ``at`` and report each one's state then.

    Time 0 is the start of the plan; clock times in reasons read as offsets (00:10:00 = 10m).
    """
    return report(workloads, replay(nodes, workloads, catalog, at, policy))
