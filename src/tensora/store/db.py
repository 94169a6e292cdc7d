"""The database: one engine per URL, transactions, migrations, and the one place where
SQLAlchemy's exceptions become Tensora's.

SQLite (the default, a file in the data dir, mode 0600 like its -wal and -shm) runs in WAL mode; write transactions take
the write lock at ``BEGIN IMMEDIATE`` so that two writers queue on ``busy_timeout``
instead of failing when one upgrades a read lock. PostgreSQL is used by URL
(``postgresql://...``, driven by psycopg 3).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import sqlite3
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
from sqlalchemy import Connection, Engine, create_engine, event, text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import DBAPIError, IntegrityError, OperationalError, SQLAlchemyError
from sqlalchemy.exc import TimeoutError as PoolTimeout
from sqlalchemy.pool import ConnectionPoolEntry

from tensora.errors import Conflict, StoreUnavailable

MIGRATIONS = Path(__file__).with_name("migrations")


def normalize_url(url: str) -> str:
    """``postgresql://`` and ``postgres://`` mean psycopg 3; a bare path means a SQLite file."""
    if url.startswith("postgres://"):
        url = "postgresql://" + url[len("postgres://"):]
    if url.startswith("postgresql://"):
        return "postgresql+psycopg://" + url[len("postgresql://"):]
    if "://" not in url:
        return f"sqlite:///{Path(url).expanduser().resolve()}"
    return url


class Database:
    """An engine and its transactions. ``write()`` and ``read()`` yield a Connection in a transaction."""

    def __init__(self, url: str, *, pool_size: int = 20, connect_timeout_s: float = 2.0,
                 busy_timeout_ms: int = 5000) -> None:
        self.url = normalize_url(url)
        parsed = make_url(self.url)
        self.is_sqlite = parsed.get_backend_name() == "sqlite"
        # No pool_pre_ping: it costs a round trip on every checkout. A connection that died with
        # the server fails its request with a 503 (Retry-After); SQLAlchemy then sees a
        # disconnect and drops the whole pool, so the next requests connect afresh.
        kwargs: dict[str, Any] = {"pool_timeout": connect_timeout_s, "pool_recycle": 3600}
        if self.is_sqlite:
            if parsed.database and parsed.database != ":memory:":
                private_file(Path(parsed.database))
            kwargs["connect_args"] = {"check_same_thread": False, "timeout": busy_timeout_ms / 1000}
            kwargs.update(pool_size=pool_size, max_overflow=pool_size)
        else:
            kwargs["connect_args"] = {"connect_timeout": max(1, int(connect_timeout_s))}
            kwargs.update(pool_size=pool_size, max_overflow=pool_size)
        kwargs.update(json_serializer=_json_dumps, json_deserializer=orjson.loads)
        self.engine: Engine = create_engine(self.url, **kwargs)
        if self.is_sqlite:
            _sqlite_setup(self.engine, busy_timeout_ms)
        self._writer = self.engine.execution_options(sqlite_begin="IMMEDIATE") if self.is_sqlite else self.engine
        # SQLite has one writer at a time. Threads of this process queue for it on a mutex, so
        # the lock passes straight to the next writer; SQLite's own busy handler (which sleeps
        # 1, 2, 5 ... 100 ms between tries, the cause of long tail latencies under load) is left
        # to arbitrate only between processes.
        self._write_mutex = threading.Lock() if self.is_sqlite else None
        self._busy_timeout_s = busy_timeout_ms / 1000
        # Between processes of one server (``serve --workers``, the controller), a lock file
        # does the same: waiting on it polls every 0.2-2 ms where SQLite's handler sleeps up to 100.
        self._lock_file = (Path(parsed.database + ".write-lock")
                           if self.is_sqlite and parsed.database and parsed.database != ":memory:" else None)
        self._lock_fd: int | None = None

    @contextlib.contextmanager
    def write(self) -> Iterator[Connection]:
        """A write transaction: committed on success, rolled back on any error."""
        if self._write_mutex is None:
            with translate(), self._writer.begin() as conn:
                yield conn
            return
        deadline = time.monotonic() + self._busy_timeout_s
        if not self._write_mutex.acquire(timeout=self._busy_timeout_s):
            raise StoreUnavailable("the SQLite database is busy (a write waited too long)")
        try:
            locked = self._lock_between_processes(deadline)
            try:
                with translate(), self._writer.begin() as conn:
                    yield conn
            finally:
                if locked:
                    fcntl.flock(self._lock_fd, fcntl.LOCK_UN)  # type: ignore[arg-type]
        finally:
            self._write_mutex.release()

    def _lock_between_processes(self, deadline: float) -> bool:
        """Take the lock file (held with the thread mutex); False where there is none to take.
        Past the deadline, go on without it: SQLite's own lock still guards the data, and its
        busy timeout turns a database that stays locked into StoreUnavailable."""
        if self._lock_file is None:
            return False
        if self._lock_fd is None:
            self._lock_fd = os.open(self._lock_file, os.O_RDWR | os.O_CREAT, 0o600)
        pause = 0.0002
        while True:
            try:
                fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return True
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    return False
                time.sleep(pause)
                pause = min(pause * 2, 0.002)

    @contextlib.contextmanager
    def read(self) -> Iterator[Connection]:
        with translate(), self.engine.begin() as conn:
            yield conn

    def ping(self) -> None:
        with self.read() as conn:
            conn.execute(text("SELECT 1"))

    def migrate(self) -> None:
        """Bring the schema to the newest migration (idempotent; safe with several servers)."""
        from alembic import command

        with translate(), self.engine.begin() as conn:
            cfg = alembic_config(self.url)
            cfg.attributes["connection"] = conn
            command.upgrade(cfg, "head")

    def dispose(self) -> None:
        self.engine.dispose()
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None


