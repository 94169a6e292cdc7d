"""Tensora: a free GPU cloud with opt-in, explicit and visible fallbacks.

``Client`` and ``AsyncClient`` (the SDK, ``tensora.sdk``) are re-exported lazily: ``import tensora``
stays light for the servers, which never use them.
"""

from typing import TYPE_CHECKING, Any

from tensora.errors import CatalogError, ConfigError, FleetError, ModelFileError, SpecError, TensoraError
from tensora.placement.admission import (
    Decision,
    Place,
    Policy,
    Promote,
    Queued,
    RestartAvailable,
    Running,
    Wait,
    decide,
)
from tensora.placement.capacity import Capacity, GpuReserve, Node, Placed
from tensora.placement.catalog import Catalog, ComputeClass, Kind, default_catalog, load_catalog

if TYPE_CHECKING:
    from tensora.sdk import AsyncClient, Client

__version__ = "0.1.0"

__all__ = [
    "AsyncClient",
    "Capacity",
    "Catalog",
    "CatalogError",
    "Client",
    "ComputeClass",
    "ConfigError",
    "Decision",
    "FleetError",
    "GpuReserve",
    "Kind",
    "ModelFileError",
    "Node",
    "Place",
    "Placed",
    "Policy",
    "Promote",
    "Queued",
    "RestartAvailable",
    "Running",
    "SpecError",
    "TensoraError",
    "Wait",
    "decide",
    "default_catalog",
    "load_catalog",
]


def __getattr__(name: str) -> Any:
    if name in ("Client", "AsyncClient"):
        from tensora import sdk

        return getattr(sdk, name)
    raise AttributeError(f"module 'tensora' has no attribute {name!r}")
