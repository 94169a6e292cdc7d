"""What ``tensora up`` says as it starts: the runtimes installed (and, only where an endpoint could lack one, what
then happens), and the replicas a previous run left running that it adopted."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from tensora.drivers.base import ReplicaStatus
from tensora.placement.kinds import ReplicaState, WorkloadKind
from tensora.serving.banner import Named, adopted, runtimes_line

ROOT = Path("/data/runtimes")


@dataclass(frozen=True)
class Runtimes:
    have: tuple[str, ...]
    auto_install: bool
    want: str


RUNTIMES = {
    "none, auto-install -> the first endpoint installs one": Runtimes(
        (), True, "runtimes installed: none (in /data/runtimes); the first endpoint that needs one installs it"),
    "none, no auto-install -> how to install one": Runtimes(
        (), False, "runtimes installed: none (in /data/runtimes); an endpoint without one fails: "
                   "tensora runtime install tensora-transformers"),
    "the portable one installed -> every endpoint has one: no hint": Runtimes(
        ("tensora-transformers",), True, "runtimes installed: tensora-transformers (in /data/runtimes)"),
    "the portable one installed, no auto-install -> no hint": Runtimes(
        ("tensora-transformers",), False, "runtimes installed: tensora-transformers (in /data/runtimes)"),
    "only a CPU one -> an endpoint it does not serve installs the portable one": Runtimes(
        ("tensora-vllm-cpu",), True, "runtimes installed: tensora-vllm-cpu (in /data/runtimes); an endpoint none "
                                     "of them serves installs tensora-transformers first"),
    "only a CPU one, no auto-install -> how to install the portable one": Runtimes(
        ("tensora-vllm-cpu",), False, "runtimes installed: tensora-vllm-cpu (in /data/runtimes); an endpoint none "
                                      "of them serves fails: tensora runtime install tensora-transformers"),
}


@pytest.mark.parametrize("case", RUNTIMES.values(), ids=RUNTIMES.keys())
def test_the_runtimes_line(case: Runtimes) -> None:
    assert runtimes_line(ROOT, case.have, case.auto_install) == case.want


def _replica(rid: str, workload: str, state: ReplicaState = ReplicaState.RUNNING) -> ReplicaStatus:
    return ReplicaStatus(rid, workload, "cpu-1c-4g", "box", state)


NAMES = {"wl_nb": Named("nb", WorkloadKind.NOTEBOOK), "wl_box": Named("box", WorkloadKind.VM),
         "wl_ep": Named("chat", WorkloadKind.ENDPOINT)}

ADOPTED = {
    "nothing left running -> no line": ([], None),
    "only stopped and failed replicas -> no line": (
        [_replica("rp_1", "wl_nb", ReplicaState.STOPPED), _replica("rp_2", "wl_box", ReplicaState.FAILED)], None),
    "a notebook and a VM -> both named": (
        [_replica("rp_1", "wl_nb"), _replica("rp_2", "wl_box")],
        "adopted 2 running replicas: nb (notebook), box (vm)"),
    "one replica -> singular": ([_replica("rp_1", "wl_box")], "adopted 1 running replica: box (vm)"),
    "an endpoint's two replicas, one starting -> named once, with its count": (
        [_replica("rp_1", "wl_ep"), _replica("rp_2", "wl_ep", ReplicaState.STARTING), _replica("rp_3", "wl_nb")],
        "adopted 3 running replicas: chat (endpoint, 2 replicas), nb (notebook)"),
    "a workload the store no longer has -> its id": (
        [_replica("rp_1", "wl_gone")], "adopted 1 running replica: wl_gone"),
}


@pytest.mark.parametrize("case", ADOPTED.values(), ids=ADOPTED.keys())
def test_the_adopted_line(case: tuple[list[ReplicaStatus], str | None]) -> None:
    replicas, want = case
    assert adopted(replicas, NAMES) == want
