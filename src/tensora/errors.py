"""Tensora's one exception tree.

Foreign exceptions (YAML, pydantic, OS errors while reading files) are converted
once, where they arise, into these; the rest of the code never catches a foreign one.

    TensoraError
    ├── ConfigError            a file or value an operator or user wrote is wrong
    │   ├── CatalogError       the compute-class catalog (file, line, class, field)
    │   ├── FleetError         a nodes.yaml / workloads.yaml of the simulated fleet
    │   └── SpecError          a workload's create body (field named)
    ├── ModelFileError         a model file or directory that is not valid safetensors
    ├── SandboxError           a replica's OCI sandbox could not be made, started or removed (sandbox.runc)
    ├── NetworkError           a sandbox's network namespace or its pasta (sandbox.network)
    ├── ImageRefused           a VM's disk image: not raw or qcow2, a backing or data file outside the owner's
    │                          files, or qemu-img could not read it (drivers.vmdisk)
    ├── StorageError           owners' files (storage): BadName, NotFound (one message), OverQuota, NameTaken
    ├── UidsExhausted          no sandbox uid left in the sandbox_uids range (store.uids)
    ├── QuotaExceeded          an owner already holds its quota of keys or workloads (control.owners)
    ├── Occupied               tensora up: already running, or its port taken by another program (serving.ports)
    └── StoreError             the database
        ├── StoreUnavailable   unreachable, locked, timed out: retry later (the API answers 503)
        └── Conflict           a write lost a race with another (unique key, changed row)

"Does not fit" is never an exception: admission returns it as a value (Wait).

At the top of the package: every layer raises from this one tree, and it imports nothing.
"""

from __future__ import annotations


class TensoraError(Exception):
    """Base of every error Tensora raises on purpose."""


class ConfigError(TensoraError):
    """Something a person wrote is wrong; the message names where and which field.

    ``source`` is the file (or "<api>" for a request body), ``line`` is 1-based when
    known, ``field`` is a dotted path such as ``classes[3].gpu.count``.
    """

    def __init__(
        self, message: str, *, source: str | None = None, line: int | None = None, field: str | None = None
    ) -> None:
        self.message = message
        self.source = source
        self.line = line
        self.field = field
        super().__init__(self._render())

    def _render(self) -> str:
        where = ""
        if self.source:
            where = self.source + (f":{self.line}" if self.line else "")
        parts = [p for p in (where, self.field) if p]
        prefix = ": ".join(parts)
        return f"{prefix}: {self.message}" if prefix else self.message


class CatalogError(ConfigError):
    """The compute-class catalog is invalid."""


class FleetError(ConfigError):
    """A simulated-fleet file (nodes or workloads) is invalid."""


class SpecError(ConfigError):
    """A workload specification is invalid."""


class ModelFileError(TensoraError):
    """A model file is missing, truncated, not safetensors, or has a hostile header."""

    def __init__(self, path: str, message: str) -> None:
        self.path = path
        self.message = message
        super().__init__(f"{path}: {message}")


class StoreError(TensoraError):
    """The database failed; SQLAlchemy's exceptions become these in ``store.db.translate``."""


class StoreUnavailable(StoreError):
    """The database cannot be reached now (down, locked, pool exhausted): retry later."""

    retry_after_s = 2


class Conflict(StoreError):
    """A write lost a race (unique constraint, or a row changed under it)."""
