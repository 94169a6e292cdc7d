"""The store on SQLite and PostgreSQL: migrations match the models; the lease; atomic claims; ids."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from hypothesis import given
from hypothesis import strategies as st
from sqlalchemy import func, inspect, select, text

from tensora.errors import Conflict
from tensora.store import files as files_repo
from tensora.store import idempotency as idempotency_repo
from tensora.store import keys as keys_repo
from tensora.store import leases as leases_repo
from tensora.store import owners as owners_repo
from tensora.store.db import Database, normalize_url
from tensora.store.ids import Ids
from tensora.store.keys import KeyRow
from tensora.store.models import Base
from tensora.store.rows import OwnerRow
from tensora.store.tables import UR


def test_migrations_create_exactly_the_models(db: Database) -> None:
    with db.engine.connect() as conn:
        diff = compare_metadata(MigrationContext.configure(conn), Base.metadata)
        tables = set(inspect(conn).get_table_names())
    assert diff == []
    assert set(Base.metadata.tables) <= tables


def test_migrating_twice_changes_nothing(db: Database) -> None:
    db.migrate()
    with db.engine.connect() as conn:
        assert compare_metadata(MigrationContext.configure(conn), Base.metadata) == []


LEASE_CASES = {
    "free lease -> taken": ([], ("a", 100.0), True),
    "held by me -> renewed": ([("a", 100.0)], ("a", 105.0), True),
    "held by another, live -> refused": ([("b", 100.0)], ("a", 110.0), False),
    "held by another, expired -> taken": ([("b", 100.0)], ("a", 115.0), True),
    "exactly at expiry -> taken": ([("b", 100.0)], ("a", 115.0 - 1e-9 + 1e-9), True),
}


@pytest.mark.parametrize("case", LEASE_CASES.values(), ids=LEASE_CASES.keys())
def test_lease(db: Database, case: tuple[list[tuple[str, float]], tuple[str, float], bool]) -> None:
    before, (holder, now), want = case
    for who, at in before:
        with db.write() as conn:
            assert leases_repo.acquire_lease(conn, "controller/local", who, at, 15.0)
    with db.write() as conn:
        got = leases_repo.acquire_lease(conn, "controller/local", holder, now, 15.0)
    assert got is want
    with db.read() as conn:
        assert leases_repo.lease_holder(conn, "controller/local", now) == (holder if want else before[-1][0])


RESERVATION_CASES = {
    "live reservations count, every one of the owner's": (399.0, None, 3 + 5),
    "one upload's own left out (besides)": (399.0, "u1", 5),
    "expired (a crashed worker's) count for nothing": (400.0, None, 0),
    "another owner's never count": (399.0, None, 8),
}


@pytest.mark.parametrize("case", RESERVATION_CASES.values(), ids=RESERVATION_CASES.keys())
def test_upload_reservations(db: Database, case: tuple[float, str | None, int]) -> None:
    at, besides, want = case
    with db.write() as conn:
        files_repo.reserve(conn, "u1", "alice", 3, 100.0, 300.0)
        files_repo.reserve(conn, "u2", "alice", 5, 100.0, 300.0)
        files_repo.reserve(conn, "u3", "bob", 7, 100.0, 300.0)
    with db.read() as conn:
        assert files_repo.reserved(conn, "alice", at, besides=besides) == want


def test_a_reservation_is_changed_renewed_released_and_expired_ones_deleted(db: Database) -> None:
    with db.write() as conn:
        files_repo.reserve(conn, "u1", "alice", 3, 100.0, 300.0)
        files_repo.reserve(conn, "u1", "alice", 4, 350.0, 300.0)  # grown and renewed: counts past its first expiry
        files_repo.reserve(conn, "old", "alice", 9, 0.0, 300.0)  # a crashed worker's, expired at 300
    with db.read() as conn:
        assert files_repo.reserved(conn, "alice", 600.0) == 4
    with db.write() as conn:
        files_repo.reserve(conn, "u2", "alice", 1, 610.0, 300.0)  # the owner's expired ones go on the way
        assert conn.execute(select(func.count()).select_from(UR)).scalar_one() == 2
        files_repo.unreserve(conn, "u1")
        files_repo.unreserve(conn, "u1")  # again: nothing there, done
    with db.read() as conn:
        assert files_repo.reserved(conn, "alice", 611.0) == 1


def test_lease_is_per_region_and_released_on_request(db: Database) -> None:
    with db.write() as conn:
        assert leases_repo.acquire_lease(conn, "controller/eu", "a", 0.0, 15.0)
        assert leases_repo.acquire_lease(conn, "controller/us", "b", 0.0, 15.0)
        leases_repo.release_lease(conn, "controller/eu", "a")
    with db.write() as conn:
        assert leases_repo.acquire_lease(conn, "controller/eu", "c", 1.0, 15.0)
        assert not leases_repo.acquire_lease(conn, "controller/us", "c", 1.0, 15.0)


def test_idempotency_claim_is_an_atomic_insert(db: Database) -> None:
    pk = {"key_id": "key_alice", "method": "POST", "path": "/v1/workloads", "key": "k1"}
    row = {**pk, "fingerprint": "f", "state": "in_flight", "status": None, "body": None, "created_at": 0.0,
           "expires_at": 60.0}
    with db.write() as conn:
        idempotency_repo.claim_idempotency(conn, row)
    with pytest.raises(Conflict), db.write() as conn:
        idempotency_repo.claim_idempotency(conn, row)
    with db.write() as conn:
        assert not idempotency_repo.take_over_expired(conn, pk, row, now=30.0)
        assert idempotency_repo.take_over_expired(conn, pk, {**row, "created_at": 61.0, "expires_at": 121.0}, now=61.0)
        assert idempotency_repo.expire_idempotency(conn, now=200.0) == 1


def test_a_failed_transaction_leaves_no_row(db: Database) -> None:
    with pytest.raises(RuntimeError), db.write() as conn:
        keys_repo.insert_key(conn, KeyRow(id="key_x", digest="d" * 64, hint="h", owner="o", name="n", scopes=[],
                                          created_at=0.0, revoked_at=None))
        raise RuntimeError("crash before commit")
    with db.read() as conn:
        assert keys_repo.list_keys(conn, None) == []


def test_two_first_sets_of_an_owner_at_once_both_succeed(db: Database) -> None:
    """The second set runs while the first's row is written but not committed: on PostgreSQL it
    waits on that row's lock (seen in pg_locks), then updates it; before the upsert it failed the
    unique key (a 409). SQLite's writes take turns, so there it runs after the first commits."""
    second: dict[str, Any] = {}

    def set_again() -> None:
        try:
            with db.write() as conn:
                second["row"] = owners_repo.set_owner(conn, "dave", False, 2.0)
        except Exception as exc:  # kept for the assertion below
            second["error"] = exc

    other = threading.Thread(target=set_again)
    with db.write() as conn:
        owners_repo.set_owner(conn, "dave", True, 1.0)
        other.start()
        if db.engine.dialect.name == "postgresql":
            with db.engine.connect() as watch:
                for _ in range(200):  # until the second waits on a lock, at most 10 s
                    if watch.execute(text("SELECT count(*) FROM pg_locks WHERE NOT granted")).scalar():
                        break
                    time.sleep(0.05)
                else:
                    pytest.fail("the second set never waited on the first")
    other.join(timeout=10)
    assert "error" not in second, second.get("error")
    with db.read() as conn:
        assert owners_repo.list_owners(conn) == [OwnerRow(owner="dave", trusted=False, updated_at=2.0, quotas=None,
                                                          limits=None)]


