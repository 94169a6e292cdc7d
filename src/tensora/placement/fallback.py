"""One rule, used by the API, the gateway's route table and the dashboard: a fallback list that uses CPU, and
what running on CPU instead of the GPU asked for means for each kind (the warning says it)."""

from __future__ import annotations

from collections.abc import Iterable

from tensora.placement.catalog import CPU_WORD, Catalog
from tensora.placement.kinds import WorkloadKind

ON_CPU: dict[WorkloadKind, str] = {
    WorkloadKind.NOTEBOOK: "JupyterLab runs without a GPU while on CPU; restart on GPU when one frees "
                           "(the dashboard offers it)",
    WorkloadKind.VM: "GPU drivers in the guest find no device while on CPU; restart it on GPU to get one "
                     "(the dashboard offers it when one frees)",
    WorkloadKind.ENDPOINT: "CPU serving is roughly 10-50x slower than a GPU; it moves back to a GPU by itself "
                           "when one frees",
}
"""What running on CPU instead of the GPU asked for means, per kind (ADR-0010's table): the
degraded condition's message and the warning at create both say it."""

CPU_WARNING = ("CPU fallback is enabled: CPU serving is roughly 10-50x slower than a GPU "
               "(notebooks and VMs get no GPU at all while on CPU)")
"""The create form's warning, shown before the kind is settled; a workload's own is :func:`cpu_warning`."""


def uses_cpu(fallback: Iterable[str], catalog: Catalog) -> bool:
    """Whether a fallback list lets a workload run on CPU: the word ``cpu`` or a CPU class of the catalog."""
    return any(e == CPU_WORD or (e in catalog and catalog[e].is_cpu) for e in fallback)


def is_gpu(cls: str, catalog: Catalog) -> bool:
    return cls in catalog and not catalog[cls].is_cpu


def cpu_warning(kind: WorkloadKind, gpu_class: str, fallback: Iterable[str], catalog: Catalog) -> str | None:
    """The warning a workload carries while a GPU class is asked for and its fallback list holds CPU."""
    if not (is_gpu(gpu_class, catalog) and uses_cpu(fallback, catalog)):
        return None
    return f"CPU fallback is enabled: {ON_CPU[kind]}"
