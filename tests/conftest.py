"""Fixtures shared by the suite. Tests that touch the store run on SQLite and on a real
PostgreSQL server that the session starts itself (``db_url`` is parametrized over both)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tensora.store.db import Database
from tests.support.services import PgCluster, pg_cluster


@pytest.fixture(scope="session")
def pg() -> Iterator[PgCluster]:
    cluster = pg_cluster()
    try:
        yield cluster
    finally:
        cluster.stop()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """A test that uses the PostgreSQL server (``pg``, itself or through ``db_url``) is marked ``postgresql``:
    ``./scripts/test --fast`` runs the store's tests on SQLite only."""
    for item in items:
        if "pg" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.postgresql)


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgresql)])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return str(tmp_path / "tensora.db")
    cluster: PgCluster = request.getfixturevalue("pg")
    return cluster.new_database()


@pytest.fixture
def db(db_url: str) -> Iterator[Database]:
    """A store at ``db_url``, migrated to the newest schema."""
    database = Database(db_url)
    database.migrate()
    yield database
    database.dispose()
