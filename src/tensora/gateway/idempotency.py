"""Idempotency-Key on completions: a client's retry of a paid call replays the first answer instead of
paying twice.

A record is keyed by (calling key id, path, Idempotency-Key), so no other key, of another owner or of the
same one, can read or block it, and holds a fingerprint of the body (its JSON, keys sorted). The first
request claims it atomically; the same key and body then replays the stored answer (the JSON, or the
stream's events byte for byte) with ``Idempotent-Replayed: true``, and is not metered again; another
body is 422; a request still running is 409 with Retry-After. Only a whole 200 answer is kept
(``keep_s``, 24 h): errors, 429s, a stream ended by an error release the claim and a retry runs afresh
(a request cancelled midway too). An answer over ``max_answer_bytes`` is served but not kept (a whole one says so
in ``X-Tensora-Idempotency: not-stored``), and so is one that would take its owner past ``max_owner_bytes``
or the store past ``max_total_bytes``: its retry runs again. The bound per owner is what keeps one owner from
filling the store for all: nothing kept is ever evicted, so a full store would deny every other owner's keeps.
An abandoned claim (a crash) lapses after ``in_flight_s``.

Records live in Redis when the gateway has one, so that every gateway sees them, else on its disk
(``DiskStore``). Redis failing is no reason for a 500: its calls time out as the limiter's do, and until
it answers again (tried at most once a ``probe_s``) claims go to this gateway's disk and answers say
``X-Tensora-Idempotency: local`` (a retry through another gateway would run again).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import secrets
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import orjson

log = logging.getLogger("tensora.gateway")

HEADER = b"idempotency-key"
KEEP_S = 24 * 3600.0
MAX_KEY_LEN = 255
SWEEP_S = 60.0  # the disk store sweeps expired records at most this often, when it is full
STATUS = b"x-tensora-idempotency"
REPLAYED = (b"idempotent-replayed", b"true")
_NOT_KEPT = (b"x-request-id", b"ratelimit", b"ratelimit-policy")  # the replay's own, or stale
_STREAM_ERROR = b'data: {"error":'  # how the relay ends a stream that failed after its head (``relay.Relay.stream``)

Send = Callable[[dict[str, Any]], Awaitable[None]]


@dataclass(frozen=True, slots=True)
class Answer:
    """A whole answer as the client got it: the replay sends it again, byte for byte."""

    status: int
    headers: list[tuple[bytes, bytes]]
    body: bytes

    def encode(self) -> bytes:
        h = [[k.decode("latin-1"), v.decode("latin-1")] for k, v in self.headers]
        return orjson.dumps({"status": self.status, "headers": h}) + b"\n" + self.body

    @staticmethod
    def decode(data: bytes) -> Answer:
        head, _, body = data.partition(b"\n")
        meta = orjson.loads(head)
        return Answer(meta["status"], [(k.encode("latin-1"), v.encode("latin-1")) for k, v in meta["headers"]], body)


@dataclass(frozen=True, slots=True)
class Held:
    """A live record another request made: its body's fingerprint, and its answer once it has one."""

    fingerprint: str
    answer: bytes | None  # Answer.encode(); None while in flight


class Store(Protocol):
    """Where records live. ``claim`` is atomic: of two claims of one name, one gets None (it runs the request),
    the other what the first holds; expired records count as none. ``complete`` and ``release`` act only
    while ``token`` still holds the record (a claim that lapsed and was taken over is not overwritten)."""

    async def claim(self, name: str, fingerprint: str, token: str, now: float, until: float) -> Held | None: ...
    async def complete(self, name: str, token: str, answer: bytes, now: float, until: float,
                       owner: str = "") -> bool: ...
    async def release(self, name: str, token: str) -> None: ...


