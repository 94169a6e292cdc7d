"""Fixtures shared by the suite. Tests that touch the store run on SQLite and on a real
PostgreSQL server that the session starts itself (``db_url`` is parametrized over both)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tensora.store.db import Database
from tests.support.services import PgCluster, pg_cluster, unmount_under


@pytest.fixture(autouse=True)
def _no_mount_left(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Whatever a test left mounted under the session's temp dirs (a notebook's home is a loop-mounted file
    system of its own, kept until its workload is released, which few tests do) is unmounted after it."""
    yield
    unmount_under(tmp_path_factory.getbasetemp())


@pytest.fixture(scope="session")
def pg() -> Iterator[PgCluster]:
    cluster = pg_cluster()
    try:
        yield cluster
    finally:
        cluster.stop()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """A test that uses the session's PostgreSQL server is marked ``postgresql``: one that asks for ``pg``, or one
    parametrized with ``"postgresql"`` (``db_url``, and the tests and fixtures that choose their backend so);
    ``./scripts/test --fast`` runs the store's tests on SQLite only. A test with its own server marks itself."""
    for item in items:
        callspec = getattr(item, "callspec", None)
        params = callspec.params.values() if callspec is not None else ()
        if "pg" in getattr(item, "fixturenames", ()) or any(p == "postgresql" for p in params):
            item.add_marker(pytest.mark.postgresql)


@pytest.fixture(params=["sqlite", "postgresql"])
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
