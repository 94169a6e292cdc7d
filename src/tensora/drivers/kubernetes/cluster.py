"""Capacity from a Kubernetes cluster: Node and Pod objects (as the API returns them, plain dicts)
to Tensora's :class:`~tensora.placement.capacity.Node` values. Pure: the driver lists or watches, this reads.

- allocatable from ``status.allocatable``: ``cpu``, ``memory``, ``nvidia.com/gpu``, and ``pods`` (the node's pod
  limit; none given: no limit);
- the GPU model from a ``tensora.io/class`` label (a catalog class: its GPU model) or NVIDIA GPU
  feature discovery's ``nvidia.com/gpu.product`` and ``nvidia.com/gpu.memory`` (MiB), matched to the
  catalog the way the local driver matches ``nvidia-smi`` names;
- the region from ``topology.kubernetes.io/region`` (else the controller's own);
- minus what every running pod on the node requests, except Tensora's replica pods
  (``tensora.io/replica`` label): those are placements, counted from the store like on any driver;
- a node that is cordoned, not Ready, or tainted NoSchedule/NoExecute with a taint Tensora does not
  tolerate offers nothing (``schedulable=False``), and says why in ``labels["tensora.io/unschedulable"]``.

Quantities are parsed here rather than with the ``kubernetes`` package's helper, so that this pure
module imports no client.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from decimal import Decimal, InvalidOperation
from typing import Any

from tensora.drivers.hardware import gpu_model_for
from tensora.placement.capacity import Node
from tensora.placement.catalog import Catalog

GPU_RESOURCE = "nvidia.com/gpu"
PODS = "pods"
REGION_LABEL = "topology.kubernetes.io/region"
CLASS_LABEL = "tensora.io/class"
REPLICA_LABEL = "tensora.io/replica"
WHY_LABEL = "tensora.io/unschedulable"
TOLERATED_TAINTS = frozenset({"nvidia.com/gpu", "tensora.io/gpu", "tensora.io/dedicated"})
"""Taints Tensora's replica pods tolerate (the usual ones that keep other work off GPU nodes)."""

_SUFFIX: dict[str, int | Decimal] = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60,
           "n": Decimal("1e-9"), "u": Decimal("1e-6"), "m": Decimal("1e-3"), "": 1, "k": 10**3, "K": 10**3,
           "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18}

_LONGEST_FIRST = sorted((k for k in _SUFFIX if k), key=len, reverse=True)  # "Mi" before "M" and "m"


def parse_quantity(value: object) -> Decimal:
    """A Kubernetes quantity ("500m", "64Gi", "1e3", 2) as a number; ValueError naming it otherwise."""
    text = str(value).strip()
    for suffix in _LONGEST_FIRST:
        if text.endswith(suffix):
            number, factor = text[: -len(suffix)], Decimal(_SUFFIX[suffix])
            break
    else:
        number, factor = text, Decimal(1)
    try:
        out = Decimal(number) * factor
    except InvalidOperation:
        raise ValueError(f"not a Kubernetes quantity: {value!r}") from None
    if not out.is_finite() or out < 0:
        raise ValueError(f"not a Kubernetes quantity: {value!r}")
    return out


def pod_requests(pod: Mapping[str, Any]) -> dict[str, Decimal]:
    """What a pod holds on its node: the larger of its containers' sum and its largest init
    container, per resource, plus its overhead (the scheduler's rule)."""
    spec = pod.get("spec") or {}

    def of(container: Mapping[str, Any]) -> dict[str, Decimal]:
        req = (container.get("resources") or {}).get("requests") or {}
        return {k: parse_quantity(v) for k, v in req.items()}

    total: dict[str, Decimal] = {}
    for c in spec.get("containers") or []:
        for k, v in of(c).items():
            total[k] = total.get(k, Decimal(0)) + v
    for c in spec.get("initContainers") or []:
        for k, v in of(c).items():
            total[k] = max(total.get(k, Decimal(0)), v)
    for k, v in (spec.get("overhead") or {}).items():
        total[k] = total.get(k, Decimal(0)) + parse_quantity(v)
    return total


def _holds(pod: Mapping[str, Any]) -> bool:
    phase = (pod.get("status") or {}).get("phase")
    labels = (pod.get("metadata") or {}).get("labels") or {}
    return phase not in ("Succeeded", "Failed") and REPLICA_LABEL not in labels


def _why_not(node: Mapping[str, Any]) -> str | None:
    spec, status = node.get("spec") or {}, node.get("status") or {}
    if spec.get("unschedulable"):
        return "cordoned"
    ready = [c for c in status.get("conditions") or [] if c.get("type") == "Ready"]
    if ready and ready[0].get("status") != "True":
        return "not Ready"
    for t in spec.get("taints") or []:
        if t.get("effect") in ("NoSchedule", "NoExecute") and t.get("key") not in TOLERATED_TAINTS:
            return f"tainted {t.get('key')}={t.get('value', '')}:{t.get('effect')}"
    return None


def gpu_model(labels: Mapping[str, str], catalog: Catalog) -> str | None:
    """The catalog GPU model of a node's GPUs, from its labels (None: unknown, offered as no GPU)."""
    cls = labels.get(CLASS_LABEL)
    if cls and cls in catalog and catalog[cls].gpu_model:
        return catalog[cls].gpu_model
    product = labels.get("nvidia.com/gpu.product")
    if not product:
        return None
    try:
        memory = int(labels.get("nvidia.com/gpu.memory", "0")) * 2**20
    except ValueError:
        memory = 0
    return gpu_model_for(product, memory, catalog)


def nodes_from_cluster(nodes: Iterable[Mapping[str, Any]], pods: Iterable[Mapping[str, Any]], catalog: Catalog,
                       default_region: str) -> list[Node]:
    """Tensora's view of the cluster's nodes, sorted by name."""
    held: dict[str, dict[str, Decimal]] = {}
    for pod in pods:
        where = (pod.get("spec") or {}).get("nodeName")
        if not where or not _holds(pod):
            continue
        bucket = held.setdefault(where, {})
        for k, v in pod_requests(pod).items():
            bucket[k] = bucket.get(k, Decimal(0)) + v
        bucket[PODS] = bucket.get(PODS, Decimal(0)) + 1  # each takes one of the node's pods
    out = []
    for n in nodes:
        meta = n.get("metadata") or {}
        name = str(meta.get("name"))
        labels = {str(k): str(v) for k, v in (meta.get("labels") or {}).items()}
        alloc = (n.get("status") or {}).get("allocatable") or {}
        used = held.get(name, {})

        def free(resource: str, alloc: Mapping[str, Any] = alloc, used: Mapping[str, Decimal] = used) -> Decimal:
            return max(Decimal(0), parse_quantity(alloc.get(resource, 0)) - used.get(resource, Decimal(0)))

        gpus: dict[str, int] = {}
        count = int(free(GPU_RESOURCE))
        model = gpu_model(labels, catalog)
        if count and model:
            gpus[model] = count
        why = _why_not(n)
        if why:
            labels[WHY_LABEL] = why
        limit = int(free(PODS)) if PODS in alloc else None
        out.append(Node(name, labels.get(REGION_LABEL, default_region), float(free("cpu")), int(free("memory")),
                        gpus, labels, why is None, limit))
    return sorted(out, key=lambda x: x.name)
