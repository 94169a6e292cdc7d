"""An endpoint replica of the local driver: a model server from the runtime registry (``models.runtimes``).

The server runs on a free port of the replica's own address, its model read-only at ``/model`` (the name it
answers to, reported as ``served_model``); ready when ``/v1/models`` answers. A runtime that takes an API key
gets the replica's (``replicakeys``, in its environment): only the gateway and this probe send it.

Without an installed runtime the replica fails with a reason that says which to install; with ``auto_install``
it waits, starting, while the portable runtime installs in the background (``runtimes.Background``): the
launcher raises :class:`Installing`, and the driver starts the replica once the install is done.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import httpx

from tensora.drivers import launch
from tensora.drivers.base import ReplicaSpec
from tensora.drivers.launch import Launch, LaunchError, PythonEnv
from tensora.drivers.launcher import PROBE_TIMEOUT_S, NoStopHooks, Origins, readable_by_others
from tensora.drivers.record import Records, ReplicaRecord
from tensora.keys import replicakeys
from tensora.models import runtimes
from tensora.placement.catalog import ComputeClass

PORTABLE = "tensora-transformers"
"""The runtime installed for an endpoint that finds none: every kind's fallback (CPU, CUDA, MPS)."""


class Installing(Exception):
    """The endpoint's runtime is installing in the background: the replica waits (the message says how far)."""

    def __init__(self, runtime: str, progress: str) -> None:
        super().__init__(progress or f"installing runtime {runtime}")
        self.runtime = runtime


class EndpointLauncher(NoStopHooks):
    """A model server from the runtimes installed in ``runtimes_dir``; ``installs`` installs the portable one
    where none is and ``auto_install`` says so. ``replica_secret`` derives each replica's API key."""

    def __init__(self, records: Records, origins: Origins, runtimes_dir: Path, installs: runtimes.Background,
                 replica_secret: bytes, *, auto_install: bool = False) -> None:
        self.records = records
        self.origins = origins
        self.runtimes = runtimes_dir
        self.installs = installs
        self.replica_secret = replica_secret
        self.auto_install = auto_install

    def launch(self, spec: ReplicaSpec, record: ReplicaRecord, cls: ComputeClass) -> Launch:
        sandboxed = record.sandbox
        kind = "metal" if (cls.gpu_model or "").upper().endswith("METAL") else ("cpu" if cls.is_cpu else "gpu")
        runtime = runtimes.choose(self.runtimes, kind)
        if runtime is None and self.auto_install:
            name = PORTABLE
            self.installs.want(name)
            raise Installing(name, self.installs.state(name)[1])
        if runtime is None:
            raise LaunchError(f"no model runtime is installed for {kind} endpoints in {self.runtimes}: "
                              "tensora runtime install tensora-transformers", permanent=True)
        if not spec.model:
            raise LaunchError("an endpoint needs a model", permanent=True)
        if not os.path.exists(spec.model):
            raise LaunchError("the endpoint's model is not in its owner's storage any more", permanent=True)
        if sandboxed:
            readable_by_others(Path(spec.model), "the model's")
        venv = runtimes.venv_dir(self.runtimes, runtime.name)
        env = PythonEnv(str(venv), str(runtimes.base_prefix(venv) or venv), str(venv / "bin" / "python"))
        origin, port = self.origins.claim(record)
        launched = launch.endpoint(runtime, env, spec.model, spec.workload_id, port, kind, cls, record.gpus,
                                   self.records.dir(spec.id), sandboxed=sandboxed, api_key=self.api_key(spec.id),
                                   address=origin.address)
        # the gateway's route: the address (the gateway resolves no *.localhost name), never a browser's page
        record.url, record.runtime = origin.connect_url(port, "/v1"), runtime.name
        record.served_model, record.detail = launched.served_model, f"runtime {runtime.name}"
        return launched

    def api_key(self, replica_id: str) -> str:
        return replicakeys.derive(self.replica_secret, replica_id)

    def ready(self, record: ReplicaRecord) -> bool:
        try:  # a model server that takes no key ignores it
            r = httpx.get(f"{record.url}/models", timeout=PROBE_TIMEOUT_S,
                          headers={"Authorization": f"Bearer {self.api_key(record.id)}"})
        except httpx.HTTPError:
            return False
        return r.status_code == 200

    def release(self, workload_id: str, ended: Sequence[ReplicaRecord]) -> None:
        return None
