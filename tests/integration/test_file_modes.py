"""The data dir and the SQLite files are Tensora's alone: DATA_DIR 0700, the database and its -wal and -shm
0600 from the moment they exist, whatever the umask; a data dir or database made looser by an older version
is tightened when the server starts."""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import text

from tensora.store.db import Database
from tests.support.serve import served
from tests.support.stack import stack

NODES = "nodes:\n  - {name: cpu-1, region: local, allocatable: {cpu: 8, memory: 32Gi}}\n"
DB_FILES = ("tensora.db", "tensora.db-wal", "tensora.db-shm")


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@contextlib.contextmanager
def umask(mask: int) -> Iterator[None]:
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


UMASKS = {"the usual 022": 0o022, "none at all": 0o000, "group-friendly 002": 0o002}


@pytest.mark.parametrize("mask", UMASKS.values(), ids=UMASKS.keys())
def test_a_new_database_and_its_wal_and_shm_are_0600_in_a_0700_dir(tmp_path: Path, mask: int) -> None:
    where = tmp_path / "new" / "data"
    with umask(mask):
        db = Database(str(where / "tensora.db"))
        db.migrate()
        with db.write() as conn:  # WAL: the -wal and -shm exist while a connection is open
            conn.execute(text("INSERT INTO owners (owner, trusted, updated_at) VALUES ('a', false, 0)"))
        try:
            assert {name: mode(where / name) for name in DB_FILES} == dict.fromkeys(DB_FILES, 0o600)
            assert mode(where) == 0o700
        finally:
            db.dispose()


def test_an_older_looser_database_is_tightened_when_opened(tmp_path: Path) -> None:
    db = Database(str(tmp_path / "tensora.db"))
    db.migrate()
    with db.write() as conn:
        conn.execute(text("INSERT INTO owners (owner, trusted, updated_at) VALUES ('a', false, 0)"))
    for name in DB_FILES:  # what an older version left, still open by a process
        os.chmod(tmp_path / name, 0o644)
    again = Database(str(tmp_path / "tensora.db"))
    try:
        assert {name: mode(tmp_path / name) for name in DB_FILES} == dict.fromkeys(DB_FILES, 0o600)
    finally:
        again.dispose()
        db.dispose()


@pytest.mark.parametrize("existing", [False, True], ids=["new data dir", "an older 0755 data dir"])
def test_a_server_start_leaves_the_data_dir_0700_and_its_database_0600(tmp_path: Path, existing: bool) -> None:
    data = tmp_path / "data"
    if existing:
        data.mkdir(mode=0o755)
        os.chmod(data, 0o755)
    with umask(0o022):
        s = stack(str(data / "tensora.db"), data)
    try:
        s.controller.run_once()
        assert mode(data) == 0o700
        assert {name: mode(data / name) for name in DB_FILES} == dict.fromkeys(DB_FILES, 0o600)
        loose = [p for p in data.rglob("*") if p.is_file() and mode(p) & 0o077]
        assert loose == []
    finally:
        s.services.db.dispose()


def test_a_real_tensora_serve_leaves_nothing_in_its_data_dir_for_others_to_read(tmp_path: Path) -> None:
    """The real command in a child process (umask 022, as a login shell has): every file it wrote in DATA_DIR
    (database, -wal, -shm, admin key, lock files) is its user's alone, and so is DATA_DIR."""
    data = tmp_path / "data"
    (tmp_path / "nodes.yaml").write_text(NODES)
    with umask(0o022), served(tmp_path, data, "--nodes", str(tmp_path / "nodes.yaml")):
        assert mode(data) == 0o700
        written = {p.name: mode(p) for p in data.iterdir() if p.is_file()}
    assert {"tensora.db", "tensora.db-wal", "tensora.db-shm", "admin-key"} <= set(written)
    assert {name: m for name, m in written.items() if m & 0o077} == {}
