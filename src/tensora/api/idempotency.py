"""Idempotency-Key for POSTs: the same key and body replay the first response.

A record is keyed by (calling key id, method, path, Idempotency-Key) and holds a fingerprint
of the body. It is claimed by an atomic INSERT (never check-then-insert): the loser of a
race reads the winner's record. While the first request runs, the claim expires after
``in_flight_s`` (60 s: a request's timeout scale, so a crash does not lock the key for
long); once its response is stored, the record is kept ``keep_s`` (24 h) and then
forgotten. Validation failures (422), server errors, answers that ask for a retry
(``Retry-After``, e.g. a 409 "still stopping") and quota refusals are not stored, so a
corrected or retried request runs afresh.

A record never holds a secret: ``replay`` says what of a response is kept for replays (a
key creation keeps all but the new key's secret), and a replay answers that.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson
from fastapi.responses import JSONResponse, Response

from tensora.api import metrics
from tensora.api.errors import NAME_TAKEN, QUOTA_EXCEEDED, ApiError
from tensora.clock import Clock
from tensora.errors import Conflict
from tensora.store import idempotency as idempotency_repo
from tensora.store.db import Database

IN_FLIGHT_S = 60.0
KEEP_S = 24 * 3600.0
MAX_KEY_LEN = 255


@dataclass(frozen=True, slots=True)
class Claim:
    pk: dict[str, Any]
    fingerprint: str


def fingerprint(method: str, path: str, body: Any) -> str:
    raw = orjson.dumps([method, path, body], option=orjson.OPT_SORT_KEYS)
    return hashlib.sha256(raw).hexdigest()


class Idempotency:
    def __init__(self, db: Database, clock: Clock, in_flight_s: float = IN_FLIGHT_S, keep_s: float = KEEP_S) -> None:
        self.db, self.clock, self.in_flight_s, self.keep_s = db, clock, in_flight_s, keep_s

    def run(self, key_id: str, method: str, path: str, key: str | None, body: Any,
            action: Callable[[Any], tuple[int, dict[str, Any]]], on_done: Callable[[], None] | None = None,
            replay: Callable[[dict[str, Any]], dict[str, Any]] | None = None) -> Response:
        """Run ``action(conn)`` -> (status, body) once per key; replay or refuse duplicates. ``replay(body)``:
        what is stored and replayed instead of the body (the first caller alone gets the whole body)."""
        if key is None:
            with self.db.write() as conn:
                status, payload = action(conn)
            if on_done:
                on_done()
            return JSONResponse(payload, status_code=status)
        if not key or len(key) > MAX_KEY_LEN or not key.isprintable():
            raise ApiError(422, f"Idempotency-Key must be 1-{MAX_KEY_LEN} printable characters",
                           field="Idempotency-Key")
        claim = Claim({"key_id": key_id, "method": method, "path": path, "key": key},
                      fingerprint(method, path, body))
        replayed = self._claim(claim)
        if replayed is not None:
            return replayed
        try:
            with self.db.write() as conn:
                status, payload = action(conn)
                text = orjson.dumps(payload).decode()
                if 200 <= status < 300:
                    kept = orjson.dumps(replay(payload)).decode() if replay else text
                    idempotency_repo.complete_idempotency(conn, claim.pk, status, kept, self.clock.now() + self.keep_s)
        except ApiError as exc:
            if (exc.status in (422, 400) or exc.status >= 500 or "Retry-After" in exc.headers
                    or exc.type in (QUOTA_EXCEEDED, NAME_TAKEN)):
                self._release(claim)
            else:
                self._store_error(claim, exc)
            raise
        except BaseException:
            self._release(claim)
            raise
        if not 200 <= status < 300:
            self._release(claim)
        if on_done:
            on_done()
        return Response(text, status_code=status, media_type="application/json")

    def _claim(self, claim: Claim) -> Response | None:
        now = self.clock.now()
        row = {**claim.pk, "fingerprint": claim.fingerprint, "state": "in_flight", "status": None, "body": None,
               "created_at": now, "expires_at": now + self.in_flight_s}
        try:
            with self.db.write() as conn:
                idempotency_repo.claim_idempotency(conn, row)
            return None
        except Conflict:
            pass
        with self.db.write() as conn:
            if idempotency_repo.take_over_expired(conn, claim.pk, row, now):
                return None
            existing = idempotency_repo.get_idempotency(conn, claim.pk)
        if existing is None:  # released between our insert and read: try once more
            return self._claim(claim)
        if existing.fingerprint != claim.fingerprint:
            metrics.idempotency("mismatch")
            raise ApiError(422, "this Idempotency-Key was used with a different request body",
                           field="Idempotency-Key")
        if existing.state != "done":
            # The first request usually ends within milliseconds: ask for a short wait.
            metrics.idempotency("conflict")
            raise ApiError(409, "a request with this Idempotency-Key is still in progress", retry_after=1,
                           headers={"x-should-retry": "true", "retry-after-ms": "100"})
        metrics.idempotency("replayed")
        assert existing.status is not None  # a done record holds its response
        return Response(existing.body, status_code=existing.status, media_type="application/json",
                        headers={"Idempotent-Replayed": "true"})

    def _release(self, claim: Claim) -> None:
        try:
            with self.db.write() as conn:
                idempotency_repo.drop_idempotency(conn, claim.pk)
        except Exception:  # the claim expires by itself in in_flight_s
            pass

    def _store_error(self, claim: Claim, exc: ApiError) -> None:
        with self.db.write() as conn:
            idempotency_repo.complete_idempotency(conn, claim.pk, exc.status, orjson.dumps(exc.body()).decode(),
                                      self.clock.now() + self.keep_s)
