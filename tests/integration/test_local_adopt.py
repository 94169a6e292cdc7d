"""A local driver adopts the replicas an older one recorded: its ``replica.json`` as written before the record was
a typed value (``tests.support.replica_records``), byte for byte but for the live process it names. A running
replica is reported, not started again, and stopped by its recorded process; ended ones are pruned; what is
written back keeps the format."""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tensora.config.catalog import default_catalog
from tensora.drivers.base import ReplicaSpec
from tensora.drivers.local import Isolation, LocalDriver
from tensora.drivers.runners import proc_start
from tensora.placement.capacity import Node
from tensora.placement.kinds import ReplicaState, WorkloadKind
from tests.support.replica_records import WRITTEN_BEFORE

NODE = Node("box", "local", 4, 16 << 30)
RUNNING = WRITTEN_BEFORE["a running notebook, run as a process"]
STOPPED = WRITTEN_BEFORE["a notebook stopped"]


@pytest.fixture
def stand_in() -> Iterator[subprocess.Popen[bytes]]:
    """The recorded notebook's process: one that leads a session of its own, as the driver starts them."""
    proc = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait()


def recorded(data: Path, replica_id: str, text: str) -> Path:
    d = data / "replicas" / replica_id
    d.mkdir(parents=True, mode=0o700)
    (d / "replica.json").write_text(text)
    return d / "replica.json"


def test_a_running_replica_recorded_before_is_adopted_and_stopped(tmp_path: Path,
                                                                  stand_in: subprocess.Popen[bytes]) -> None:
    start = proc_start(stand_in.pid)
    text = RUNNING.replace('"pid": 6515, "proc_start": 1155255', f'"pid": {stand_in.pid}, "proc_start": {start}')
    assert text != RUNNING
    path = recorded(tmp_path / "data", "rp_nb1", text)
    driver = LocalDriver(tmp_path / "data", NODE, default_catalog(), isolation=Isolation.NONE)
    [seen] = driver.observe()
    assert (seen.id, seen.workload_id, seen.state) == ("rp_nb1", "wl_nb1", ReplicaState.RUNNING)
    assert seen.url == json.loads(RUNNING)["url"]
    spec = ReplicaSpec("rp_nb1", "wl_nb1", WorkloadKind.NOTEBOOK, "cpu-1c-4g", "box", owner="alice")
    assert driver.start(spec).state is ReplicaState.RUNNING  # adopted: not started a second time
    assert path.read_text() == text  # nothing to write back yet
    assert driver.stop("rp_nb1").state is ReplicaState.STOPPING
    deadline = time.monotonic() + 10
    while (seen := driver.observe()[0]).state is not ReplicaState.STOPPED:
        assert time.monotonic() < deadline, seen
        time.sleep(0.05)
    assert stand_in.wait(5) == -15 and seen.detail == "stopped"  # its recorded process got the SIGTERM
    after, before = json.loads(path.read_text()), json.loads(STOPPED)
    assert list(after) == list(before)  # the same keys in the same order as an older driver writes them
    changed = {k for k in after if after[k] != before[k]}
    assert changed == {"pid", "proc_start", "stop_requested_at", "ended_at"}


def test_replicas_that_ended_before_are_reported_pruned_and_released(tmp_path: Path) -> None:
    data = tmp_path / "data"
    for name, replica_id in (("a VM stopped", "rp_vm1"), ("an endpoint failed for good (no runtime installed)",
                                                         "rp_ep1"), ("a notebook stopped", "rp_nb1")):
        recorded(data, replica_id, WRITTEN_BEFORE[name])
    driver = LocalDriver(data, NODE, default_catalog(), isolation=Isolation.NONE)
    assert {r.id: r.state for r in driver.records.all()} == {
        "rp_ep1": ReplicaState.FAILED, "rp_nb1": ReplicaState.STOPPED, "rp_vm1": ReplicaState.STOPPED}
    failed = driver.records.read("rp_ep1")
    assert failed is not None and failed.status().permanent
    assert driver.access("rp_vm1")["console"] == json.loads(WRITTEN_BEFORE["a VM stopped"])["console"]
    driver.release("wl_vm1")
    ended = sorted(json.loads(text)["ended_at"] for text in WRITTEN_BEFORE.values() if json.loads(text)["ended_at"])
    assert driver.prune(ended[0]) == 1 and not (data / "replicas" / "rp_ep1").exists()  # the first that ended
    assert driver.prune(ended[-1]) == 2 and list((data / "replicas").iterdir()) == []
