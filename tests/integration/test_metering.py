"""The gateway's usage spool: records on disk at once, batches sent oldest first, kept while the
control plane is down (here a ``send`` that fails: the outage is the point), bounded, never lost
by a crash of the gateway."""

from __future__ import annotations

import asyncio
import os
import socket
import time
from pathlib import Path
from typing import Any

import orjson
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from tensora.gateway import app, metering
from tensora.gateway.app import GatewaySettings, build
from tensora.gateway.metering import BATCH, Meter
from tensora.gateway.proxy import Gateway
from tests.support import services
from tests.support.gateway_harness import serving


class ControlPlane:
    def __init__(self) -> None:
        self.up = True
        self.seen: dict[str, dict[str, Any]] = {}
        self.calls = 0

    async def send(self, records: list[bytes]) -> bool:
        self.calls += 1
        if not self.up:
            raise ConnectionRefusedError("control API down")
        for line in records:
            r = orjson.loads(line)
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

    async def flaky(records: list[bytes]) -> bool:
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


def test_records_of_a_few_milliseconds_go_to_disk_in_one_write(tmp_path: Path) -> None:
    m = Meter(tmp_path, ControlPlane().send)
    writes: list[int] = []
    write = m._write

    def counted() -> None:
        writes.append(len(m.records.lines))
        write()

    m._write = counted  # type: ignore[method-assign]

    async def run() -> None:
        for i in range(3):
            m.record(rec(i))
        assert writes == [] and not m.current.exists()  # queued: written within write_after_s
        await asyncio.sleep(m.write_after_s * 4)
        assert writes == [3]
        for i in range(3, 5):
            m.record(rec(i))
        await asyncio.sleep(m.write_after_s * 4)
        assert writes == [3, 2]

    asyncio.run(run())
    assert [orjson.loads(line)["id"] for line in m.current.read_bytes().splitlines()] == [f"req_{i}" for i in range(5)]
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


# -- a spool that survives garbage, a sender that survives errors ------------------------------------------