class DiskStore:
    """One file a record (0600) under ``dir``: a JSON line (fingerprint, expiry, claim token) and the answer.

    Every step holds an exclusive ``flock`` on the file, so two requests, or two gateway processes on one
    data dir, never both claim it; a file unlinked while a step waited for its lock is opened again. A file
    torn by a crash counts as no record. ``max_total_bytes`` bounds the files together, ``max_owner_bytes`` the
    answers of one owner: past either, expired records are swept (at most once a ``SWEEP_S``), and an answer that
    still does not fit is not kept."""

    def __init__(self, dir: Path, max_total_bytes: int = 256 << 20, max_owner_bytes: int | None = None) -> None:
        self.dir, self.max_total = Path(dir), max_total_bytes
        self.max_owner = max_total_bytes if max_owner_bytes is None else max_owner_bytes
        self.dir.mkdir(parents=True, exist_ok=True)
        os.chmod(self.dir, 0o700)
        self.owners: dict[str, int] = {}  # bytes of the kept answers of each owner
        self.total = self.sweep(time.time())
        self._swept_at = float("-inf")

    @contextlib.contextmanager
    def _locked(self, name: str) -> Iterator[int]:
        path = self.dir / name
        while True:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                if os.fstat(fd).st_nlink > 0:
                    yield fd
                    return
            finally:
                os.close(fd)  # and the lock with it

    def _write(self, fd: int, old: int, data: bytes) -> None:
        os.ftruncate(fd, 0)
        view = memoryview(data)
        while view:
            view = view[os.pwrite(fd, view, len(data) - len(view)):]
        self.total += len(data) - old

    async def claim(self, name: str, fingerprint: str, token: str, now: float, until: float) -> Held | None:
        with self._locked(name) as fd:
            data = _read(fd)
            meta, answer = _parse(data, now)
            if meta is not None:
                return Held(meta["fp"], answer)
            self._write(fd, len(data), orjson.dumps({"fp": fingerprint, "exp": until, "tok": token}) + b"\n")
            return None

    async def complete(self, name: str, token: str, answer: bytes, now: float, until: float,
                       owner: str = "") -> bool:
        with self._locked(name) as fd:
            data = _read(fd)
            meta, _ = _parse(data, now)
            if meta is None or meta["tok"] != token:
                return False
            out = orjson.dumps({"fp": meta["fp"], "exp": until, "tok": token, "done": True, "own": owner}) + \
                b"\n" + answer
            was = len(data) if meta.get("done") and meta.get("own", "") == owner else 0  # kept before: replaced

            def over() -> bool:
                return (self.total - len(data) + len(out) > self.max_total
                        or self.owners.get(owner, 0) - was + len(out) > self.max_owner)

            if over():
                if now - self._swept_at >= SWEEP_S:  # a sweep reads every record: not at each answer
                    self._swept_at = now
                    self.total = self.sweep(now, but=name)
                if over():
                    return False
            self._write(fd, len(data), out)
            self.owners[owner] = self.owners.get(owner, 0) - was + len(out)
            return True

    async def release(self, name: str, token: str) -> None:
        with self._locked(name) as fd:
            data = _read(fd)
            meta, _ = _parse(data, float("-inf"))
            if meta is None or meta["tok"] == token:
                os.unlink(self.dir / name)
                self.total -= len(data)
                if meta is not None and meta.get("done"):
                    self._forget(meta.get("own", ""), len(data))

    def _forget(self, owner: str, size: int) -> None:
        left = self.owners.get(owner, 0) - size
        if left > 0:
            self.owners[owner] = left
        else:
            self.owners.pop(owner, None)

    def sweep(self, now: float, but: str = "") -> int:
        """Delete expired and torn records; the bytes of those left (and of each owner's, in ``owners``). ``but``:
        the record being completed, a claim (no owner's bytes yet)."""
        total = 0
        owners: dict[str, int] = {}
        for path in self.dir.iterdir():
            if path.name == but:
                total += path.stat().st_size
                continue
            with self._locked(path.name) as fd:
                data = _read(fd)
                meta = _parse(data, now)[0]
                if meta is None:
                    os.unlink(path)
                else:
                    total += len(data)
                    if meta.get("done"):
                        own = meta.get("own", "")
                        owners[own] = owners.get(own, 0) + len(data)
        self.owners = owners
        return total


def _read(fd: int) -> bytes:
    parts, at = [], 0
    while chunk := os.pread(fd, 1 << 20, at):
        parts.append(chunk)
        at += len(chunk)
    return b"".join(parts)


def _parse(data: bytes, now: float) -> tuple[dict[str, Any] | None, bytes | None]:
    """A file's record and answer; (None, None) when it holds none that is live."""
    head, nl, rest = data.partition(b"\n")
    try:
        meta = orjson.loads(head) if nl else None
    except orjson.JSONDecodeError:
        return None, None
    if not isinstance(meta, dict) or not meta.get("exp", 0) > now:
        return None, None
    return meta, rest if meta.get("done") else None


