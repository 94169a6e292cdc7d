"""What an HTTP worker process of ``tensora serve --workers N`` (and of ``tensora up``) is handed as it starts.

uvicorn's supervisor starts each worker with multiprocessing's spawn: the worker's app factory and its arguments
are pickled to it through a pipe, never through its argv or its environment. So the settings (the database URL
among them) travel as the factory's argument, a :class:`WorkerBrief`; nothing is written into this process's
environment, which every other child (the gateway, runtime installs) would inherit.
"""

from __future__ import annotations

from dataclasses import dataclass

from tensora.config.settings import ServeSettings


@dataclass(frozen=True, slots=True)
class WorkerBrief:
    """The argument of an HTTP worker's app factory (``tensora.serve.worker_app``)."""

    settings_json: str
    """The server's settings (:func:`worker_settings_json`): validated again in the worker."""
    supervisor_pid: int
    """The supervisor's pid: a worker whose parent is no longer it exits at once (it died while this one started)."""
    controller_holder: str | None
    """The lease holder name of the controller in the supervisor, whose lead the worker reports; None: none runs
    there."""
    gateway_metrics_listen: str
    """The gateway's metrics listener, which the operator page reads ("" when there is none)."""

    def settings(self) -> ServeSettings:
        return ServeSettings.model_validate_json(self.settings_json)


def worker_settings_json(settings: ServeSettings) -> str:
    """The settings as the HTTP workers read them back: the older ``storage_quota`` folded into
    ``quotas.storage_bytes``, so that they validate again (a dump holds every field of ``quotas``, and the two
    names together are refused)."""
    folded = settings.model_copy(update={"quotas": settings.owner_defaults().quotas, "storage_quota": None})
    return folded.model_dump_json()
