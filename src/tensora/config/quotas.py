"""What each owner may hold and how fast it may call: quotas and limits, set by admins only, validated here (where
the server config and the owners API read them); admission reads the running ones as plain values
(:class:`tensora.placement.quotas.RunningQuotas`, :meth:`Quotas.running`).

``Quotas`` bound what an owner holds: API keys, workloads (not deleted), GPUs and vCPUs of its running
replicas, bytes of its files. ``Limits`` bound how fast it calls: its inference traffic at the gateway, per
owner across all its keys (a key may carry a lower limit of its own, never a higher one), and its costly calls
of the control API (workload creates and restarts, deletes, file uploads), counted in the store over the last
minute so that the count holds across API processes and restarts. The server config has the
defaults (``quotas:`` and ``limits:``); ``PUT /v1/owners/{owner}`` overrides some fields for one owner and
the rest keep the defaults. A stored override is a partial dict (``owners.quotas`` / ``owners.limits``),
so a change of a default reaches every owner who did not override that field.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field

from tensora.placement.quotas import DEFAULT_RUNNING_CPU, DEFAULT_RUNNING_GPUS, RunningQuotas
from tensora.units import GIB

if TYPE_CHECKING:  # names only: importing this module loads neither capacity nor the catalog
    from tensora.placement.capacity import Node
    from tensora.placement.catalog import Catalog


class Quotas(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    keys: int = Field(default=20, ge=0, le=10_000, description="live API keys")
    workloads: int = Field(default=50, ge=0, le=100_000, description="workloads not deleted, in any state")
    running_gpus: int = Field(default=DEFAULT_RUNNING_GPUS, ge=0, le=100_000, description="GPUs held by running "
                              "replicas")
    running_cpu: float = Field(default=DEFAULT_RUNNING_CPU, ge=0, le=1_000_000, description="vCPUs of CPU classes "
                               "held by running replicas (a GPU class's vCPUs come with its GPUs)")
    storage_bytes: int = Field(default=20 * GIB, ge=0, le=2**62, description="bytes of the owner's files")

    def running(self) -> RunningQuotas:
        """The running quotas, as admission reads them."""
        return RunningQuotas(self.running_gpus, self.running_cpu)


RATE_WINDOW_S = 60.0
"""The window the control API's per-owner rates count in (``Limits.*_per_minute``)."""


class Limits(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    requests_per_minute: int = Field(default=600, ge=1, le=10_000_000, description="gateway requests a minute, "
                                     "across all the owner's keys")
    tokens_per_minute: int = Field(default=1_000_000, ge=1, le=10_000_000_000, description="gateway tokens a "
                                   "minute (prompt and completion), across all the owner's keys")
    creates_per_minute: int = Field(default=120, ge=1, le=1_000_000, description="workload creates and restarts "
                                    "(a restart starts the workload anew, as a create does)")
    deletes_per_minute: int = Field(default=120, ge=1, le=1_000_000, description="workload deletes")
    uploads_per_minute: int = Field(default=300, ge=1, le=1_000_000, description="file uploads (a model "
                                    "directory is one per file: 300 takes the largest sharded models at once)")


class OwnerSettings(BaseModel):
    """An owner's effective quotas and limits: its overrides over the defaults."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    quotas: Quotas = Field(default_factory=Quotas)
    limits: Limits = Field(default_factory=Limits)


def effective(defaults: OwnerSettings, quotas: Mapping[str, Any] | None,
              limits: Mapping[str, Any] | None) -> OwnerSettings:
    """The defaults with an owner's stored overrides (partial dicts, or None) laid over them."""
    if not quotas and not limits:
        return defaults
    return OwnerSettings(quotas=defaults.quotas.model_copy(update=dict(quotas or {})),
                         limits=defaults.limits.model_copy(update=dict(limits or {})))


def overlay(stored: Mapping[str, Any] | None, changes: Mapping[str, Any]) -> dict[str, Any] | None:
    """Stored overrides with a PUT's changes laid over them: a value sets a field, None returns it to the
    default (drops the override); fields not in ``changes`` keep theirs. None when nothing is overridden."""
    out = dict(stored or {})
    for name, value in changes.items():
        if value is None:
            out.pop(name, None)
        else:
            out[name] = value
    return out or None


def overridden(quotas: Mapping[str, Any] | None, limits: Mapping[str, Any] | None) -> list[str]:
    """The overridden fields as dotted names (``quotas.keys``), in the models' field order."""
    return ([f"quotas.{n}" for n in Quotas.model_fields if n in (quotas or {})]
            + [f"limits.{n}" for n in Limits.model_fields if n in (limits or {})])


def for_node(quotas: Quotas, node: Node, catalog: Catalog) -> Quotas:
    """``running_cpu`` and ``running_gpus`` defaulted from the one node of ``tensora up``, where the config did
    not set them: half the node's vCPUs and GPUs, so that one owner cannot hold the whole machine (the fixed
    defaults, 32 vCPU and 2 GPUs, exceed a small node), but at least the smallest class of each kind the node
    can run, so that every owner can run something (one GPU on a one-GPU machine). A class larger than half the
    node then needs an admin's quota for its owner. No GPUs on the node: ``running_gpus`` as it was (a quota of
    nothing bounds nothing, and a GPU class's reason stays that none is there, not a quota)."""
    update: dict[str, Any] = {}
    if "running_cpu" not in quotas.model_fields_set:
        cores = node.cores if node.cores is not None else node.cpu
        fitting = [c.cpu for c in catalog.cpu_classes if c.cpu <= min(node.cpu, cores) and c.memory <= node.memory]
        update["running_cpu"] = max(node.cpu / 2, min(fitting, default=0.0))
    if "running_gpus" not in quotas.model_fields_set and node.gpus:
        fitting_gpus = [c.gpu_count for c in catalog.values() if c.gpu_model is not None
                        and c.gpu_count <= node.gpus.get(c.gpu_model, 0) and c.memory <= node.memory]
        update["running_gpus"] = max(sum(node.gpus.values()) // 2, min(fitting_gpus, default=0))
    return quotas.model_copy(update=update) if update else quotas


def running_phrase(quotas: Quotas, node_has_gpus: bool = True) -> str:
    """``each owner may run 16 vCPU and 1 GPU at once``: what the banner says of the running quotas (of GPUs only
    where the node has any)."""
    if not node_has_gpus:
        return f"each owner may run {quotas.running_cpu:g} vCPU at once"
    gpus = "1 GPU" if quotas.running_gpus == 1 else f"{quotas.running_gpus} GPUs"
    return f"each owner may run {quotas.running_cpu:g} vCPU and {gpus} at once"
