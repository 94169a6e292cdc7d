"""Requests- and tokens-per-minute per owner (across all its keys) and per key, with tokens reserved at
admission and settled after.

A request is admitted only if one more request and its reservation (prompt estimate + ``max_tokens``)
fit in its owner's current one-minute window, shared by all the owner's keys, and, when the key has
lower limits of its own, in the key's window too: both are checked and taken in one step, so a key can
narrow its owner's limit, never widen it, and an owner's many keys never multiply it. When the request
ends its reservation is settled to the tokens really used, so admitted reservations never pass a limit.

``MemoryLimiter`` keeps the windows in this process (one gateway); ``RedisLimiter`` keeps them in Redis,
admitting with one Lua script call (atomic, one round trip), so the limits hold across several gateways.
Redis failing is no reason to answer 500: its calls time out (50 ms), and while it is down each gateway
either admits against its own in-memory windows at limit / ``replicas`` (``local``) or refuses with 503
(``closed``); it probes Redis again at most once a ``probe_s`` and says so once per outage, not per request.
Written here rather than with the ``limits`` package: it has no reservation that can be given back, and
the headers need the windows' remaining counts from the same atomic step.
"""

from __future__ import annotations

import functools
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Protocol

WINDOW_S = 60

log = logging.getLogger("tensora.gateway")


@dataclass(frozen=True, slots=True)
class Quota:
    rpm: int
    tpm: int


@dataclass(frozen=True, slots=True)
class Caller:
    """Whose windows a request counts against: its owner's, and its key's when the key is held lower."""

    owner: str
    quota: Quota  # the owner's, shared by all its keys
    key_id: str = ""
    key_quota: Quota | None = None  # the key's own limits, each at most the owner's; None: the owner's only
    windows: tuple[tuple[str, Quota], ...] = field(init=False, compare=False)  # ("owner" | "key", its quota)

    def __post_init__(self) -> None:  # once per key and route table: the proxy keeps its callers
        wins = (("owner", self.quota),) if self.key_quota is None else (("owner", self.quota), ("key", self.key_quota))
        object.__setattr__(self, "windows", wins)


class Refused(StrEnum):
    REQUESTS = "requests"
    TOKENS = "tokens"
    UNAVAILABLE = "unavailable"  # the shared limiter is down and fails closed: a 503, not a 429


@dataclass(slots=True, init=False)  # made once a request: see ``call.Call`` for why the __init__ of its own
class Admission:
    ok: bool
    window: int  # which minute (epoch // 60) the reservation is in
    quota: Quota  # what the headers report: for requests and for tokens, the tighter window's limit
    requests: int  # used in that window, this request included when admitted
    tokens: int
    reset_s: float  # seconds until the window ends
    reason: Refused | None = None  # why it was refused
    scope: str = ""  # which window refused it: "owner" or "key"
    caller: Caller | None = None  # whose windows hold the reservation (for settle)
    reserved: int = 0
    local: bool = False  # admitted by a gateway's own windows (Redis down, or no Redis)

    def __init__(self, ok: bool, window: int, quota: Quota, requests: int, tokens: int, reset_s: float,
                 reason: Refused | None = None, scope: str = "", caller: Caller | None = None, reserved: int = 0,
                 local: bool = False) -> None:
        self.ok, self.window, self.quota, self.requests, self.tokens = ok, window, quota, requests, tokens
        self.reset_s, self.reason, self.scope, self.caller = reset_s, reason, scope, caller
        self.reserved, self.local = reserved, local

    @property
    def retry_after(self) -> int:
        return max(1, math.ceil(self.reset_s))

    def headers(self) -> list[tuple[bytes, bytes]]:
        """OpenAI's x-ratelimit-* headers and the IETF RateLimit-Policy / RateLimit fields."""
        q = self.quota
        rr, rt = max(0, q.rpm - self.requests), max(0, q.tpm - self.tokens)
        reset = b"%.3fs" % self.reset_s
        t = self.retry_after
        limit_requests, limit_tokens, policy = _static(q.rpm, q.tpm)
        return [
            limit_requests, (b"x-ratelimit-remaining-requests", b"%d" % rr), (b"x-ratelimit-reset-requests", reset),
            limit_tokens, (b"x-ratelimit-remaining-tokens", b"%d" % rt), (b"x-ratelimit-reset-tokens", reset),
            policy, (b"ratelimit", b'"requests";r=%d;t=%d, "tokens";r=%d;t=%d' % (rr, t, rt, t)),
        ]