def test_migration_0006_keeps_no_owner_trusted_that_an_admin_did_not_mark_trusted(db_url: str) -> None:
    """Owners' flags as 0005 stored them (``untrusted``, every row an admin's PUT) through 0006: an owner
    marked untrusted stays untrusted; one left at ``untrusted = false`` (never marked, or a mark taken back,
    while that was every owner's default) is untrusted too, as is an owner with no row; ``updated_at`` is
    kept. And back down: untrusted = not trusted."""
    from alembic import command

    from tensora.store.db import alembic_config

    database = Database(db_url)
    try:
        def to(revision: str, down: bool = False) -> None:
            with database.engine.begin() as conn:
                cfg = alembic_config(db_url)
                cfg.attributes["connection"] = conn
                (command.downgrade if down else command.upgrade)(cfg, revision)

        to("0005")
        with database.engine.begin() as conn:
            conn.execute(text("INSERT INTO owners (owner, untrusted, updated_at) VALUES "
                              "('mallory', :t, 1.0), ('dave', :f, 2.0)"), {"t": True, "f": False})
        to("head")
        with database.read() as conn:
            assert owners_repo.list_owners(conn) == [
                OwnerRow(owner="dave", trusted=False, updated_at=2.0, quotas=None, limits=None),
                OwnerRow(owner="mallory", trusted=False, updated_at=1.0, quotas=None, limits=None)]
            assert owners_repo.trusted_owners(conn) == set()  # nobody: "erin", with no row, neither
        with database.write() as conn:
            owners_repo.set_owner(conn, "dave", True, 3.0)  # an admin means it now
        with database.read() as conn:
            assert owners_repo.trusted_owners(conn) == {"dave"}
        to("0005", down=True)
        with database.engine.connect() as conn:
            rows = conn.execute(text("SELECT owner, untrusted FROM owners ORDER BY owner")).all()
        assert [(o, bool(u)) for o, u in rows] == [("dave", False), ("mallory", True)]
    finally:
        database.dispose()


