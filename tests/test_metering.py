"""The gateway's usage spool: records on disk at once, batches sent oldest first, kept while the
control plane is down (here a ``send`` that fails: the outage is the point), bounded, never lost
by a crash of the gateway."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from tensora.gateway.metering import BATCH, Meter


class ControlPlane:
    def __init__(self) -> None:
        self.up = True
        self.seen: dict[str, dict[str, Any]] = {}
        self.calls = 0

    async def send(self, records: list[dict[str, Any]]) -> bool:
        self.calls += 1
        if not self.up:
            raise ConnectionRefusedError("control API down")
        for r in records:
            self.seen.setdefault(r["id"], r)  # as the API does: an id seen before is not counted again
        return True


def rec(i: int) -> dict[str, Any]:
    return {"id": f"req_{i}", "completion_tokens": i}


def test_records_wait_on_disk_while_the_control_plane_is_down_then_arrive_once(tmp_path: Path) -> None:
    cp = ControlPlane()
    m = Meter(tmp_path, cp.send)
    for i in range(3):
        m.record(rec(i))
    asyncio.run(m.flush())
    assert set(cp.seen) == {"req_0", "req_1", "req_2"} and m.batches() == []
    cp.up = False
    for i in range(3, 6):
        m.record(rec(i))
    asyncio.run(m.flush())
    m.record(rec(6))
    asyncio.run(m.flush())
    assert len(m.batches()) == 2 and len(cp.seen) == 3  # kept, in two batches
    cp.up = True
    asyncio.run(m.flush())
    assert sorted(cp.seen) == [f"req_{i}" for i in range(7)] and m.batches() == [] and m.sent == 7
    m.close()


def test_a_crashed_gateway_loses_nothing_it_recorded(tmp_path: Path) -> None:
    cp = ControlPlane()
    m = Meter(tmp_path, cp.send)
    for i in range(5):
        m.record(rec(i))
    # the process dies here: no flush, no close; a new gateway starts on the same spool
    again = Meter(tmp_path, cp.send)
    asyncio.run(again.flush())
    assert sorted(cp.seen) == [f"req_{i}" for i in range(5)]
    m.close()
    again.close()


def test_big_batches_go_in_parts_and_a_part_resent_is_not_counted_twice(tmp_path: Path) -> None:
    cp = ControlPlane()
    sent: list[int] = []

    async def flaky(records: list[dict[str, Any]]) -> bool:
        sent.append(len(records))
        if len(sent) == 2:
            return False  # the second part is refused: the whole file stays
        return await cp.send(records)

    m = Meter(tmp_path, flaky)
    for i in range(BATCH + 10):
        m.record(rec(i))
    asyncio.run(m.flush())
    assert sent == [BATCH, 10] and len(m.batches()) == 1
    asyncio.run(m.flush())
    assert sent == [BATCH, 10, BATCH, 10] and len(cp.seen) == BATCH + 10 and m.batches() == []
    m.close()


def test_the_spool_is_bounded_and_says_what_it_dropped(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    cp = ControlPlane()
    cp.up = False
    m = Meter(tmp_path, cp.send, max_bytes=1 << 16)
    for round_ in range(4):
        for i in range(600):
            m.record({"id": f"req_{round_}_{i}", "pad": "x" * 20})
        asyncio.run(m.flush())
    assert m.dropped > 0 and m.dropped % 600 == 0
    assert sum(f.stat().st_size for f in m.batches()) <= 1 << 16
    assert "dropped" in caplog.text
    m.close()
