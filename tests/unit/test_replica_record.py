"""``drivers.record``: a replica's ``replica.json`` read into a typed record and written back byte for byte as the
local driver always wrote it (key names, order, nulls); older records, missing keys written since, read with
defaults; a file that is no record is no record."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tensora.drivers.base import ReplicaSpec
from tensora.drivers.record import ALWAYS, Records, ReplicaRecord
from tensora.placement.kinds import ReplicaState, WorkloadKind
from tests.support.replica_records import WRITTEN_BEFORE


@pytest.mark.parametrize("text", WRITTEN_BEFORE.values(), ids=WRITTEN_BEFORE.keys())
def test_a_record_written_before_is_written_back_byte_for_byte(text: str, tmp_path: Path) -> None:
    record = ReplicaRecord.from_json(json.loads(text))
    assert json.dumps(record.to_json()) == text
    (tmp_path / record.id).mkdir()
    Records(tmp_path).write(record)
    assert (tmp_path / record.id / "replica.json").read_text() == text


def test_a_record_reads_into_its_types() -> None:
    vm = ReplicaRecord.from_json(json.loads(WRITTEN_BEFORE["a VM running in its sandbox"]))
    assert vm.kind is WorkloadKind.VM and vm.state is ReplicaState.RUNNING and not vm.ended
    assert (vm.sandbox, vm.uid, vm.cpuset, vm.gpus, vm.pid) == (True, 1001234, [1], [], 7581)
    assert vm.socket is not None and vm.socket.endswith("/vm/qmp.sock")
    failed = ReplicaRecord.from_json(json.loads(WRITTEN_BEFORE["an endpoint failed for good (no runtime installed)"]))
    status = failed.status()
    assert failed.ended and status.state is ReplicaState.FAILED and status.permanent
    assert status.detail.startswith("no model runtime is installed") and status.waiting == ""


OPTIONAL = {
    "nothing set since the claim": ({}, []),
    "a notebook's home measured": ({"home_mounted": False, "home_measured_at": 5.0}, ["home_mounted",
                                                                                       "home_measured_at"]),
    "an endpoint waiting for its runtime": ({"installing": "tensora-transformers"}, ["installing"]),
    "an endpoint with its runtime, failed": ({"runtime": "tensora-transformers", "permanent": False},
                                             ["runtime", "permanent"]),
    "a notebook stopped past its bound": ({"home_mounted": False, "home_measured_at": 5.0, "bound": "full"},
                                          ["home_mounted", "home_measured_at", "bound"]),
    "a sandbox left to delete": ({"sandbox_left": True}, ["sandbox_left"]),
    "a sandbox deleted at last": ({"sandbox_left": False}, []),
}


@pytest.mark.parametrize(("changes", "written"), OPTIONAL.values(), ids=OPTIONAL.keys())
def test_keys_set_later_are_written_once_set_after_the_others(changes: dict[str, object],
                                                              written: list[str]) -> None:
    spec = ReplicaSpec("rp_1", "wl_1", WorkloadKind.NOTEBOOK, "cpu-1c-4g", "box", owner="alice")
    record = ReplicaRecord.claim(spec, sandboxed=False, now=1.0)
    for name, value in changes.items():
        setattr(record, name, value)
    data = record.to_json()
    assert list(data) == [*ALWAYS, *written]
    assert ReplicaRecord.from_json(json.loads(json.dumps(data))) == record


def test_a_record_from_before_addresses_and_cores_reads_with_defaults() -> None:
    data = json.loads(WRITTEN_BEFORE["a notebook stopped"])
    for key in ("address", "host", "cpuset", "oom_kills", "served_model", "console", "home_mounted"):
        del data[key]
    record = ReplicaRecord.from_json(data)
    assert (record.address, record.host, record.cpuset, record.oom_kills, record.home_mounted) == (
        None, None, [], 0, None)
    assert record.state is ReplicaState.STOPPED and record.port == 41017


@pytest.mark.parametrize("text", ["[]", '{"id": "rp_1"}', '{"id": "rp_1", "kind": "pod"}', "not json", ""])
def test_a_file_that_is_no_record_reads_as_none(text: str, tmp_path: Path) -> None:
    (tmp_path / "rp_1").mkdir()
    (tmp_path / "rp_1" / "replica.json").write_text(text)
    assert Records(tmp_path).read("rp_1") is None
    assert Records(tmp_path).all() == []


def test_a_record_is_written_0600_whole(tmp_path: Path) -> None:
    spec = ReplicaSpec("rp_1", "wl_1", WorkloadKind.ENDPOINT, "cpu-1c-4g", "box", model="/m", owner="alice")
    (tmp_path / "rp_1").mkdir()
    records = Records(tmp_path)
    records.write(ReplicaRecord.claim(spec, sandboxed=True, now=2.0))
    path = tmp_path / "rp_1" / "replica.json"
    assert os.stat(path).st_mode & 0o777 == 0o600 and not path.with_suffix(".tmp").exists()
    assert records.read("rp_1") == ReplicaRecord.claim(spec, sandboxed=True, now=2.0)
    assert [r.id for r in records.live()] == ["rp_1"]