ID_CASES = {  # clock readings (s) -> the 9-digit stamps of the ids made at them
    "the millisecond in base 36": ([1.0, 2.5], ["0000000rs", "0000001xg"]),
    "the same millisecond twice -> bumped by one": ([1.0, 1.0, 1.0], ["0000000rs", "0000000rt", "0000000ru"]),
    "a clock stepped back -> still after the last": ([2.0, 1.0], ["0000001jk", "0000001jl"]),
    "epoch 0 -> millisecond 1 (the first is past 0)": ([0.0], ["000000001"]),
    "a day of 2026": ([1_796_000_000.0], ["0mx2k114w"]),
}


@pytest.mark.parametrize("case", ID_CASES.values(), ids=ID_CASES.keys())
def test_ids_carry_their_creation_millisecond(case: tuple[list[float], list[str]]) -> None:
    readings, want = case
    clock = iter(readings)
    ids = Ids(lambda: next(clock))
    made = [ids.new("wl_") for _ in readings]
    assert [m[3:12] for m in made] == want
    assert all(len(m) == 3 + 9 + 10 and m[12:].isalnum() for m in made)


@given(st.lists(st.floats(min_value=0, max_value=1e11, allow_nan=False), min_size=1, max_size=50))
def test_ids_sort_in_the_order_they_were_made_whatever_the_clock_does(readings: list[float]) -> None:
    clock = iter(readings)
    ids = Ids(lambda: next(clock))
    made = [ids.new("rp_") for _ in readings]
    assert made == sorted(made) and len(set(made)) == len(made)
    assert all(int(m[3:12], 36) >= int(r * 1000) for m, r in zip(made, readings, strict=True))  # never early


URL_CASES = {
    "bare path -> sqlite file": ("/tmp/x/tensora.db", "sqlite:////tmp/x/tensora.db"),
    "postgresql -> psycopg 3": ("postgresql://u@h/db", "postgresql+psycopg://u@h/db"),
    "postgres alias -> psycopg 3": ("postgres://u@h/db", "postgresql+psycopg://u@h/db"),
    "explicit driver kept": ("postgresql+psycopg://u@h/db", "postgresql+psycopg://u@h/db"),
}


@pytest.mark.parametrize("case", URL_CASES.values(), ids=URL_CASES.keys())
def test_normalize_url(case: tuple[str, str]) -> None:
    assert normalize_url(case[0]) == case[1]
