"""A local replica's record: what it is, what it was given (port, token, GPUs) and what became of it.

Kept as ``DATA_DIR/replicas/<id>/replica.json`` (0600: it holds a notebook's token), the only state of the local
driver that outlives ``tensora up``: a new driver on the same data dir adopts the replicas its records name. The
JSON keeps its key names and order across versions, so a record written by an older Tensora is adopted by a newer
one (and the reverse): every key of :data:`ALWAYS` is always written, each of :data:`WHEN_SET` only once it holds
something.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tensora.drivers.base import ReplicaSpec, ReplicaStatus
from tensora.placement.kinds import ReplicaState, WorkloadKind

ENDED = (ReplicaState.STOPPED, ReplicaState.FAILED)
RECORD_FILE = "replica.json"

ALWAYS = ("id", "workload_id", "kind", "cls", "node", "owner", "model", "image", "sandbox", "uid", "state", "pid",
          "proc_start", "port", "address", "host", "token", "url", "socket", "console", "served_model", "detail",
          "started_at", "stop_requested_at", "ended_at", "gpus", "cpuset", "oom_kills")
"""The keys every ``replica.json`` holds, in the order they are written."""
WHEN_SET = ("home_mounted", "runtime", "installing", "home_measured_at", "bound", "permanent", "sandbox_left")
"""The keys written only where they hold something (not None; ``sandbox_left`` only while true), in the order a
replica's life sets them."""


@dataclass(slots=True)
class ReplicaRecord:
    """One replica of the local driver, as ``replica.json`` holds it. Mutable: the driver fills it in as the
    replica starts, runs and ends, and writes it back after each step."""

    id: str
    workload_id: str
    kind: WorkloadKind
    cls: str
    node: str
    state: ReplicaState
    owner: str = ""
    model: str | None = None
    image: str | None = None
    sandbox: bool = False
    """Run in a sandbox (runc), else as a process of Tensora's user."""
    uid: int | None = None
    pid: int | None = None
    proc_start: int | None = None
    """The process's start time (clock ticks since boot): tells a reused pid apart."""
    port: int | None = None
    address: str | None = None
    """Its own loopback address (``drivers.loopback``)."""
    host: str | None = None
    token: str | None = None
    """A notebook's JupyterLab token."""
    url: str | None = None
    socket: str | None = None
    """A VM's QMP socket (a host path)."""
    console: str | None = None
    served_model: str | None = None
    detail: str = ""
    started_at: float = 0.0
    stop_requested_at: float | None = None
    ended_at: float | None = None
    gpus: list[int] = field(default_factory=list)
    cpuset: list[int] = field(default_factory=list)
    oom_kills: int = 0
    """Processes of its sandbox killed for their memory limit, as last seen."""
    home_mounted: bool | None = None
    """A notebook's home is a file system of its own (else its size is measured)."""
    runtime: str | None = None
    """An endpoint's model-server runtime."""
    installing: str | None = None
    """The runtime an endpoint waits for, installing in the background."""
    home_measured_at: float | None = None
    bound: str | None = None
    """Why a notebook was stopped past its home's bound."""
    permanent: bool | None = None
    """Failed for a reason retrying cannot fix."""
    sandbox_left: bool = False
    """Its sandbox's delete failed: tried again on observe."""

    @classmethod
    def claim(cls, spec: ReplicaSpec, *, sandboxed: bool, now: float) -> ReplicaRecord:
        """A replica about to start: nothing given to it yet."""
        return cls(spec.id, spec.workload_id, spec.kind, spec.cls, spec.node, ReplicaState.STARTING, owner=spec.owner,
                   model=spec.model, image=spec.image, sandbox=sandboxed, uid=spec.uid, started_at=now)

    @property
    def ended(self) -> bool:
        return self.state in ENDED

    def status(self) -> ReplicaStatus:
        return ReplicaStatus(self.id, self.workload_id, self.cls, self.node, self.state, self.url, self.detail,
                             self.served_model, bool(self.permanent), self.detail if self.installing else "")

    def to_json(self) -> dict[str, Any]:
        """The JSON object of ``replica.json``: :data:`ALWAYS`, then what of :data:`WHEN_SET` holds something."""
        out: dict[str, Any] = {key: getattr(self, key) for key in ALWAYS}
        out["kind"], out["state"] = self.kind.value, self.state.value
        out["gpus"], out["cpuset"] = list(self.gpus), list(self.cpuset)
        for key in WHEN_SET:
            value = getattr(self, key)
            if value is not None and not (key == "sandbox_left" and not value):
                out[key] = value
        return out

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ReplicaRecord:
        """A record from ``replica.json`` as any version wrote it (ValueError if it is not one): a key an older
        version did not write yet takes its default."""
        try:
            values = {key: data[key] for key in (*ALWAYS, *WHEN_SET) if key in data}
            values["kind"], values["state"] = WorkloadKind(data["kind"]), ReplicaState(data["state"])
            values["sandbox_left"] = bool(data.get("sandbox_left"))
            values["gpus"], values["cpuset"] = list(data.get("gpus") or []), list(data.get("cpuset") or [])
            values["oom_kills"] = data.get("oom_kills") or 0
            return cls(**values)
        except (KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"not a replica record: {exc}") from None


class Records:
    """The records under ``root``, one dir per replica (which holds its log and a VM's files too)."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def dir(self, replica_id: str) -> Path:
        return self.root / replica_id

    def read(self, replica_id: str) -> ReplicaRecord | None:
        """The replica's record; None where there is none (or none that can be read)."""
        data = self.read_json(replica_id)
        if data is None:
            return None
        try:
            return ReplicaRecord.from_json(data)
        except ValueError:
            return None

    def read_json(self, replica_id: str) -> dict[str, Any] | None:
        """``replica.json`` as it is on disk."""
        try:
            data: dict[str, Any] = json.loads((self.root / replica_id / RECORD_FILE).read_text())
            return data
        except (OSError, ValueError):
            return None

    def write(self, record: ReplicaRecord) -> None:
        """``replica.json``, 0600 (it holds a notebook's token), replaced whole."""
        path = self.root / record.id / RECORD_FILE
        tmp = path.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            os.fchmod(fd, 0o600)
            f.write(json.dumps(record.to_json()))
        os.replace(tmp, path)

    def all(self) -> list[ReplicaRecord]:
        records = [self.read(d.name) for d in sorted(self.root.iterdir())]
        return [r for r in records if r is not None]

    def live(self) -> list[ReplicaRecord]:
        return [r for r in self.all() if not r.ended]
