"""What each owner may hold and how fast it may call: quotas and limits, set by admins only.

``Quotas`` bound what an owner holds: API keys, workloads (not deleted), GPUs and vCPUs of its running
replicas, bytes of its files. ``Limits`` bound its inference traffic at the gateway, per owner across all
its keys (a key may carry a lower limit of its own, never a higher one). The server config has the
defaults (``quotas:`` and ``limits:``); ``PUT /v1/owners/{owner}`` overrides some fields for one owner and
the rest keep the defaults. A stored override is a partial dict (``owners.quotas`` / ``owners.limits``),
so a change of a default reaches every owner who did not override that field.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from tensora.units import GIB


class Quotas(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    keys: int = Field(default=20, ge=0, le=10_000, description="live API keys")
    workloads: int = Field(default=50, ge=0, le=100_000, description="workloads not deleted, in any state")
    running_gpus: int = Field(default=2, ge=0, le=100_000, description="GPUs held by running replicas")
    running_cpu: float = Field(default=32, ge=0, le=1_000_000, description="vCPUs of CPU classes held by "
                             "running replicas (a GPU class's vCPUs come with its GPUs)")
    storage_bytes: int = Field(default=20 * GIB, ge=0, le=2**62, description="bytes of the owner's files")


class Limits(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    requests_per_minute: int = Field(default=600, ge=1, le=10_000_000, description="gateway requests a minute, "
                                     "across all the owner's keys")
    tokens_per_minute: int = Field(default=1_000_000, ge=1, le=10_000_000_000, description="gateway tokens a "
                                   "minute (prompt and completion), across all the owner's keys")


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
