"""Token usage records: written to a spool on disk at once, sent to the control API in batches.

Each record is appended (one JSON line) to ``spool/current.jsonl`` when its request ends (the
records of the same 5 ms in one write), so a crash of the gateway loses at most those 5 ms.
Every ``flush_s`` the current file is set aside (``closing-N``), then fsynced and renamed to a numbered
batch (and the directory fsynced) in a thread, off the requests' loop, and batches are sent oldest first;
a batch is deleted only after the control API has taken it. Record ids are the gateway's own (random):
the control API ignores ids it has seen, so a batch sent twice (the answer was lost, the gateway died) is counted once.
While the control API is down batches pile up, bounded by ``max_bytes``: past it the oldest
batch is dropped, and that is counted in ``dropped`` and logged (the only way a record is lost
other than a crash within those 5 ms). A line that is not a record (torn by a crash of the
machine, or garbage) is moved to ``spool/bad/`` (one file per batch, kept), logged once per batch
and counted in ``bad``; the batch's good records go on. The sender (``run``) outlives any error.

A batch this process wrote whole (its size that of the records it wrote: no write failed part way, no line
of a crashed gateway's or of another writer in it) is sent as its lines, unparsed: parsing them under load held
the GIL against the requests' loop, in turns long enough to be the gateway's tail latency. Any other file is
read record by record.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import IO, Any

import orjson

from tensora.gateway.records import Records

log = logging.getLogger("tensora.gateway")

BATCH = 1000  # records a request: what the control API takes at once
HELD_BYTES = 16 << 20  # a batch's records kept in memory to be sent without reading the file back, at most

Send = Callable[[list[bytes]], Awaitable[bool]]  # records, each as its JSON object; True: taken


class Meter:
    def __init__(self, spool: Path, send: Send, *, flush_s: float = 1.0, max_bytes: int = 256 << 20) -> None:
        self.dir = Path(spool)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.send, self.flush_s, self.max_bytes = send, flush_s, max_bytes
        self._file: IO[bytes] | None = None
        self.records = Records(self._schedule)  # what the request path adds to: compiled (``records``)
        self._timer: asyncio.TimerHandle | None = None
        self.write_after_s = 0.005
        self.sent = 0
        self.dropped = 0
        self.bad = 0
        self.errors = 0  # unexpected errors of the sender, each logged; it went on after each
        self.failures = 0  # batches the control API did not take (down, refused, 5xx): kept for later
        self._seq = int(time.time() * 1000)
        self._bytes = 0  # written whole to the current file by this process: a file of another size is checked
        self._lines: list[bytes] | None = []  # ...and those records, up to ``HELD_BYTES`` (None past it)
        self._whole: set[str] = set()  # batches made of such files: their lines need no checking
        self._held: dict[str, list[bytes]] = {}  # the records of such batches not yet sent: no need to read them
        self._flushing = asyncio.Lock()

    @property
    def current(self) -> Path:
        return self.dir / "current.jsonl"

    def record(self, rec: dict[str, Any]) -> None:
        """Spool one record. Under an event loop, records of the same few milliseconds go to disk in one
        write (``write_after_s``): a write per request costs the hot path a syscall each. The gateway's request
        path adds to ``records`` itself, the same way."""
        self.records.add(rec)

    def _schedule(self) -> None:
        """The first record since the last write: the write, in ``write_after_s``, or at once outside a loop."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self._write()
            return
        self._timer = loop.call_later(self.write_after_s, self._write)

    def _write(self) -> None:
        self._timer = None
        self.records.waking = False
        pending = self.records.lines
        if not pending:
            return
        if self._file is None:
            self._file = open(self.current, "ab")  # noqa: SIM115 (kept open between records)
            self._bytes, self._lines = 0, []
            if self._file.tell() and _last_byte(self.current) != b"\n":
                self._file.write(b"\n")  # a line torn by a crash must not swallow the next record
        data = b"\n".join(pending) + b"\n"
        try:
            self._file.write(data)
            self._file.flush()  # in the OS's hands: a crash of this process loses nothing written
        except OSError:  # a full disk: part of it may be in the file; the records stay pending
            f, self._file = self._file, None  # the next write opens it again and first ends a torn line
            with contextlib.suppress(OSError):
                f.close()
            raise
        self._bytes += len(data)
        if self._lines is not None:
            if self._bytes <= HELD_BYTES:
                self._lines += pending
            else:  # a long flush_s or a flood: the batch is read back when it goes, not held
                self._lines = None
        pending.clear()

    def _close_current(self) -> None:
        """On the loop, and quick: what is pending written, and the current file set aside under a name of its
        own, so that the records that come meanwhile start a new one while a thread makes it a batch."""
        if self._timer is not None:
            self._timer.cancel()
        self._write()
        f, self._file = self._file, None
        if f is not None:
            f.close()  # written, not yet synced: ``_settle`` syncs it before it is a batch
        size = self.current.stat().st_size if self.current.exists() else 0
        if size > 0:  # also one a crashed gateway left
            self._seq += 1
            os.replace(self.current, self.dir / f"closing-{self._seq:016d}.jsonl")
            if f is not None and size == self._bytes:  # its every line a record this process wrote whole
                self._whole.add(f"batch-{self._seq:016d}.jsonl")
                if self._lines is not None:
                    self._held[f"batch-{self._seq:016d}.jsonl"] = self._lines
        self._lines = []

    def _settle(self) -> None:
        """Off the loop (fsync waits on the disk): each set-aside file synced, then made a batch, then the
        directory synced; so a batch is on disk before it is one, as the metering docs promise."""
        closing = sorted(self.dir.glob("closing-*.jsonl"))
        for f in closing:
            _fsync_file(f)
            os.replace(f, self.dir / f.name.replace("closing-", "batch-", 1))
        if closing:
            _fsync_dir(self.dir)
        self._bound()

    def _rotate(self) -> None:
        self._close_current()
        self._settle()

    def batches(self) -> list[Path]:
        return sorted(self.dir.glob("batch-*.jsonl"))

    def _bound(self) -> None:
        files = self.batches()
        total = sum(f.stat().st_size for f in files)
        while files and total > self.max_bytes:
            f = files.pop(0)
            n = f.read_bytes().count(b"\n")
            total -= f.stat().st_size
            f.unlink()
            self._whole.discard(f.name)
            self._held.pop(f.name, None)
            self.dropped += n
            log.error("usage spool over %d bytes: dropped %d records of %s", self.max_bytes, n, f.name)

    async def flush(self) -> None:
        """Rotate, then send what is spooled, oldest first; stops at the first batch not taken. The disk's part
        (fsync, reading and checking a batch, deleting it) runs in a thread: on the loop it held every request
        in flight while it ran, the gateway's tail latency under load. A batch
        just written is sent from memory; one kept for later is read again (memory stays bounded while the
        control API is down)."""
        async with self._flushing:  # the sender's and the shutdown's never interleave
            try:
                await self._send_spooled()
            finally:
                self._held.clear()  # what a flush did not send is on disk: memory holds nothing past it

    async def _send_spooled(self) -> None:
        self._close_current()
        await asyncio.to_thread(self._settle)
        for f in self.batches():
            records = self._held.pop(f.name, None)
            if records is None:
                records = await asyncio.to_thread(self._read, f)
            for i in range(0, len(records), BATCH):  # a part sent again after a failure is not counted twice
                try:
                    ok = await self.send(records[i:i + BATCH])
                except Exception as exc:  # the control API is down or slow: keep the batch for later
                    log.warning("usage batch %s not sent (%s); kept for later", f.name, type(exc).__name__)
                    ok = False
                if not ok:
                    self.failures += 1
                    return
            self.sent += len(records)
            await asyncio.to_thread(f.unlink)
            self._whole.discard(f.name)

    def _read(self, f: Path) -> list[bytes]:
        """The batch's records, each as its JSON. A batch this process wrote whole is split into its lines; any
        other is checked line by line: lines that are not a record (torn, garbage) go to ``bad/<batch>`` first and
        the batch is rewritten without them, so they are counted and logged once, however often it is sent."""
        lines = f.read_bytes().splitlines()
        if f.name in self._whole:
            return lines
        records, bad = [], []
        for line in lines:
            if not line.strip():
                continue
            try:
                rec = orjson.loads(line)
            except orjson.JSONDecodeError:
                rec = None
            if isinstance(rec, dict) and isinstance(rec.get("id"), str):
                records.append(line)
            else:
                bad.append(line)
        if bad:
            (self.dir / "bad").mkdir(exist_ok=True)
            _write_synced(self.dir / "bad" / f.name, b"\n".join(bad) + b"\n")
            _write_synced(f, b"".join(line + b"\n" for line in records))
            self.bad += len(bad)
            log.error("usage spool: %d unreadable line(s) of %s moved to bad/%s; its %d good record(s) go on",
                      len(bad), f.name, f.name, len(records))
        return records

    async def run(self) -> None:
        """Flush every ``flush_s``, for good: an unexpected error is logged and the next flush waits longer
        (doubling, up to a minute) instead of ending the task, which nothing would notice."""
        delay = self.flush_s
        while True:
            await asyncio.sleep(delay)
            try:
                await self.flush()
                delay = self.flush_s
            except Exception:
                self.errors += 1
                delay = min(max(delay, self.flush_s) * 2, 60.0)
                log.exception("usage sender: unexpected error; next try in %.1f s", delay)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._rotate()


def _last_byte(path: Path) -> bytes:
    with open(path, "rb") as f:
        f.seek(-1, os.SEEK_END)
        return f.read(1)


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_synced(path: Path, data: bytes) -> None:
    """Replace ``path`` with ``data`` atomically, on disk (file and directory fsynced)."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)
