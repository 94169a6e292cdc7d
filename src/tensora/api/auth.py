"""Who is calling: ``Authorization: Bearer <key>`` -> a Principal with an owner and scopes.

A malformed key (bad prefix, length, checksum) is refused before any lookup. Found keys are
compared by digest in constant time. Lookups are cached for ``cache_ttl_s`` (2 s by default)
so that a burst of requests does not read the same row thousands of times; a key revoked
through this server leaves the cache at once, one revoked elsewhere within the TTL.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from fastapi import Request

from tensora.api.errors import ApiError
from tensora.api.principal import Principal
from tensora.keys import apikeys
from tensora.store import keys as keys_repo
from tensora.store.db import Database
from tensora.store.ids import new_id
from tensora.store.keys import KeyRow


class KeyChecker:
    def __init__(self, db: Database, cache_ttl_s: float = 2.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.db = db
        self.ttl = cache_ttl_s
        self.clock = clock  # what the cache's TTL is counted on
        self._cache: dict[str, tuple[float, Principal]] = {}
        self._lock = threading.Lock()

    def cached(self, request: Request) -> Principal | None:
        """The caller from the cache, without I/O (None on a miss); 401 for a missing or malformed key."""
        hit = self._cache.get(self._digest(request))
        return hit[1] if hit and hit[0] > self.clock() else None

    @staticmethod
    def _digest(request: Request) -> str:
        header = request.headers.get("authorization", "")
        scheme, _, key = header.partition(" ")
        if scheme.lower() != "bearer" or not key:
            raise ApiError(401, "missing API key: send Authorization: Bearer <key>",
                           headers={"WWW-Authenticate": "Bearer"})
        key = key.strip()
        if not apikeys.well_formed(key):
            raise ApiError(401, "invalid API key", headers={"WWW-Authenticate": "Bearer"})
        return apikeys.digest(key)

    def check(self, request: Request) -> Principal:
        return self._check(self._digest(request))

    def lookup(self, key: str) -> Principal | None:
        """The live key's principal, or None for a malformed, unknown or revoked key (the dashboard's sign-in)."""
        key = key.strip()
        if not apikeys.well_formed(key):
            return None
        try:
            return self._check(apikeys.digest(key))
        except ApiError:
            return None

    def _check(self, d: str) -> Principal:
        now = self.clock()
        hit = self._cache.get(d)
        if hit and hit[0] > now:
            return hit[1]
        with self.db.read() as conn:
            row = keys_repo.key_by_digest(conn, d)
        if row is None or not apikeys.same_digest(row.digest, d) or row.revoked_at is not None:
            raise ApiError(401, "invalid API key", headers={"WWW-Authenticate": "Bearer"})
        p = Principal(row.id, row.owner, tuple(row.scopes))
        with self._lock:
            if len(self._cache) > 10_000:
                self._cache.clear()
            self._cache[d] = (now + self.ttl, p)
        return p

    def forget(self, key_id: str) -> None:
        with self._lock:
            for d, (_, p) in list(self._cache.items()):
                if p.key_id == key_id:
                    del self._cache[d]


def create_key(conn: Any, owner: str, name: str, scopes: list[str], now: float, *, rpm: int | None = None,
               tpm: int | None = None) -> tuple[str, KeyRow]:
    """A new key: (the secret, shown once; the stored row)."""
    secret = apikeys.generate()
    row = KeyRow(id=new_id("key_"), digest=apikeys.digest(secret), hint=apikeys.hint(secret), owner=owner, name=name,
                 scopes=list(scopes), created_at=now, revoked_at=None, rpm=rpm, tpm=tpm)
    keys_repo.insert_key(conn, row)
    return secret, row
