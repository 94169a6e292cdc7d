"""Owner storage: the files' records (the bytes live on disk) and the reservations of uploads in flight."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import ColumnElement, Connection, delete, func, insert, or_, select, update

from tensora.store.tables import UR, F, lock_owner


@dataclass(frozen=True, slots=True)
class FileRow:
    owner: str
    path: str
    size: int
    sha256: str
    created_at: float


def _file(row: Any) -> FileRow:
    return FileRow(row.owner, row.path, int(row.size), row.sha256, row.created_at)


def lock_owner_files(conn: Connection, owner: str) -> None:
    """Until the transaction ends, this owner's file writes wait for this one: the quota check and
    the write it allows are then one step. PostgreSQL: a transaction-scoped advisory lock on a key
    derived from the owner; SQLite: nothing to do, its write transactions already take turns."""
    lock_owner(conn, b"tensora-files:", owner)


def storage_used(conn: Connection, owner: str) -> int:
    return int(conn.execute(select(func.coalesce(func.sum(F.c.size), 0)).where(F.c.owner == owner)).scalar_one())


def get_file(conn: Connection, owner: str, path: str) -> FileRow | None:
    row = conn.execute(select(F).where(F.c.owner == owner, F.c.path == path)).first()
    return _file(row) if row else None


def _under(directory: str) -> ColumnElement[bool]:
    """Paths under ``directory/``, compared exactly: not ``LIKE``, which SQLite matches case-insensitively
    (``OK/%`` found ``ok/x``), nor a range, which a PostgreSQL collation may order otherwise."""
    head = directory + "/"
    return func.substr(F.c.path, 1, len(head)) == head


def list_files(conn: Connection, owner: str, prefix: str | None = None) -> list[FileRow]:
    """The owner's files by path; with ``prefix``, the file named so and those under ``prefix/``."""
    q = select(F).where(F.c.owner == owner)
    if prefix is not None:
        q = q.where(or_(F.c.path == prefix, _under(prefix)))
    return sorted((_file(r) for r in conn.execute(q)), key=lambda f: f.path)


def blocking_file(conn: Connection, owner: str, path: str, parents: Sequence[str]) -> str | None:
    """What keeps a file from being written at ``path``: a file at one of its ``parents`` (``tiny`` for
    ``tiny/config.json``), or files under ``path/`` (it is a directory). None when nothing does."""
    under = _under(path)
    where = or_(F.c.path.in_(list(parents)), under) if parents else under
    return conn.execute(select(F.c.path).where(F.c.owner == owner, where).limit(1)).scalar()


def put_file(conn: Connection, row: FileRow) -> bool:
    """Insert or replace the owner's file at ``row.path``; True if it replaced one."""
    replaced = conn.execute(update(F).where(F.c.owner == row.owner, F.c.path == row.path)
                            .values(size=row.size, sha256=row.sha256, created_at=row.created_at)).rowcount == 1
    if not replaced:
        conn.execute(insert(F).values(owner=row.owner, path=row.path, size=row.size, sha256=row.sha256,
                                      created_at=row.created_at))
    return replaced


def reserved(conn: Connection, owner: str, now: float, *, besides: str | None = None) -> int:
    """Bytes the owner's uploads in flight hold (reservations not yet expired), but for ``besides``'s."""
    q = select(func.coalesce(func.sum(UR.c.size), 0)).where(UR.c.owner == owner, UR.c.expires_at > now)
    if besides is not None:
        q = q.where(UR.c.id != besides)
    return int(conn.execute(q).scalar_one())


def reserve(conn: Connection, upload_id: str, owner: str, size: int, now: float, ttl_s: float) -> None:
    """Hold ``size`` bytes of the owner's quota for upload ``upload_id`` until ``now + ttl_s`` (set, or
    changed). The caller checked the room under ``lock_owner_files``; the owner's expired reservations (a
    crashed worker's) are deleted on the way."""
    conn.execute(delete(UR).where(UR.c.owner == owner, UR.c.expires_at <= now))
    expires_at = now + ttl_s
    if conn.execute(update(UR).where(UR.c.id == upload_id)
                    .values(size=size, expires_at=expires_at)).rowcount == 0:
        conn.execute(insert(UR).values(id=upload_id, owner=owner, size=size, expires_at=expires_at))


def unreserve(conn: Connection, upload_id: str) -> None:
    conn.execute(delete(UR).where(UR.c.id == upload_id))


def delete_files(conn: Connection, owner: str, paths: Sequence[str]) -> None:
    if paths:
        conn.execute(delete(F).where(F.c.owner == owner, F.c.path.in_(list(paths))))
