"""Tensora: a free GPU cloud with opt-in, explicit and visible fallbacks.

Every name below is re-exported lazily (PEP 562): ``import tensora`` loads nothing else, so the gateway and the
SDK, which import ``tensora.gateway`` or ``tensora.sdk``, never load admission, the catalog's YAML or the store
(``tests/unit/test_layers.py`` checks it).
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

from tensora.native import guard as _guard

if TYPE_CHECKING:
    from tensora.config.catalog import default_catalog, load_catalog
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
    from tensora.placement.catalog import Catalog, ComputeClass, Kind
    from tensora.sdk import AsyncClient, Client

__version__ = "0.1.0"

_guard()  # before any compiled module is imported: a stale build never runs (tensora.native)

_WHERE = {
    "tensora.errors": ("CatalogError", "ConfigError", "FleetError", "ModelFileError", "SpecError", "TensoraError"),
    "tensora.placement.admission": ("Decision", "Place", "Policy", "Promote", "Queued", "RestartAvailable",
                                    "Running", "Wait", "decide"),
    "tensora.placement.capacity": ("Capacity", "GpuReserve", "Node", "Placed"),
    "tensora.placement.catalog": ("Catalog", "ComputeClass", "Kind"),
    "tensora.config.catalog": ("default_catalog", "load_catalog"),
    "tensora.sdk": ("AsyncClient", "Client"),
}
_MODULE_OF = {name: module for module, names in _WHERE.items() for name in names}

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
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module 'tensora' has no attribute {name!r}")
    value = getattr(import_module(module), name)
    globals()[name] = value  # once: later lookups are plain attribute reads
    return value


def __dir__() -> list[str]:
    return [*globals(), *__all__]
