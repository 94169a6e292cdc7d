"""Drivers: side effects on real (or simulated) resources behind one small protocol."""

from tensora.drivers.base import Driver, ReplicaSpec, ReplicaStatus
from tensora.drivers.simulated import SimulatedDriver

__all__ = ["Driver", "ReplicaSpec", "ReplicaStatus", "SimulatedDriver"]
