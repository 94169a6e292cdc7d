"""What ``tensora up`` says about the model-server runtimes as it starts, and about the workloads it leaves
running as it stops."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import NamedTuple

from tensora.drivers.base import Driver, ReplicaStatus
from tensora.drivers.endpoints import PORTABLE  # serves every class kind: installed, no endpoint lacks a runtime
from tensora.placement.kinds import ReplicaState, WorkloadKind

INSTALL = f"tensora runtime install {PORTABLE}"


def installed_runtimes(driver: Driver, auto_install: bool) -> str:
    """``tensora up``'s line on the model-server runtimes of ``driver`` (``runtimes_line``)."""
    from tensora.models import runtimes

    root = getattr(driver, "runtimes", None)
    if root is None:
        return "runtimes: not this driver's"
    return runtimes_line(root, [name for name in runtimes.REGISTRY if runtimes.installed(root, name)], auto_install)


def runtimes_line(root: Path, have: Sequence[str], auto_install: bool) -> str:
    """Which runtimes are installed and, only where an endpoint could find none for its class, what happens then:
    the first one installs the portable runtime (``auto_install``), or it fails, saying how to install it."""
    line = f"runtimes installed: {', '.join(have) or 'none'} (in {root})"
    if PORTABLE in have:
        return line
    if not have:
        then = ("the first endpoint that needs one installs it" if auto_install
                else f"an endpoint without one fails: {INSTALL}")
    else:
        then = (f"an endpoint none of them serves installs {PORTABLE} first" if auto_install
                else f"an endpoint none of them serves fails: {INSTALL}")
    return f"{line}; {then}"


class Named(NamedTuple):
    """A workload as the banner names it."""

    name: str
    kind: WorkloadKind


def adopted(replicas: Sequence[ReplicaStatus], names: Mapping[str, Named]) -> str | None:
    """``tensora up``'s line on the replicas a previous run left running, adopted now: how many, and whose (by
    workload id in ``names``; one it lacks by its id). None: nothing was left running."""
    alive = [r for r in replicas if r.state in (ReplicaState.STARTING, ReplicaState.RUNNING)]
    if not alive:
        return None
    count: dict[str, int] = {}
    for r in alive:
        count[r.workload_id] = count.get(r.workload_id, 0) + 1
    said = []
    for wid, n in count.items():
        named = names.get(wid)
        if named is None:
            said.append(wid)
            continue
        more = f", {n} replicas" if n > 1 else ""
        said.append(f"{named.name} ({named.kind.value}{more})")
    return f"adopted {_count(len(alive), 'running replica')}: {', '.join(said)}"


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
