"""``drivers.launcher``: each kind's launcher says how its replica is asked to stop and which logs of its own it
writes; the local driver does the rest (SIGTERM where a kind has no way of its own, SIGKILL past the grace)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tensora.drivers import vms
from tensora.drivers.base import ReplicaSpec
from tensora.drivers.endpoints import EndpointLauncher
from tensora.drivers.launcher import Launcher, LogFile, Origins
from tensora.drivers.notebooks import NotebookLauncher
from tensora.drivers.record import Records, ReplicaRecord
from tensora.drivers.vms import VM_POWERDOWN_S, VmLauncher
from tensora.models import runtimes
from tensora.placement.kinds import WorkloadKind


def launchers(root: Path) -> dict[WorkloadKind, Launcher]:
    records = Records(root)
    origins = Origins(records, [])
    return {WorkloadKind.NOTEBOOK: NotebookLauncher(records, origins, root / "work"),
            WorkloadKind.VM: VmLauncher(records, root / "files", {}, {}, root / "sys", root / "dev"),
            WorkloadKind.ENDPOINT: EndpointLauncher(records, origins, root / "runtimes",
                                                    runtimes.Background(root / "runtimes"), b"secret")}


def record(kind: WorkloadKind, socket: str | None = None) -> ReplicaRecord:
    r = ReplicaRecord.claim(ReplicaSpec("rp_1", "wl_1", kind, "cpu-1c-4g", "box"), sandboxed=True, now=0.0)
    r.socket = socket
    return r


@dataclass(frozen=True)
class Stop:
    kind: WorkloadKind
    socket: str | None
    waited: float | None  # None: the ask itself; else the urge this long after it
    own_way: bool
    qmp: list[str]


STOPS = {
    "a VM is powered down over QMP": Stop(WorkloadKind.VM, "/run/qmp.sock", None, True, ["system_powerdown"]),
    "a VM without its socket yet is signalled": Stop(WorkloadKind.VM, None, None, False, []),
    "a notebook is signalled": Stop(WorkloadKind.NOTEBOOK, None, None, False, []),
    "an endpoint is signalled": Stop(WorkloadKind.ENDPOINT, None, None, False, []),
    "a VM within its power-down time is left to it": Stop(WorkloadKind.VM, "/run/qmp.sock", VM_POWERDOWN_S, True, []),
    "a VM past its power-down time is quit": Stop(WorkloadKind.VM, "/run/qmp.sock", VM_POWERDOWN_S + 0.1, True,
                                                  ["quit"]),
}


@pytest.mark.parametrize("case", STOPS.values(), ids=STOPS.keys())
def test_how_each_kind_is_asked_to_stop(case: Stop, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    sent: list[str] = []

    def qmp(path: str, *commands: dict[str, Any], timeout: float = 2.0) -> list[Any]:
        assert path == case.socket
        sent.extend(c["execute"] for c in commands)
        raise OSError("the guest is gone")  # whatever QMP answers, the stop goes on

    monkeypatch.setattr(vms, "qmp", qmp)
    launcher = launchers(tmp_path)[case.kind]
    if case.waited is None:
        assert launcher.ask_to_stop(record(case.kind, case.socket)) is case.own_way
    else:
        launcher.urge_to_stop(record(case.kind, case.socket), case.waited)
    assert sent == case.qmp


def test_a_vm_writes_its_console_besides_its_out_log(tmp_path: Path) -> None:
    found = {kind: launcher.logs(record(kind)) for kind, launcher in launchers(tmp_path).items()}
    assert found == {WorkloadKind.NOTEBOOK: (), WorkloadKind.ENDPOINT: (),
                     WorkloadKind.VM: (LogFile(tmp_path / "rp_1" / "vm" / "console.log",
                                               tmp_path / "rp_1" / "console.log.1"),)}
