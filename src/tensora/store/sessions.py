"""Dashboard sessions: a browser's sign-in, made from an API key and revoked with it."""

from __future__ import annotations

from dataclasses import asdict, fields

from sqlalchemy import Connection, bindparam, delete, insert, select, update

from tensora.store.rows import SessionRow
from tensora.store.tables import K, S

_S_COLUMNS = [S.c[f.name] for f in fields(SessionRow)]


_LIVE_SESSION = (select(*_S_COLUMNS, K.c.scopes).join(K, K.c.id == S.c.key_id)
                 .where(S.c.id == bindparam("b_id"), S.c.revoked_at.is_(None), K.c.revoked_at.is_(None)))


def insert_session(conn: Connection, row: SessionRow) -> None:
    conn.execute(insert(S), asdict(row))


def live_session(conn: Connection, digest: str) -> tuple[SessionRow, tuple[str, ...]] | None:
    """The session with this digest and its key's scopes, unless it or its key is revoked (the caller
    checks its lifetime and idle timeout: ``SessionRow.live``)."""
    found = conn.execute(_LIVE_SESSION, {"b_id": digest}).first()
    if found is None:
        return None
    *columns, scopes = found
    return SessionRow(*columns), tuple(scopes)


def touch_session(conn: Connection, digest: str, at: float) -> None:
    conn.execute(update(S).where(S.c.id == digest, S.c.revoked_at.is_(None)).values(last_seen_at=at))


def revoke_session(conn: Connection, digest: str, at: float) -> bool:
    q = update(S).where(S.c.id == digest, S.c.revoked_at.is_(None)).values(revoked_at=at)
    return conn.execute(q).rowcount == 1


def revoke_sessions_of_key(conn: Connection, key_id: str, at: float) -> int:
    q = update(S).where(S.c.key_id == key_id, S.c.revoked_at.is_(None)).values(revoked_at=at)
    return conn.execute(q).rowcount


def prune_sessions(conn: Connection, now: float) -> int:
    """Forget the sessions past their lifetime (signed out or not): they can never be used again."""
    return conn.execute(delete(S).where(S.c.expires_at <= now)).rowcount