# KEYS: the record (a hash); ARGV: now, until, fingerprint, token, ttl ms. Returns nil when claimed, else
# {fingerprint, answer or nil}. ``exp`` is the gateway's clock; the TTL only collects what nobody reads.
_CLAIM = """
local h = redis.call('HMGET', KEYS[1], 'exp', 'fp', 'ans')
if h[1] and tonumber(h[1]) > tonumber(ARGV[1]) then return {h[2], h[3]} end
redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[1], 'exp', ARGV[2], 'fp', ARGV[3], 'tok', ARGV[4])
redis.call('PEXPIRE', KEYS[1], ARGV[5])
return false
"""
# KEYS: the record, the index (a sorted set of "bytes:owner tag:record:token" by expiry), the total, the owner's
# total (the total's name, ":", the owner's tag); ARGV: token, now, until, answer, ttl ms, max total bytes, max
# bytes of one owner. Returns 1 stored, 0 not ours any more (taken over, or lapsed), -1 over a bound. Index
# entries from before the owner's tag ("bytes:record:token") count in the total only.
_COMPLETE = """
local h = redis.call('HMGET', KEYS[1], 'tok', 'exp')
if h[1] ~= ARGV[1] or tonumber(h[2]) <= tonumber(ARGV[2]) then return 0 end
for _, m in ipairs(redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', ARGV[2], 'LIMIT', 0, 1000)) do
  local size = tonumber(string.match(m, '^(%d+):'))
  redis.call('DECRBY', KEYS[3], size)
  local tag = string.match(m, '^%d+:(%x+):')
  if tag and tonumber(redis.call('DECRBY', KEYS[3] .. ':' .. tag, size)) <= 0 then
    redis.call('DEL', KEYS[3] .. ':' .. tag)
  end
  redis.call('ZREM', KEYS[2], m)
end
local n = string.len(ARGV[4])
if tonumber(redis.call('GET', KEYS[3]) or '0') + n > tonumber(ARGV[6]) then return -1 end
if tonumber(redis.call('GET', KEYS[4]) or '0') + n > tonumber(ARGV[7]) then return -1 end
redis.call('HSET', KEYS[1], 'exp', ARGV[3], 'ans', ARGV[4])
redis.call('PEXPIRE', KEYS[1], ARGV[5])
redis.call('ZADD', KEYS[2], ARGV[3], n .. ':' .. string.sub(KEYS[4], string.len(KEYS[3]) + 2) .. ':' .. KEYS[1]
           .. ':' .. ARGV[1])
redis.call('INCRBY', KEYS[3], n)
redis.call('INCRBY', KEYS[4], n)
return 1
"""
_RELEASE = """
if redis.call('HGET', KEYS[1], 'tok') == ARGV[1] then redis.call('DEL', KEYS[1]) end
return 0
"""


class RedisStore:
    """Records as Redis hashes named ``PREFIX:NAME``, each step one script call (atomic); kept answers are
    counted in ``PREFIX:bytes`` (and each owner's in ``PREFIX:bytes:TAG``) and indexed by expiry, so
    ``max_total_bytes`` and ``max_owner_bytes`` hold across gateways. The
    prefix is one Redis Cluster hash tag, so that a script's keys share a slot. Takes the limiter's client
    (its timeouts and pool); every failure is raised to ``Idempotency``."""

    def __init__(self, redis: Any, prefix: str = "{tensora:idem}", max_total_bytes: int = 256 << 20,
                 max_owner_bytes: int | None = None) -> None:
        self.redis, self.prefix, self.max_total = redis, prefix, max_total_bytes
        self.max_owner = max_total_bytes if max_owner_bytes is None else max_owner_bytes
        self._claim = redis.register_script(_CLAIM)
        self._complete = redis.register_script(_COMPLETE)
        self._release = redis.register_script(_RELEASE)

    def _name(self, name: str) -> str:
        return f"{self.prefix}:{name}"

    async def claim(self, name: str, fingerprint: str, token: str, now: float, until: float) -> Held | None:
        got = await self._claim(keys=[self._name(name)], args=[repr(now), repr(until), fingerprint, token,
                                                                _ttl_ms(now, until)])
        if got is None:
            return None
        return Held(got[0].decode(), got[1])

    async def complete(self, name: str, token: str, answer: bytes, now: float, until: float,
                       owner: str = "") -> bool:
        tag = hashlib.sha256(owner.encode()).hexdigest()[:16]  # hex: the index entry's owner field, unambiguous
        keys = [self._name(name), f"{self.prefix}:index", f"{self.prefix}:bytes", f"{self.prefix}:bytes:{tag}"]
        got = await self._complete(keys=keys, args=[token, repr(now), repr(until), answer, _ttl_ms(now, until),
                                                    self.max_total, self.max_owner])
        return bool(got == 1)

    async def release(self, name: str, token: str) -> None:
        await self._release(keys=[self._name(name)], args=[token])


