"""One launcher per kind of local replica (notebook, VM, endpoint), behind one small protocol.

A launcher knows what its kind runs and how it behaves (``drivers.notebooks``, ``drivers.vms``,
``drivers.endpoints``); a runner knows how a launch runs (``drivers.runners``: in a sandbox, or as a process);
the local driver (``drivers.local``) composes them and keeps the records (``drivers.record``). What every kind
shares stays in the driver: the GPUs and cores it claims, the sandbox's devices, the replica's ``out.log``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from tensora.drivers import loopback
from tensora.drivers.base import ReplicaSpec
from tensora.drivers.launch import Launch, LaunchError
from tensora.drivers.record import Records, ReplicaRecord
from tensora.placement.catalog import ComputeClass

PROBE_TIMEOUT_S = 0.5
"""How long a readiness probe waits for its answer (``observe`` must not block the controller)."""


@dataclass(frozen=True, slots=True)
class LogFile:
    """A log a replica writes, and where the part cut off (``drivers.logcap``) is kept."""

    path: Path
    rotated: Path


class Launcher(Protocol):
    """What the local driver needs of one kind of replica."""

    def launch(self, spec: ReplicaSpec, record: ReplicaRecord, cls: ComputeClass) -> Launch:
        """What the replica runs (in a sandbox where ``record.sandbox``), noting in ``record`` what it was given
        (its address and port, URL, token, socket). LaunchError (or ``ImageRefused``, ``ModelFileError``,
        OSError) says why it cannot start."""
        ...

    def ready(self, record: ReplicaRecord) -> bool:
        """Whether the starting replica answers (its probe)."""
        ...

    def ask_to_stop(self, record: ReplicaRecord) -> bool:
        """Ask the replica to end its own way; False where its kind has none (the driver sends SIGTERM)."""
        ...

    def urge_to_stop(self, record: ReplicaRecord, waited: float) -> None:
        """The replica runs on ``waited`` seconds after it was asked to stop (the driver kills it past its
        grace)."""
        ...

    def logs(self, record: ReplicaRecord) -> Sequence[LogFile]:
        """The replica's logs of its kind, besides the ``out.log`` of every replica."""
        ...

    def over_bound(self, record: ReplicaRecord, now: float) -> str | None:
        """Why the running replica must stop (it passed a bound of its kind), else None."""
        ...

    def release(self, workload_id: str, ended: Sequence[ReplicaRecord]) -> None:
        """Remove what the deleted workload's replicas (``ended``: those of its kind) left."""
        ...


class NoStopHooks:
    """The hooks a kind that stops on SIGTERM alone, keeps no logs of its own and has no bound leaves as they are
    (a launcher subclasses it and overrides what its kind has)."""

    def ask_to_stop(self, record: ReplicaRecord) -> bool:
        return False

    def urge_to_stop(self, record: ReplicaRecord, waited: float) -> None:
        return None

    def logs(self, record: ReplicaRecord) -> Sequence[LogFile]:
        return ()

    def over_bound(self, record: ReplicaRecord, now: float) -> str | None:
        return None


class Origins:
    """Each replica that serves HTTP gets a loopback address of its own (``drivers.loopback``), none a live
    replica has, and a free port there, avoiding the ports sandboxes reach Tensora's servers on."""

    def __init__(self, records: Records, avoid_ports: Sequence[int]) -> None:
        self.records = records
        self.avoid_ports = tuple(avoid_ports)

    def claim(self, record: ReplicaRecord) -> tuple[loopback.Origin, int]:
        """The replica's own host and a free port there, noted in ``record``."""
        taken = {h for r in self.records.live() if r.id != record.id for h in (r.address, r.host) if h}
        try:
            origin = loopback.choose(record.id, taken, loopback.bindable)
        except loopback.NoAddress as exc:
            raise LaunchError(str(exc)) from None
        port = loopback.free_port(origin.address, self.avoid_ports)
        record.address, record.host, record.port = origin.address, origin.host, port
        return origin, port


def readable_by_others(path: Path, what: str) -> None:
    """LaunchError unless every file of ``path`` (a model, a disk image) is readable by any uid (the sandbox runs
    as the owner's, and owners' uploads are written 0644); names the first that is not, relative to ``path``,
    after ``what``."""
    paths = [path] if path.is_file() else [path, *sorted(path.rglob("*"))]
    for p in paths:
        mode = p.stat().st_mode
        need = 0o005 if p.is_dir() else 0o004
        if mode & need != need:
            name = p.relative_to(path) if p != path else path.name
            raise LaunchError(f"{what} {name} is not readable by the sandbox (mode {mode & 0o777:o}, "
                              "not readable by others)", permanent=True)


def private_dir(path: Path) -> Path:
    """A dir only Tensora's user may enter (its files may hold secrets)."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    if path.stat().st_mode & 0o077:
        path.chmod(0o700)
    return path
