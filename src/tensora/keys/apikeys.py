"""API keys: ``tsk_`` + 32 random base62 characters + a 6-character checksum.

The checksum (CRC-32 of the random part, in base62) lets a server reject a mistyped or
made-up key before any lookup. Only the SHA-256 digest of a key is stored; the secret is
shown once, when it is created. Comparison of digests is constant-time.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import string
import zlib

PREFIX = "tsk_"
_B62 = string.digits + string.ascii_letters
_RANDOM_LEN = 32
_CHECK_LEN = 6
KEY_LEN = len(PREFIX) + _RANDOM_LEN + _CHECK_LEN

SCOPES = ("workloads:read", "workloads:write", "usage:read", "keys:write", "inference", "admin")
DEFAULT_SCOPES = ("workloads:read", "workloads:write", "usage:read", "keys:write", "inference")


def _base62(n: int, width: int) -> str:
    out = ""
    while n:
        n, r = divmod(n, 62)
        out = _B62[r] + out
    return out.rjust(width, "0")[-width:]


def _checksum(body: str) -> str:
    return _base62(zlib.crc32(body.encode()), _CHECK_LEN)


def generate() -> str:
    body = "".join(secrets.choice(_B62) for _ in range(_RANDOM_LEN))
    return PREFIX + body + _checksum(body)


def well_formed(key: str) -> bool:
    """Prefix, length, alphabet and checksum; no lookup."""
    if len(key) != KEY_LEN or not key.startswith(PREFIX):
        return False
    rest = key[len(PREFIX):]
    if any(c not in _B62 for c in rest):
        return False
    return hmac.compare_digest(_checksum(rest[:_RANDOM_LEN]), rest[_RANDOM_LEN:])


def digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def same_digest(a: str, b: str) -> bool:
    return hmac.compare_digest(a.encode(), b.encode())


def hint(key: str) -> str:
    """What a listing shows of a key: its prefix and last four characters."""
    return key[: len(PREFIX) + 4] + "…" + key[-4:]


def allows(granted: list[str] | tuple[str, ...], needed: str) -> bool:
    return "admin" in granted or needed in granted