def test_a_line_torn_by_a_crash_is_moved_aside_and_the_records_around_it_are_sent(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    cp = ControlPlane()
    m = Meter(tmp_path, cp.send)
    for i in range(3):
        m.record(rec(i))
    with m.current.open("ab") as f:  # the machine died in the middle of a write
        f.write(b'{"id": "req_torn", "comp')
    again = Meter(tmp_path, cp.send)  # the gateway starts again on the same spool and meters on
    again.record(rec(3))
    asyncio.run(again.flush())
    assert sorted(cp.seen) == ["req_0", "req_1", "req_2", "req_3"] and again.batches() == []
    (bad,) = (tmp_path / "bad").iterdir()
    assert bad.read_bytes() == b'{"id": "req_torn", "comp\n' and again.bad == 1 and again.sent == 4
    assert caplog.text.count("unreadable") == 1
    m.close()
    again.close()


GARBAGE = [b"\x00\xff\xfe not json", b"[1, 2]", b'{"no_id": 1}', b'{"id": 7}', b'"req_9"']


def test_garbage_lines_are_counted_and_logged_once_however_often_the_batch_is_sent(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    cp = ControlPlane()
    cp.up = False
    m = Meter(tmp_path, cp.send)
    lines = [orjson.dumps(rec(0)), *GARBAGE, orjson.dumps(rec(1))]
    (tmp_path / "batch-0000000000000001.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    asyncio.run(m.flush())  # down: kept, and the garbage already set aside
    asyncio.run(m.flush())
    assert m.bad == len(GARBAGE) and caplog.text.count("unreadable") == 1 and cp.seen == {}
    cp.up = True
    asyncio.run(m.flush())
    assert sorted(cp.seen) == ["req_0", "req_1"] and m.batches() == [] and m.sent == 2
    assert (tmp_path / "bad" / "batch-0000000000000001.jsonl").read_bytes().splitlines() == GARBAGE
    assert m.bad == len(GARBAGE) and caplog.text.count("unreadable") == 1
    m.close()


def test_a_batch_is_on_disk_file_and_directory_before_it_is_sent(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    synced: set[tuple[int, int]] = set()  # (device, inode) of what was fsynced
    real = os.fsync

    def fsync(fd: int) -> None:
        real(fd)
        st = os.fstat(fd)
        synced.add((st.st_dev, st.st_ino))

    monkeypatch.setattr(metering.os, "fsync", fsync)
    checked: list[str] = []

    async def send(records: list[bytes]) -> bool:
        (batch,) = m.batches()
        for p in (batch, tmp_path):
            assert (p.stat().st_dev, p.stat().st_ino) in synced, p
        checked.append(batch.name)
        return True

    m = Meter(tmp_path, send)
    for i in range(3):
        m.record(rec(i))
    asyncio.run(m.flush())
    assert len(checked) == 1
    m.close()


async def _run_until(m: Meter, done: Any, timeout: float = 10.0) -> asyncio.Task[None]:
    task = asyncio.create_task(m.run())
    deadline = asyncio.get_running_loop().time() + timeout
    while not done():
        assert not task.done() and asyncio.get_running_loop().time() < deadline
        await asyncio.sleep(0.01)
    return task


def test_the_sender_logs_an_unexpected_error_and_goes_on(tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    cp = ControlPlane()
    m = Meter(tmp_path, cp.send, flush_s=0.01)
    real_settle = m._settle
    calls: list[int] = []

    def settle() -> None:
        calls.append(1)
        if len(calls) == 1:
            raise PermissionError(13, "Permission denied", str(tmp_path))  # an operator's chmod, a full disk...
        real_settle()

    monkeypatch.setattr(m, "_settle", settle)

    async def go() -> None:
        m.record(rec(0))
        task = await _run_until(m, lambda: "req_0" in cp.seen)
        m.record(rec(1))  # and it goes on metering
        await _run_until(m, lambda: "req_1" in cp.seen)
        assert not task.done()
        task.cancel()

    asyncio.run(go())
    assert m.errors == 1 and "usage sender: unexpected error" in caplog.text and "PermissionError" in caplog.text


def test_a_send_that_raises_keeps_the_batch_and_the_sender_alive(tmp_path: Path) -> None:
    cp = ControlPlane()
    failures = [RuntimeError("a bug in the client"), TimeoutError(), ConnectionResetError()]

    async def send(records: list[bytes]) -> bool:
        if failures:
            raise failures.pop(0)
        return await cp.send(records)

    m = Meter(tmp_path, send, flush_s=0.01)

    async def go() -> None:
        for i in range(3):
            m.record(rec(i))
        task = await _run_until(m, lambda: len(cp.seen) == 3)
        assert not task.done()
        task.cancel()

    asyncio.run(go())
    assert m.sent == 3 and m.batches() == [] and failures == []


def test_the_gateway_starts_its_usage_sender_again_should_it_end(tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TENSORA_GATEWAY_KEY", "k")
    gw = build(GatewaySettings(data_dir=tmp_path, control_url="http://127.0.0.1:9", usage_flush_s=0.01,
                               startup_grace_s=60))
    runs: list[int] = []

    async def run() -> None:
        runs.append(1)
        if len(runs) == 1:
            raise SystemError("what the sender does not catch")
        await asyncio.sleep(3600)

    assert gw.meter is not None
    monkeypatch.setattr(gw.meter, "run", run)
    with serving(gw):
        deadline = time.monotonic() + 10
        while len(runs) < 2:
            assert time.monotonic() < deadline, caplog.text
            time.sleep(0.02)
    assert len(runs) == 2 and "the usage sender stopped" in caplog.text and "SystemError" in caplog.text


class UsageSink:
    """A control API's usage route that answers what it is told, batch by batch, and keeps what it took."""

    def __init__(self, statuses: list[int]) -> None:
        self.statuses = statuses
        self.took: list[dict[str, Any]] = []
        self.auth: list[str] = []
        self.app = Starlette(routes=[Route("/v1/gateway/usage", self.usage, methods=["POST"])])

    async def usage(self, request: Request) -> Response:
        status = self.statuses.pop(0) if self.statuses else 200
        self.auth.append(request.headers.get("authorization", ""))
        if status == 200:
            self.took += orjson.loads(await request.body())["records"]
        answer = b'{"detail": "records[0].id: too long"}' if status == 422 else b"{}"
        return Response(answer, status, media_type="application/json")


@pytest.mark.parametrize(("statuses", "kept", "taken", "logged"), [
    pytest.param([200], 0, 3, None, id="taken"),
    pytest.param([503, 503], 1, 0, "usage batch refused: 503", id="control API failing: kept"),
    pytest.param([429, 429], 1, 0, "usage batch refused: 429", id="control API busy: kept"),
    pytest.param([422], 0, 0, "usage batch refused: 422 {\"detail\": \"records[0].id: too long\"}",
                 id="refused for good: logged, not sent again"),
])
def test_the_gateway_sends_its_usage_to_the_control_api(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch, statuses: list[int],
        kept: int, taken: int, logged: str | None) -> None:
    monkeypatch.setenv("TENSORA_GATEWAY_KEY", "the-gateway-key")
    sink = UsageSink(statuses)
    with services.serving(sink.app) as live:
        gw = build(GatewaySettings(data_dir=tmp_path, control_url=live.url, startup_grace_s=60))
        assert gw.meter is not None
        for i in range(3):
            gw.meter.record(rec(i))
        asyncio.run(flush_then_stop(gw))  # the stop flushes again: a kept batch is tried once more
    assert len(gw.meter.batches()) == kept and [r["id"] for r in sink.took] == [f"req_{i}" for i in range(taken)]
    assert set(sink.auth) == {"Bearer the-gateway-key"}
    assert (logged in caplog.text) if logged else "refused" not in caplog.text


async def flush_then_stop(gw: Gateway) -> None:
    assert gw.meter is not None
    await gw.meter.flush()
    for stop in gw.on_shutdown:
        await stop()


def test_a_control_api_that_never_answers_keeps_the_batch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TENSORA_GATEWAY_KEY", "k")
    monkeypatch.setattr(app, "USAGE_TIMEOUT_S", 0.2)
    with socket.socket() as quiet:  # takes the connection, reads nothing, answers nothing
        quiet.bind(("127.0.0.1", 0))
        quiet.listen()
        gw = build(GatewaySettings(data_dir=tmp_path, control_url=f"http://127.0.0.1:{quiet.getsockname()[1]}",
                                   startup_grace_s=60))
        assert gw.meter is not None
        gw.meter.record(rec(0))
        asyncio.run(flush_then_stop(gw))
    assert len(gw.meter.batches()) == 1 and gw.meter.failures == 2


# -- the disk's waits are not the requests' --------------------------------------------------------------


def test_a_flush_does_not_hold_the_loop_while_the_disk_syncs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """fsync, reading a batch and deleting it run in a thread: on the loop they held every request in flight
    (the gateway's p99 under load). Here the disk takes 0.3 s a sync; the loop keeps ticking meanwhile."""
    real = os.fsync

    def slow_fsync(fd: int) -> None:
        time.sleep(0.3)
        real(fd)

    monkeypatch.setattr(metering.os, "fsync", slow_fsync)
    cp = ControlPlane()
    m = Meter(tmp_path, cp.send)

    async def go() -> float:
        for i in range(3):
            m.record(rec(i))
        flush = asyncio.create_task(m.flush())
        worst, last = 0.0, time.perf_counter()
        while not flush.done():
            await asyncio.sleep(0.01)
            now = time.perf_counter()
            worst, last = max(worst, now - last), now
        await flush
        return worst

    worst = asyncio.run(go())
    assert sorted(cp.seen) == ["req_0", "req_1", "req_2"] and m.batches() == []
    assert worst < 0.2, f"the loop was held {worst:.3f} s"  # a sync on the loop would hold it 0.3 s (twice)
    m.close()


def test_a_file_set_aside_by_a_gateway_that_died_is_sent_by_the_next(tmp_path: Path) -> None:
    cp = ControlPlane()
    m = Meter(tmp_path, cp.send)
    for i in range(2):
        m.record(rec(i))
    m._close_current()  # set aside, then the process died before it became a batch
    assert m.batches() == [] and len(list(tmp_path.glob("closing-*.jsonl"))) == 1
    again = Meter(tmp_path, cp.send)
    asyncio.run(again.flush())
    assert sorted(cp.seen) == ["req_0", "req_1"] and list(tmp_path.glob("*.jsonl")) == []
    again.close()


# -- what is read record by record, and what is not ----------------------------------------------------------


class _Counted:
    """orjson as the meter sees it, counting the lines it parses."""

    def __init__(self) -> None:
        self.parsed = 0
        self.dumps = orjson.dumps
        self.JSONDecodeError = orjson.JSONDecodeError

    def loads(self, data: bytes) -> Any:
        self.parsed += 1
        return orjson.loads(data)


def test_a_batch_this_gateway_wrote_whole_is_sent_unparsed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    counted = _Counted()
    monkeypatch.setattr(metering, "orjson", counted)
    cp = ControlPlane()
    m = Meter(tmp_path, cp.send)
    for i in range(BATCH + 5):
        m.record(rec(i))
    asyncio.run(m.flush())  # sent from memory
    assert counted.parsed == 0 and len(cp.seen) == BATCH + 5 and m.sent == BATCH + 5 and m.batches() == []
    cp.up = False
    for i in range(BATCH + 5, BATCH + 10):
        m.record(rec(i))
    asyncio.run(m.flush())  # kept on disk, and no longer in memory: the outage may last
    assert len(m.batches()) == 1 and m._held == {}
    cp.up = True
    asyncio.run(m.flush())  # read again, and split, not parsed
    assert counted.parsed == 0 and len(cp.seen) == BATCH + 10 and m.batches() == []
    m.close()


def test_a_batch_past_the_memory_bound_is_read_back_unparsed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    counted = _Counted()
    monkeypatch.setattr(metering, "orjson", counted)
    monkeypatch.setattr(metering, "HELD_BYTES", 1000)  # a few records' worth
    cp = ControlPlane()
    m = Meter(tmp_path, cp.send)
    for i in range(50):
        m.record(rec(i))
    m._close_current()
    assert m._held == {}  # past the bound: not kept in memory (a long usage_flush_s would hold it all)
    asyncio.run(m.flush())
    assert counted.parsed == 0 and len(cp.seen) == 50 and m.batches() == []
    m.close()


class _DiskFills:
    """The spool's file on a disk that fills: the next write puts half its bytes down, then fails."""

    def __init__(self, f: Any) -> None:
        self.f = f
        self.full = True

    def write(self, data: bytes) -> int:
        if self.full:
            self.full = False
            self.f.write(data[: len(data) // 2])
            self.f.flush()
            raise OSError(28, "No space left on device")
        return int(self.f.write(data))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.f, name)


def test_a_batch_written_across_a_failed_write_is_read_record_by_record(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    counted = _Counted()
    monkeypatch.setattr(metering, "orjson", counted)
    cp = ControlPlane()
    m = Meter(tmp_path, cp.send)
    m.record(rec(0))  # no loop: written at once
    m._file = _DiskFills(m._file)  # type: ignore[assignment]
    with pytest.raises(OSError, match="No space"):
        m.record(rec(1))
    m.record(rec(2))  # space again: the pending record 1 goes with it
    asyncio.run(m.flush())
    assert sorted(cp.seen) == ["req_0", "req_1", "req_2"] and m.bad == 1 and counted.parsed == 4
    (bad,) = (tmp_path / "bad").iterdir()
    line = orjson.dumps(rec(1))
    assert bad.read_bytes() == line[: (len(line) + 1) // 2] + b"\n"  # the torn half, on a line of its own
    m.close()


def test_a_line_another_writer_appended_to_the_current_file_is_checked(tmp_path: Path) -> None:
    cp = ControlPlane()
    m = Meter(tmp_path, cp.send)
    m.record(rec(0))
    with m.current.open("ab") as f:  # not this gateway's: the file is no longer what it wrote
        f.write(b'{"id": "req_torn", "comp\n')
    m.record(rec(1))
    asyncio.run(m.flush())
    assert sorted(cp.seen) == ["req_0", "req_1"] and m.bad == 1 and m.sent == 2
    m.close()
