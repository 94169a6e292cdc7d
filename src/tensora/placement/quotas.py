"""An owner's running quotas as admission reads them: plain values, validated where they are read (the server
config and the owners API, :mod:`tensora.config.quotas`)."""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_RUNNING_GPUS = 2
"""GPUs of GPU classes an owner's running replicas may hold, where neither the config nor an admin says."""
DEFAULT_RUNNING_CPU = 32
"""vCPUs of CPU classes an owner's running replicas may hold, where neither the config nor an admin says."""


@dataclass(frozen=True, slots=True)
class RunningQuotas:
    """What an owner's running replicas may hold: ``running_gpus`` GPUs of GPU classes, ``running_cpu`` vCPUs of
    CPU classes (a GPU class's host vCPUs come with its GPUs, which ``running_gpus`` already bounds)."""

    running_gpus: int = DEFAULT_RUNNING_GPUS
    running_cpu: float = DEFAULT_RUNNING_CPU
