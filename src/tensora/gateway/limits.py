"""Requests- and tokens-per-minute per key, with tokens reserved at admission and settled after.

A request is admitted only if one more request and its reservation (prompt estimate +
``max_tokens``) fit in the key's current one-minute window; when it ends, the reservation is
settled to the tokens really used. So the sum of admitted reservations never passes the limit.

``MemoryLimiter`` keeps the windows in this process (one gateway); ``RedisLimiter`` keeps them in
Redis, admitting with one Lua script (atomic), so the limit holds across several gateways.
Written here rather than with the ``limits`` package: it has no reservation that can be given
back, and the headers need the window's remaining counts from the same atomic step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Protocol

WINDOW_S = 60


@dataclass(frozen=True, slots=True)
class Quota:
    rpm: int
    tpm: int


@dataclass(frozen=True, slots=True)
class Admission:
    ok: bool
    window: int  # which minute (epoch // 60) the reservation is in
    quota: Quota
    requests: int  # used in the window, this request included when admitted
    tokens: int
    reset_s: float  # seconds until the window ends
    reason: str = ""  # "requests" or "tokens" when refused

    @property
    def retry_after(self) -> int:
        return max(1, math.ceil(self.reset_s))

    def headers(self) -> list[tuple[bytes, bytes]]:
        """OpenAI's x-ratelimit-* headers and the IETF RateLimit-Policy / RateLimit fields."""
        q = self.quota
        rr, rt = max(0, q.rpm - self.requests), max(0, q.tpm - self.tokens)
        reset = f"{self.reset_s:.3f}s".encode()
        t = str(self.retry_after).encode()
        return [
            (b"x-ratelimit-limit-requests", str(q.rpm).encode()),
            (b"x-ratelimit-remaining-requests", str(rr).encode()),
            (b"x-ratelimit-reset-requests", reset),
            (b"x-ratelimit-limit-tokens", str(q.tpm).encode()),
            (b"x-ratelimit-remaining-tokens", str(rt).encode()),
            (b"x-ratelimit-reset-tokens", reset),
            (b"ratelimit-policy", b'"requests";q=%d;w=%d, "tokens";q=%d;w=%d' % (q.rpm, WINDOW_S, q.tpm, WINDOW_S)),
            (b"ratelimit", b'"requests";r=%d;t=%s, "tokens";r=%d;t=%s' % (rr, t, rt, t)),
        ]


class Limiter(Protocol):
    async def admit(self, key_id: str, quota: Quota, tokens: int, now: float) -> Admission: ...

    async def settle(self, key_id: str, window: int, reserved: int, used: int) -> None: ...

    async def close(self) -> None: ...


def _window(now: float) -> tuple[int, float]:
    w = int(now // WINDOW_S)
    return w, (w + 1) * WINDOW_S - now


class MemoryLimiter:
    def __init__(self) -> None:
        self._windows: dict[str, list[int]] = {}  # key -> [window, requests, tokens]

    async def admit(self, key_id: str, quota: Quota, tokens: int, now: float) -> Admission:
        w, reset = _window(now)
        cur = self._windows.get(key_id)
        if cur is None or cur[0] != w:
            cur = self._windows[key_id] = [w, 0, 0]
        _, req, tok = cur
        if req + 1 > quota.rpm:
            return Admission(False, w, quota, req, tok, reset, "requests")
        if tok + tokens > quota.tpm:
            return Admission(False, w, quota, req, tok, reset, "tokens")
        cur[1], cur[2] = req + 1, tok + tokens
        return Admission(True, w, quota, req + 1, tok + tokens, reset)

    async def settle(self, key_id: str, window: int, reserved: int, used: int) -> None:
        cur = self._windows.get(key_id)
        if cur is not None and cur[0] == window:
            cur[2] = max(0, cur[2] + used - reserved)

    async def close(self) -> None:
        return None


# KEYS: requests counter, tokens counter; ARGV: rpm, tpm, tokens, ttl
_ADMIT = """
local req = tonumber(redis.call('GET', KEYS[1]) or '0')
local tok = tonumber(redis.call('GET', KEYS[2]) or '0')
local rpm, tpm, cost = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
if req + 1 > rpm then return {0, req, tok, 1} end
if tok + cost > tpm then return {0, req, tok, 2} end
req = redis.call('INCR', KEYS[1])
tok = redis.call('INCRBY', KEYS[2], cost)
redis.call('EXPIRE', KEYS[1], ARGV[4])
redis.call('EXPIRE', KEYS[2], ARGV[4])
return {1, req, tok, 0}
"""
_SETTLE = """
if redis.call('EXISTS', KEYS[1]) == 1 then
  local tok = redis.call('INCRBY', KEYS[1], ARGV[1])
  if tok < 0 then redis.call('SET', KEYS[1], 0, 'KEEPTTL') end
end
return 0
"""


class RedisLimiter:
    def __init__(self, url: str, prefix: str = "tensora:rl") -> None:
        import redis.asyncio as aioredis

        self.redis: Any = aioredis.from_url(url)
        self.prefix = prefix
        self._admit = self.redis.register_script(_ADMIT)
        self._settle = self.redis.register_script(_SETTLE)

    def _keys(self, key_id: str, window: int) -> list[str]:
        return [f"{self.prefix}:{key_id}:{window}:r", f"{self.prefix}:{key_id}:{window}:t"]

    async def admit(self, key_id: str, quota: Quota, tokens: int, now: float) -> Admission:
        w, reset = _window(now)
        ok, req, tok, why = await self._admit(keys=self._keys(key_id, w),
                                              args=[quota.rpm, quota.tpm, tokens, WINDOW_S * 2])
        return Admission(bool(ok), w, quota, int(req), int(tok), reset,
                         {1: "requests", 2: "tokens"}.get(int(why), ""))

    async def settle(self, key_id: str, window: int, reserved: int, used: int) -> None:
        if used != reserved:
            await self._settle(keys=self._keys(key_id, window)[1:], args=[used - reserved])

    async def close(self) -> None:
        await self.redis.aclose()