def _ttl_ms(now: float, until: float) -> int:
    return max(1, int((until - now) * 1000)) + 60_000


def fingerprint(body: Any) -> str:
    return hashlib.sha256(orjson.dumps(body, option=orjson.OPT_SORT_KEYS)).hexdigest()


class Outcome(Protocol):
    status: int  # 200: a whole answer, fit to keep


class Capture:
    """The client's ``send``, keeping a copy of what goes out (up to ``limit`` bytes of body). A whole 200
    answer is handed to ``keep`` before its last part goes out, so that a client that has the answer and
    retries at once finds it kept (not a 409). The head is held until the first body part, so that a whole
    answer that will not be kept can say so."""

    def __init__(self, send: Send, limit: int, extra: list[tuple[bytes, bytes]],
                 keep: Callable[[Answer], Awaitable[bool]] | None = None) -> None:
        self.send, self.limit, self.extra, self.keep = send, limit, extra, keep
        self.start: dict[str, Any] | None = None
        self.parts: list[bytes] = []
        self.size = 0
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.kept = False

    async def __call__(self, msg: dict[str, Any]) -> None:
        if msg["type"] == "http.response.start":
            self.start = msg
            return
        body = msg.get("body", b"")
        self.size += len(body)
        ended = not msg.get("more_body", False)
        if self.size <= self.limit:
            self.parts.append(body)
        if self.start is not None:
            start, self.start = self.start, None
            self.status, self.headers = start["status"], list(start["headers"])
            extra = self.extra
            if ended and (self.size > self.limit or self.status != 200):
                extra = [(STATUS, b"not-stored")]
            await self.send({**start, "headers": [*self.headers, *extra]})
        # a stream the relay ended with its error event is a failure, however it began
        if ended and self.keep is not None and self.status == 200 and self.size <= self.limit \
                and _STREAM_ERROR not in body:
            kept = [(k, v) for k, v in self.headers if k not in _NOT_KEPT and not k.startswith(b"x-ratelimit-")]
            self.kept = await self.keep(Answer(200, kept, b"".join(self.parts)))
        await self.send(msg)