@functools.lru_cache(maxsize=4096)
def _static(rpm: int, tpm: int) -> tuple[tuple[bytes, bytes], ...]:
    """The headers of a quota that do not change from request to request, made once (they showed in profiles).
    By its numbers, not the ``Quota``: a frozen dataclass's ``__hash__`` runs as interpreted Python."""
    return ((b"x-ratelimit-limit-requests", b"%d" % rpm), (b"x-ratelimit-limit-tokens", b"%d" % tpm),
            (b"ratelimit-policy", b'"requests";q=%d;w=%d, "tokens";q=%d;w=%d' % (rpm, WINDOW_S, tpm, WINDOW_S)))


class Limiter(Protocol):
    async def admit(self, caller: Caller, tokens: int, now: float) -> Admission: ...

    async def settle(self, adm: Admission, used: int) -> None: ...

    async def close(self) -> None: ...


def _window(now: float) -> tuple[int, float]:
    w = int(now // WINDOW_S)
    return w, (w + 1) * WINDOW_S - now


def decide(caller: Caller, used: list[tuple[int, int]], tokens: int, window: int, reset: float,
           local: bool = False) -> Admission:
    """The admission for ``used`` ((requests, tokens) so far in the owner's window, then the key's when it
    is held lower); pure. Refused by the first window it does not fit, the owner's first; the headers
    report, for requests and for tokens apart, the window with less left (the same left: the lower limit)."""
    q, (req, tok) = caller.quota, used[0]
    kq = caller.key_quota
    why: Refused | None = None
    scope = "owner"
    if req + 1 > q.rpm:
        why = Refused.REQUESTS
    elif tok + tokens > q.tpm:
        why = Refused.TOKENS
    if kq is None:  # the owner's window alone: the common case, kept short
        if why is not None:
            return Admission(False, window, q, req, tok, reset, why, scope, caller, 0, local)
        return Admission(True, window, q, req + 1, tok + tokens, reset, None, "", caller, tokens, local)
    kreq, ktok = used[1]
    if why is None:
        scope = "key"
        if kreq + 1 > kq.rpm:
            why = Refused.REQUESTS
        elif ktok + tokens > kq.tpm:
            why = Refused.TOKENS
    if why is None:
        req, tok, kreq, ktok = req + 1, tok + tokens, kreq + 1, ktok + tokens
    rpm, tpm = q.rpm, q.tpm
    if (kq.rpm - kreq, kq.rpm) < (rpm - req, rpm):
        rpm, req = kq.rpm, kreq
    if (kq.tpm - ktok, kq.tpm) < (tpm - tok, tpm):
        tpm, tok = kq.tpm, ktok
    return Admission(why is None, window, Quota(rpm, tpm), req, tok, reset, why, scope if why else "", caller,
                     0 if why else tokens, local)


class MemoryLimiter:
    """The windows in this process: one gateway's, or each gateway's share while Redis is down."""

    def __init__(self) -> None:
        self._windows: dict[str | tuple[str, str], list[int]] = {}  # owner, or (owner, key id) -> [window,
        # requests, tokens]
        self._latest = 0

    def _cell(self, i: str | tuple[str, str], w: int) -> list[int]:
        cur = self._windows.get(i)
        if cur is None or cur[0] != w:
            cur = self._windows[i] = [w, 0, 0]
        return cur

    def _cells(self, caller: Caller, w: int) -> list[list[int]]:
        if w > self._latest:  # a new minute: the old windows are done with
            self._windows.clear()
            self._latest = w
        if caller.key_quota is None:
            return [self._cell(caller.owner, w)]
        return [self._cell(caller.owner, w), self._cell((caller.owner, caller.key_id), w)]

    async def admit(self, caller: Caller, tokens: int, now: float) -> Admission:
        return self.admit_now(caller, tokens, now)

    def admit_now(self, caller: Caller, tokens: int, now: float, quota_share: int = 1) -> Admission:
        """One step, no await: admitted in every window or in none."""
        w, reset = _window(now)
        if quota_share > 1:
            caller = _share(caller, quota_share)
        cells = self._cells(caller, w)
        adm = decide(caller, [(c[1], c[2]) for c in cells], tokens, w, reset, local=True)
        if adm.ok:
            for c in cells:
                c[1] += 1
                c[2] += tokens
        return adm

    async def settle(self, adm: Admission, used: int) -> None:
        c = adm.caller
        if c is None or not adm.ok or used == adm.reserved:
            return
        for i in (c.owner,) if c.key_quota is None else (c.owner, (c.owner, c.key_id)):
            cur = self._windows.get(i)
            if cur is not None and cur[0] == adm.window:
                cur[2] = max(0, cur[2] + used - adm.reserved)

    async def close(self) -> None:
        return None


def _share(caller: Caller, n: int) -> Caller:
    """``caller``'s limits divided among ``n`` gateways (at least one request and token each)."""
    def part(q: Quota) -> Quota:
        return Quota(max(1, q.rpm // n), max(1, q.tpm // n))
    return Caller(caller.owner, part(caller.quota), caller.key_id,
                  part(caller.key_quota) if caller.key_quota is not None else None)


# KEYS: requests and tokens counters of each window (owner's, then key's); ARGV: cost, ttl, then rpm and tpm
# of each. Returns {admitted, then requests and tokens of each window before this request}: ``decide`` makes
# the same decision from them for the headers.
_ADMIT = """
local cost = tonumber(ARGV[1])
local got = redis.call('MGET', unpack(KEYS))
local out = {1}
for i = 1, #KEYS do out[i + 1] = tonumber(got[i] or '0') end
for i = 1, #KEYS / 2 do
  if out[2 * i] + 1 > tonumber(ARGV[2 * i + 1]) or out[2 * i + 1] + cost > tonumber(ARGV[2 * i + 2]) then
    out[1] = 0
    return out
  end
end
for i = 1, #KEYS / 2 do
  redis.call('INCR', KEYS[2 * i - 1])
  redis.call('INCRBY', KEYS[2 * i], cost)
  redis.call('EXPIRE', KEYS[2 * i - 1], ARGV[2])
  redis.call('EXPIRE', KEYS[2 * i], ARGV[2])
end
return out
"""
# KEYS: the tokens counters of the windows the reservation is in; ARGV: used - reserved
_SETTLE = """
for i = 1, #KEYS do
  if redis.call('EXISTS', KEYS[i]) == 1 then
    local tok = redis.call('INCRBY', KEYS[i], ARGV[1])
    if tok < 0 then redis.call('SET', KEYS[i], 0, 'KEEPTTL') end
  end
end
return 0
"""


class FailMode(StrEnum):
    LOCAL = "local"  # admit against this gateway's own windows at limit / replicas
    CLOSED = "closed"  # refuse with 503 and Retry-After


class RedisLimiter:
    """The windows in Redis, shared by every gateway using it; Redis down: ``fail_mode``.

    Counters are named ``PREFIX:{owner}:WINDOW:...`` (the owner as a Redis Cluster hash tag, so one
    script call touches one slot)."""

    def __init__(self, url: str, prefix: str = "tensora:rl", *, timeout_s: float = 0.05,
                 connect_timeout_s: float = 0.05, fail_mode: FailMode | str = FailMode.LOCAL, replicas: int = 1,
                 probe_s: float = 1.0, clock: Callable[[], float] = time.monotonic) -> None:
        import redis.asyncio as aioredis
        from redis.asyncio.retry import Retry
        from redis.backoff import NoBackoff

        self.redis: Any = aioredis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=connect_timeout_s,
                                            retry=Retry(NoBackoff(), 0))  # a retry would double the timeout
        self.prefix = prefix
        self.fail_mode, self.replicas, self.probe_s, self.clock = FailMode(fail_mode), replicas, probe_s, clock
        self.local = MemoryLimiter()
        self.down_since: float | None = None  # monotonic time Redis was lost; None while it answers
        self._probe_at = 0.0
        self._turn = 0  # one more at each transition: a call that began before one cannot cause another
        self._admit = self.redis.register_script(_ADMIT)
        self._settle = self.redis.register_script(_SETTLE)

    def _keys(self, caller: Caller, window: int) -> list[str]:
        base = f"{self.prefix}:{{{caller.owner}}}:{window}"
        keys = [f"{base}:r", f"{base}:t"]
        if caller.key_quota is not None:
            keys += [f"{base}:{caller.key_id}:r", f"{base}:{caller.key_id}:t"]
        return keys

    async def admit(self, caller: Caller, tokens: int, now: float) -> Admission:
        w, reset = _window(now)
        if self.down_since is not None:
            t = self.clock()
            if t < self._probe_at:
                return self._down(caller, tokens, now, reset, w)
            self._probe_at = t + self.probe_s  # this request probes; the others meanwhile do not
        args: list[int] = [tokens, WINDOW_S * 2]
        for _, q in caller.windows:
            args += [q.rpm, q.tpm]
        turn = self._turn
        try:
            got = await self._admit(keys=self._keys(caller, w), args=args)
        except Exception as exc:  # every way Redis can fail: down, for us
            self._lost(exc, turn)
            return self._down(caller, tokens, now, reset, w)
        self._back(turn)
        return decide(caller, [(int(got[1 + 2 * i]), int(got[2 + 2 * i])) for i in range(len(got) // 2)], tokens,
                      w, reset)

    def _down(self, caller: Caller, tokens: int, now: float, reset: float, w: int) -> Admission:
        if self.fail_mode is FailMode.CLOSED:
            return Admission(False, w, caller.quota, 0, 0, reset, Refused.UNAVAILABLE, caller=caller)
        return self.local.admit_now(caller, tokens, now, quota_share=self.replicas)

    def _lost(self, exc: BaseException, turn: int) -> None:
        if self.down_since is None and turn == self._turn:
            self._turn += 1
            self.down_since = self.clock()
            self._probe_at = self.down_since + self.probe_s
            log.warning("rate limits: Redis lost (%s: %s); until it answers again, %s", type(exc).__name__,
                        str(exc)[:200], f"each gateway admits 1/{self.replicas} of each limit on its own"
                        if self.fail_mode is FailMode.LOCAL else "inference is refused with 503")

    def _back(self, turn: int) -> None:
        if self.down_since is not None and turn == self._turn:
            self._turn += 1
            log.warning("rate limits: Redis back after %.1f s; limits shared again", self.clock() - self.down_since)
            self.down_since = None

    async def settle(self, adm: Admission, used: int) -> None:
        if adm.local:
            await self.local.settle(adm, used)
            return
        if adm.caller is None or not adm.ok or used == adm.reserved or self.down_since is not None:
            return  # Redis down: the reservation stays as it was, erring on the safe side
        turn = self._turn
        try:
            await self._settle(keys=self._keys(adm.caller, adm.window)[1::2], args=[used - adm.reserved])
        except Exception as exc:
            self._lost(exc, turn)

    async def close(self) -> None:
        await self.redis.aclose()