def private_dir(path: Path) -> Path:
    """A dir only Tensora's user may enter (DATA_DIR: the database, the admin key, the spool): made 0700, and
    an older one with group or other bits taken back to 0700."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    if path.stat().st_mode & 0o077:
        path.chmod(0o700)
    return path


def private_file(db: Path) -> None:
    """The SQLite file made 0600 before SQLite opens it (its dir 0700 if made here), and an older one with
    its -wal and -shm taken back to 0600. SQLite creates -wal and -shm with the mode of the database file,
    so no copy of the data is ever readable by anyone else, not even for an instant."""
    if not db.parent.exists():
        private_dir(db.parent)
    fd = os.open(db, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        os.fchmod(fd, 0o600)
    finally:
        os.close(fd)
    for side in ("-wal", "-shm"):
        with contextlib.suppress(FileNotFoundError):
            os.chmod(f"{db}{side}", 0o600)


def _json_dumps(value: Any) -> str:
    return orjson.dumps(value).decode()


def alembic_config(url: str) -> Any:
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    cfg.set_main_option("sqlalchemy.url", normalize_url(url).replace("%", "%%"))
    return cfg


def _sqlite_setup(engine: Engine, busy_timeout_ms: int) -> None:
    @event.listens_for(engine, "connect")
    def _connect(dbapi_conn: sqlite3.Connection, _record: ConnectionPoolEntry) -> None:
        dbapi_conn.isolation_level = None  # we issue BEGIN ourselves, below
        cur = dbapi_conn.cursor()
        cur.execute("PRAGMA journal_mode=WAL")
        cur.execute("PRAGMA synchronous=NORMAL")
        cur.execute("PRAGMA foreign_keys=ON")
        cur.execute(f"PRAGMA busy_timeout={int(busy_timeout_ms)}")
        cur.close()

    @event.listens_for(engine, "begin")
    def _begin(conn: Connection) -> None:
        conn.exec_driver_sql(f"BEGIN {conn.get_execution_options().get('sqlite_begin', 'DEFERRED')}")


@contextlib.contextmanager
def translate() -> Iterator[None]:
    """SQLAlchemy errors become StoreUnavailable (retry later) or Conflict; nothing else leaks."""
    try:
        yield
    except IntegrityError as exc:
        raise Conflict(f"conflicting write: {exc.orig}") from exc
    except (OperationalError, PoolTimeout) as exc:
        raise StoreUnavailable(_short(exc)) from exc
    except DBAPIError as exc:
        if exc.connection_invalidated:
            raise StoreUnavailable(_short(exc)) from exc
        raise
    except SQLAlchemyError as exc:
        if "closed" in str(exc) or "connect" in str(exc):
            raise StoreUnavailable(_short(exc)) from exc
        raise


def _short(exc: Exception) -> str:
    orig = getattr(exc, "orig", None) or exc
    return str(orig).strip().splitlines()[0] if str(orig).strip() else type(orig).__name__