class Idempotency:
    """Replay, refuse, or run once and keep the answer. ``shared`` (Redis) when given and answering,
    else ``local`` (disk)."""

    def __init__(self, local: Store, shared: Store | None = None, *, keep_s: float = KEEP_S,
                 in_flight_s: float = 130.0, max_answer_bytes: int = 1 << 20, probe_s: float = 1.0,
                 wall: Callable[[], float] = time.time, clock: Callable[[], float] = time.monotonic) -> None:
        self.local, self.shared = local, shared
        self.keep_s, self.in_flight_s, self.max_answer_bytes = keep_s, in_flight_s, max_answer_bytes
        self.probe_s, self.wall, self.clock = probe_s, wall, clock
        self.down_since: float | None = None  # Redis lost (monotonic); None while it answers
        self._probe_at = 0.0

    async def run(self, send: Send, head: list[tuple[bytes, bytes]], key_id: str, path: str, raw_key: bytes,
                  body: Any, serve: Callable[[Send], Awaitable[Outcome | None]],
                  count: Callable[[], Awaitable[bool]], owner: str = "") -> None:
        """``head``: the headers every answer of this request carries (X-Request-Id...); ``serve(send)`` runs the
        request; ``count()`` takes a request from the caller's limits for an answer from the store (False: it
        sent the 429); ``owner``: whose bound the kept answer counts in."""
        key = raw_key.decode("latin-1")
        if not 0 < len(key) <= MAX_KEY_LEN or not key.isascii() or not key.isprintable():
            await _error(send, head, 400, f"Idempotency-Key must be 1-{MAX_KEY_LEN} printable ASCII characters",
                         "invalid_idempotency_key")
            return
        name = hashlib.sha256(f"{key_id}\0{path}\0{key}".encode()).hexdigest()
        fp, token, now = fingerprint(body), secrets.token_hex(12), self.wall()
        store, extra = await self._pick()
        lost: Exception | None = None  # each failure is dealt with out of its handler, as compiled code needs
        try:  # (test_gateway_compiled_rules)
            held = await store.claim(name, fp, token, now, now + self.in_flight_s)
            if store is self.shared:
                self._back()
        except Exception as exc:
            lost = exc
        if lost is not None:
            if store is self.shared:  # Redis: down, for us; this gateway's disk instead
                self._lost(lost)
                store, extra = self.local, [(STATUS, b"local")]
            without = False
            try:
                held = await self.local.claim(name, fp, token, now, now + self.in_flight_s)
            except Exception:  # the disk too (full, read-only): serve without, and say so
                log.exception("idempotency: the disk store failed; serving without")
                without = True
            if without:
                await serve(Capture(send, 0, [(STATUS, b"unavailable")]))
                return
        if held is not None:
            if await count():
                await self._held(send, head, fp, held)
            return
        async def keep(answer: Answer) -> bool:
            now = self.wall()
            try:
                return await store.complete(name, token, answer.encode(), now, now + self.keep_s, owner)
            except Exception as exc:  # only not kept; a claim left behind lapses in in_flight_s
                if store is self.shared:
                    self._lost(exc)
                else:
                    log.warning("idempotency: an answer not kept (%s: %s)", type(exc).__name__, exc)
                return False

        capture = Capture(send, self.max_answer_bytes, extra, keep)
        outcome: Outcome | None = None
        failure: BaseException | None = None
        try:
            outcome = await serve(capture)
        except BaseException as exc:  # cancelled too: released below, then raised again
            failure = exc  # out of the handler, as compiled code needs: test_gateway_compiled_rules
        if not capture.kept or outcome is None or outcome.status != 200:
            with contextlib.suppress(Exception):
                await store.release(name, token)
        if failure is not None:
            raise failure

    async def _held(self, send: Send, head: list[tuple[bytes, bytes]], fp: str, held: Held) -> None:
        if held.fingerprint != fp:
            await _error(send, head, 422, "this Idempotency-Key was used with a different request body within "
                         f"{self.keep_s / 3600:g} h: use a new key for a new request", "idempotency_key_reused")
        elif held.answer is None:
            await _error(send, head, 409, "a request with this Idempotency-Key is still in progress: retry "
                         "after it ends", "idempotency_key_in_use",
                         [(b"retry-after", b"1"), (b"retry-after-ms", b"500"), (b"x-should-retry", b"true")])
        else:
            a = Answer.decode(held.answer)
            names = {k for k, _ in a.headers}  # the region that served it, not this one's again
            await send({"type": "http.response.start", "status": a.status,
                        "headers": [*a.headers, *(h for h in head if h[0] not in names), REPLAYED]})
            await send({"type": "http.response.body", "body": a.body})

    async def _pick(self) -> tuple[Store, list[tuple[bytes, bytes]]]:
        if self.shared is None:
            return self.local, []
        if self.down_since is not None:
            t = self.clock()
            if t < self._probe_at:
                return self.local, [(STATUS, b"local")]
            self._probe_at = t + self.probe_s  # this request tries Redis again; the others meanwhile do not
            log.debug("idempotency: trying Redis again")
        return self.shared, []

    def _lost(self, exc: BaseException) -> None:
        if self.down_since is None:
            self.down_since = self.clock()
            self._probe_at = self.down_since + self.probe_s
            log.warning("idempotency: Redis lost (%s: %s); until it answers, records are kept on this gateway "
                        "only", type(exc).__name__, str(exc)[:200])

    def _back(self) -> None:
        if self.down_since is not None:
            log.warning("idempotency: Redis back after %.1f s", self.clock() - self.down_since)
            self.down_since = None


async def _error(send: Send, head: list[tuple[bytes, bytes]], status: int, message: str, code: str,
                 headers: list[tuple[bytes, bytes]] | None = None) -> None:
    body = orjson.dumps({"error": {"message": message, "type": "invalid_request_error", "param": "Idempotency-Key",
                                   "code": code}})
    await send({"type": "http.response.start", "status": status, "headers": [
        (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *head,
        *(headers or [])]})
    await send({"type": "http.response.body", "body": body})
