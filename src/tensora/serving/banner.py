"""What ``tensora up`` says about the model-server runtimes as it starts, and about the workloads it leaves
running as it stops."""

from __future__ import annotations

from collections.abc import Sequence

from tensora.drivers.base import Driver, ReplicaStatus
from tensora.placement.kinds import ReplicaState


def installed_runtimes(driver: Driver, auto_install: bool) -> str:
    """``tensora up``'s line on the model-server runtimes: which are installed, and what happens without one."""
    from tensora.models import runtimes

    root = getattr(driver, "runtimes", None)
    if root is None:
        return "runtimes: not this driver's"
    have = [name for name in runtimes.REGISTRY if runtimes.installed(root, name)]
    then = ("the first endpoint that needs one installs it" if auto_install
            else "an endpoint without one fails: tensora runtime install tensora-transformers")
    return f"runtimes installed: {', '.join(have) or 'none'} (in {root}); {then}"


def left_running(replicas: Sequence[ReplicaStatus]) -> str:
    """What ``tensora up`` says as it stops: the workloads whose replicas keep running without it."""
    alive = [r for r in replicas if r.state in (ReplicaState.STARTING, ReplicaState.RUNNING)]
    stopping = sum(1 for r in replicas if r.state is ReplicaState.STOPPING)
    workloads = len({r.workload_id for r in alive})
    if not alive:
        text = "stopped the API and gateway; no workloads are running"
    else:
        text = (f"stopped the API and gateway; {_count(workloads, 'workload')} "
                f"{'keeps' if workloads == 1 else 'keep'} running ({_count(len(alive), 'replica')}): "
                "the next `tensora up` adopts them; to stop them, start it and run "
                "`tensora workloads stop NAME`")
    if stopping:
        text += f" ({_count(stopping, 'replica')} still stopping: the next `tensora up` sees it through)"
    return text


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"
