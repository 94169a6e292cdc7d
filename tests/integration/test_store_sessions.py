"""Dashboard sessions in the store, on SQLite and PostgreSQL: found only while neither the session nor its
key is revoked; signed out one by one or all of a key's at once; forgotten past their lifetime."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from sqlalchemy import Connection

from tensora.api.auth import create_key
from tensora.store import keys as keys_repo
from tensora.store import sessions as sessions_repo
from tensora.store.db import Database
from tensora.store.rows import SessionRow

T0 = 1_000.0


def session(digest: str, key_id: str, owner: str = "alice", expires_at: float = T0 + 100) -> SessionRow:
    return SessionRow(digest, key_id, owner, T0, expires_at, T0)


def keys(db: Database) -> tuple[str, str]:
    with db.write() as conn:
        _, a = create_key(conn, "alice", "a", ["workloads:read"], T0)
        _, b = create_key(conn, "alice", "b", ["workloads:read", "usage:read"], T0)
    return a.id, b.id


def test_a_session_is_found_with_its_keys_scopes(db: Database) -> None:
    _, b = keys(db)
    with db.write() as conn:
        sessions_repo.insert_session(conn, session("d" * 64, b))
    with db.read() as conn:
        assert sessions_repo.live_session(conn, "d" * 64) == (session("d" * 64, b), ("workloads:read", "usage:read"))
        assert sessions_repo.live_session(conn, "e" * 64) is None


REVOKE = {  # what happens -> which of (a1, a2: key a's; b1: key b's) are still found
    "sign out a1": (lambda conn, a: sessions_repo.revoke_session(conn, "a1".ljust(64, "0"), T0 + 1), {"a2", "b1"}),
    "revoke key a's sessions": (lambda conn, a: sessions_repo.revoke_sessions_of_key(conn, a, T0 + 1), {"b1"}),
    "revoke key a itself": (lambda conn, a: keys_repo.revoke_key(conn, a, None, T0 + 1), {"b1"}),
}


@pytest.mark.parametrize("case", REVOKE.values(), ids=REVOKE.keys())
def test_revocations(db: Database, case: tuple[Callable[[Connection, str], object], set[str]]) -> None:
    action, want = case
    a, b = keys(db)
    with db.write() as conn:
        for name, key_id in [("a1", a), ("a2", a), ("b1", b)]:
            sessions_repo.insert_session(conn, session(name.ljust(64, "0"), key_id))
    with db.write() as conn:
        assert action(conn, a)
    with db.read() as conn:
        found = {n for n in ("a1", "a2", "b1") if sessions_repo.live_session(conn, n.ljust(64, "0")) is not None}
    assert found == want


def test_signing_out_twice_is_one_revocation_and_a_touch_keeps_it_out(db: Database) -> None:
    a, _ = keys(db)
    with db.write() as conn:
        sessions_repo.insert_session(conn, session("s" * 64, a))
        assert sessions_repo.revoke_session(conn, "s" * 64, T0 + 1)
        assert not sessions_repo.revoke_session(conn, "s" * 64, T0 + 2)
        sessions_repo.touch_session(conn, "s" * 64, T0 + 3)
    with db.read() as conn:
        assert sessions_repo.live_session(conn, "s" * 64) is None


def test_touch_moves_last_seen(db: Database) -> None:
    a, _ = keys(db)
    with db.write() as conn:
        sessions_repo.insert_session(conn, session("s" * 64, a))
        sessions_repo.touch_session(conn, "s" * 64, T0 + 50)
    with db.read() as conn:
        found = sessions_repo.live_session(conn, "s" * 64)
    assert found is not None and found[0].last_seen_at == T0 + 50


def test_prune_forgets_only_sessions_past_their_lifetime(db: Database) -> None:
    a, _ = keys(db)
    with db.write() as conn:
        sessions_repo.insert_session(conn, session("old".ljust(64, "0"), a, expires_at=T0 + 10))
        sessions_repo.insert_session(conn, session("new".ljust(64, "0"), a, expires_at=T0 + 20))
    with db.write() as conn:
        assert sessions_repo.prune_sessions(conn, T0 + 10) == 1
    with db.read() as conn:
        assert sessions_repo.live_session(conn, "old".ljust(64, "0")) is None
        assert sessions_repo.live_session(conn, "new".ljust(64, "0")) is not None


LIVE = {  # (now, last seen, revoked) against a session made at T0 that expires at T0 + 100, idle 30 s
    "fresh": (T0 + 1, T0, None, True),
    "idle just under the timeout": (T0 + 29.9, T0, None, True),
    "idle at the timeout": (T0 + 30, T0, None, False),
    "used lately, before the lifetime": (T0 + 99.9, T0 + 90, None, True),
    "used lately, at the lifetime": (T0 + 100, T0 + 90, None, False),
    "signed out": (T0 + 1, T0, T0 + 0.5, False),
}


@pytest.mark.parametrize("case", LIVE.values(), ids=LIVE.keys())
def test_live(case: tuple[float, float, float | None, bool]) -> None:
    now, seen, revoked, want = case
    row = SessionRow("d" * 64, "key_x", "alice", T0, T0 + 100, seen, revoked)
    assert row.live(now, idle_s=30) is want
