"""Test doubles of Tensora's protocols, type-checked against them: mypy covers tests/support, and each double is
assigned to its protocol below, so one that lacks a method (or has it with another signature) fails ``mypy``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from tensora.drivers.base import Driver, ReplicaSpec, ReplicaStatus
from tensora.drivers.simulated import SimulatedDriver
from tensora.placement.capacity import Node


class Crash(BaseException):
    """The process dies here (not an Exception: nothing in the controller catches it)."""


class CrashingDriver:
    """The simulated fleet, but the controller 'dies' on the first start() it asks for."""

    def __init__(self, inner: SimulatedDriver) -> None:
        self.inner, self.armed = inner, True

    def nodes(self) -> Sequence[Node]:
        return self.inner.nodes()

    def observe(self) -> Sequence[ReplicaStatus]:
        return self.inner.observe()

    def stop(self, replica_id: str) -> ReplicaStatus:
        return self.inner.stop(replica_id)

    def start(self, spec: ReplicaSpec) -> ReplicaStatus:
        if self.armed:
            self.armed = False
            raise Crash("killed between recording the placement and starting it")
        return self.inner.start(spec)

    def release(self, workload_id: str) -> None:  # it had none: a Driver gives back a deleted workload's storage
        self.inner.release(workload_id)

    def prune(self, ended_before: float) -> int:
        return self.inner.prune(ended_before)


if TYPE_CHECKING:
    _driver: type[Driver] = CrashingDriver
