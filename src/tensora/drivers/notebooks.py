"""A notebook replica of the local driver: JupyterLab, its home and its token.

JupyterLab listens on 127.0.0.1 and a free port in its sandbox, published on the replica's own address (bound
there directly when not sandboxed), its token in its environment; ready when ``/api/status`` answers. Its files
are in ``DATA_DIR/workdirs/<workload id>/`` (owned by the owner's uid), kept across the workload's restarts and
removed by ``release`` once it is deleted: a file system of its own of ``home_size`` (``drivers.homes``), or,
where none can be mounted, measured every ``HOME_CHECK_S`` and the notebook stopped past it.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import re
import secrets
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path

import httpx

from tensora.drivers import homes, launch, loopback
from tensora.drivers.base import ReplicaSpec
from tensora.drivers.launch import Launch, LaunchError, PythonEnv
from tensora.drivers.launcher import PROBE_TIMEOUT_S, NoStopHooks, Origins, private_dir
from tensora.drivers.record import Records, ReplicaRecord
from tensora.placement.catalog import ComputeClass
from tensora.units import format_memory

log = logging.getLogger("tensora.drivers.local")

HOME_SIZE = 10 * 2**30
"""A notebook's home: the size of its file system (``drivers.homes``), or the bound measured where none can be
mounted."""
HOME_CHECK_S = 30.0
"""How often a measured home (no file system of its own) is measured."""


def tensora_env() -> PythonEnv:
    """Tensora's own Python environment (JupyterLab comes from it), and the installation it was made from."""
    python = sys.executable if sys.executable.startswith(sys.prefix + "/") else f"{sys.prefix}/bin/python3"
    return PythonEnv(sys.prefix, sys.base_prefix, python, f"{sys.version_info[0]}.{sys.version_info[1]}")


class NotebookLauncher(NoStopHooks):
    """JupyterLab from Tensora's own environment, its home in ``work`` (one dir per workload)."""

    def __init__(self, records: Records, origins: Origins, work: Path, home_size: int = HOME_SIZE) -> None:
        self.records = records
        self.origins = origins
        self.work = work
        self.home_size = home_size
        self.python = tensora_env()

    def launch(self, spec: ReplicaSpec, record: ReplicaRecord, cls: ComputeClass) -> Launch:
        if not _importable("jupyterlab"):
            raise LaunchError("JupyterLab is not installed: pip install 'tensora[notebook]'", permanent=True)
        sandboxed = record.sandbox
        d = self.records.dir(spec.id)
        origin, port = self.origins.claim(record)
        token = secrets.token_urlsafe(24)
        home, record.home_mounted = self._home(spec.workload_id, spec.uid if sandboxed else None, spec.gid)
        if not sandboxed:
            for name in ("config", "data", "runtime"):
                (d / "jupyter" / name).mkdir(parents=True, exist_ok=True)
        launched = launch.notebook(self.python, home, d, port, token, cls, record.gpus, sandboxed=sandboxed,
                                   as_root=os.geteuid() == 0, origin=origin)
        record.token, record.url = token, origin.url(port, f"/lab?token={token}")
        return launched

    def ready(self, record: ReplicaRecord) -> bool:
        try:
            address = record.address or loopback.TENSORA_HOST  # none: recorded before replicas had their own
            r = httpx.get(f"http://{address}:{record.port}/api/status", timeout=PROBE_TIMEOUT_S,
                          headers={"Authorization": f"token {record.token}"})
        except httpx.HTTPError:
            return False
        return r.status_code == 200

    def over_bound(self, record: ReplicaRecord, now: float) -> str | None:
        """Its home at its bound: why (the replica's reason), else None. A mounted home is full when its file
        system has no room left; a measured one is measured every ``HOME_CHECK_S``."""
        home = self.home_path(record.workload_id)
        if record.home_mounted:
            room = homes.room(home)
            return self._bound().full() if room is not None and room < homes.FULL_BELOW else None
        measured_at = record.home_measured_at if record.home_measured_at is not None else record.started_at
        if now - measured_at < HOME_CHECK_S:  # first: a check after start
            return None
        record.home_measured_at = now
        used = homes.usage(home)
        return f"{self._bound(False).full()} ({format_memory(used)} written): stopped" if used > self.home_size \
            else None

    def release(self, workload_id: str, ended: Sequence[ReplicaRecord]) -> None:
        """The workload's home, kept across its restarts until now."""
        homes.unmount(self.home_path(workload_id))
        shutil.rmtree(self.home_path(workload_id), ignore_errors=True)

    def home_path(self, workload_id: str) -> Path:
        if not re.fullmatch(r"[A-Za-z0-9_]+", workload_id):  # an id, never a path
            raise ValueError(f"not a workload id: {workload_id!r}")
        return self.work / workload_id

    def _home(self, workload_id: str, uid: int | None, gid: int | None) -> tuple[Path, bool]:
        """A notebook's files, kept across its restarts: owned by the owner's uid when sandboxed, on a file
        system of ``home_size`` of its own (``drivers.homes``); whether it is (else its size is measured)."""
        home = self.home_path(workload_id)
        private_dir(self.work)
        home.mkdir(mode=0o700, exist_ok=True)
        try:
            homes.mount(home, self.home_size, os.geteuid() if uid is None else uid,
                        os.getegid() if gid is None else gid)
            mounted = True
        except homes.NoBound as exc:
            log.warning("notebook home %s has no file system of its own (%s): its size is measured instead",
                        workload_id, exc)
            mounted = False
        except OSError as exc:  # an older, unbounded home that does not fit its bound
            raise LaunchError(f"{self._bound().full()} (what it held before does not fit: {exc.strerror})",
                              permanent=True) from None
        if uid is not None and gid is not None and home.stat().st_uid != uid:
            for where, dirs, files in os.walk(home):  # made by an earlier, unsandboxed run, or another uid
                for name in (where, *(os.path.join(where, n) for n in dirs + files)):
                    os.lchown(name, uid, gid)
        return home, mounted

    def _bound(self, mounted: bool = True) -> homes.HomeBound:
        return homes.HomeBound(self.home_size, mounted)


def _importable(module: str) -> bool:
    return importlib.util.find_spec(module) is not None
