"""The dashboard's sessions: a browser signs in with an API key once and holds a random session id after.

The key never leaves the sign-in request: the browser gets ``secrets.token_urlsafe(32)`` and the store keeps
only its SHA-256, beside the key it acts as. A session acts as that key (its owner, its scopes as they are
now) until the first of: its absolute lifetime (``lifetime_s``, 12 h by default), ``idle_s`` (1 h) without a
page, sign-out, or its key's revocation. Every use reads the session joined with its key, so a key revoked
by any path (the API, another server, an operator's SQL) ends its sessions at once, and revoking a key
through the API also marks its sessions signed out. Nothing is cached: the dashboard reads one row per page.
"""

from __future__ import annotations

import hashlib
import secrets

from tensora.api.auth import KeyChecker
from tensora.api.principal import Principal
from tensora.clock import Clock
from tensora.store import sessions as sessions_repo
from tensora.store.db import Database
from tensora.store.rows import SessionRow

LIFETIME_S = 12 * 3600.0
IDLE_S = 3600.0
TOUCH_S = 60.0
"""A use moves ``last_seen_at`` only once it is this old: a page view writes at most once a minute."""
MAX_ID_LEN = 128
"""Longer than any id this makes (43 characters); anything longer is refused unread."""


def digest(session_id: str) -> str:
    return hashlib.sha256(session_id.encode()).hexdigest()


class Sessions:
    def __init__(self, db: Database, clock: Clock, keys: KeyChecker, *, lifetime_s: float = LIFETIME_S,
                 idle_s: float = IDLE_S) -> None:
        self.db, self.clock, self.keys = db, clock, keys
        self.lifetime_s, self.idle_s = lifetime_s, idle_s

    def start(self, key: str) -> str | None:
        """A new session for a live key: its id (for the browser alone), or None if the key is refused."""
        p = self.keys.lookup(key)
        if p is None:
            return None
        session_id, now = secrets.token_urlsafe(32), self.clock.now()
        with self.db.write() as conn:
            sessions_repo.prune_sessions(conn, now)
            row = SessionRow(digest(session_id), p.key_id, p.owner, now, now + self.lifetime_s, now)
            sessions_repo.insert_session(conn, row)
        return session_id

    def principal(self, session_id: str, *, active: bool = True) -> Principal | None:
        """Who this session acts as, or None once it ended. ``active``: a page the user asked for (it keeps
        the session from going idle; a page's own refresh does not)."""
        if not session_id or len(session_id) > MAX_ID_LEN:
            return None
        d, now = digest(session_id), self.clock.now()
        with self.db.read() as conn:
            found = sessions_repo.live_session(conn, d)
        if found is None or not found[0].live(now, self.idle_s):
            return None
        row, scopes = found
        if active and now - row.last_seen_at >= TOUCH_S:
            with self.db.write() as conn:
                sessions_repo.touch_session(conn, d, now)
        return Principal(row.key_id, row.owner, scopes)

    def end(self, session_id: str) -> None:
        """Sign out: the session id is worth nothing from now on, wherever it was copied."""
        if session_id and len(session_id) <= MAX_ID_LEN:
            with self.db.write() as conn:
                sessions_repo.revoke_session(conn, digest(session_id), self.clock.now())
