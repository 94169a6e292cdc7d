"""The local driver's metrics: replicas by kind and state from the driver's own records, processes
killed for their memory limit as the cgroup counts them, installed runtimes; scraped over HTTP and parsed."""

from __future__ import annotations

from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tensora.config.catalog import default_catalog
from tensora.drivers.base import ReplicaSpec, ReplicaState
from tensora.drivers.local import Isolation, LocalDriver
from tensora.drivers.localmetrics import LocalCollector
from tensora.drivers.record import ReplicaRecord
from tensora.models import runtimes
from tensora.placement.admission import WorkloadKind
from tensora.placement.capacity import Node
from tensora.telemetry.scrape import Listener


class Cgroup:
    """The one thing of runc the OOM count reads: the kernel's count of kills (a double: no sandbox runs here)."""

    def __init__(self, kills: int) -> None:
        self.kills = kills

    def oom_kills(self, sandbox_id: str) -> int:
        return self.kills

    def exit_reason(self, sandbox_id: str) -> str:
        return "out of memory: limit 4Gi"


def test_replicas_by_state_oom_kills_and_runtimes_over_http(tmp_path: Path) -> None:
    d = LocalDriver(tmp_path / "data", Node("box", "local", 4, 16 << 30), default_catalog(),
                    runtimes_dir=tmp_path / "runtimes", isolation=Isolation.ADMIN_ONLY)
    for i in range(2):  # another owner's VM where the driver cannot sandbox: refused, recorded as failed
        status = d.start(ReplicaSpec(f"rp_m{i}", f"wl_m{i}", WorkloadKind.VM, "cpu-1c-4g", "box", owner="alice"))
        assert status.state is ReplicaState.FAILED
    meta = d._read("rp_m0")
    assert meta is not None
    d.sandboxes.runc = Cgroup(kills=3)  # type: ignore[assignment]
    d._note_oom(ReplicaRecord.from_json({**meta, "oom_kills": 1}))  # the cgroup now says 3: two more since last seen
    d._note_oom(ReplicaRecord.from_json({**meta, "oom_kills": 3}))  # nothing new
    listener = Listener("127.0.0.1:0", LocalCollector(d), process=False)
    assert listener.start()
    try:
        text = httpx.get(f"http://127.0.0.1:{listener.port}/metrics", timeout=5).text
    finally:
        listener.close()
    found = {(s.name, tuple(sorted(s.labels.items()))): s.value
             for f in text_string_to_metric_families(text) for s in f.samples}
    assert found[("tensora_local_replicas", (("kind", "vm"), ("state", "failed")))] == 2
    assert found[("tensora_local_sandbox_oom_kills_total", ())] == 2
    installed = {dict(k[1])["runtime"]: v for k, v in found.items() if k[0] == "tensora_local_runtimes_installed"}
    assert installed == dict.fromkeys(runtimes.REGISTRY, 0.0)
