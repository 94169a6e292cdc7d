"""Tensora: a free GPU cloud with opt-in, explicit and visible fallbacks."""

from tensora.admission import Decision, Place, Policy, Promote, Queued, RestartAvailable, Running, Wait, decide
from tensora.capacity import Capacity, GpuReserve, Node, Placed
from tensora.catalog import Catalog, ComputeClass, Kind, default_catalog, load_catalog
from tensora.errors import CatalogError, ConfigError, FleetError, ModelFileError, SpecError, TensoraError

__version__ = "0.1.0"

__all__ = [
    "Capacity",
    "Catalog",
    "CatalogError",
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
