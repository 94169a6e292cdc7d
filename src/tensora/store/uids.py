"""Sandbox uids: one per owner, allocated on first use and kept."""

from __future__ import annotations

import os
from collections.abc import Iterable

from sqlalchemy import Connection, func, select

from tensora.errors import Conflict, TensoraError
from tensora.store.tables import UID, upsert

UID_FIRST, UID_LAST = 100_000, 165_535
"""The default range of sandbox uids (a block above the usual 65536 host ids)."""


class UidsExhausted(TensoraError):
    """Every uid of the configured range is held by an owner."""


def owner_uid(conn: Connection, owner: str, now: float, *, first: int = UID_FIRST, last: int = UID_LAST,
              avoid: Iterable[int] = ()) -> int:
    """The owner's sandbox uid (its gid is the same number), allocated on first call in a write
    transaction and recorded; the same owner always gets the same one.

    Never 0, never this process's uid or gid, nor any in ``avoid``. Allocation is the next free
    number above the highest taken in ``first..last``, inserted with ON CONFLICT DO NOTHING (SQLite
    and PostgreSQL both have it) and read back: a concurrent first call for the same owner waits
    on the other's row and reads its uid; one for another owner that took the same number sends
    this one round again to the next. UidsExhausted when the range is full.
    """
    held = _UID_OF.where(UID.c.owner == owner)
    got = conn.execute(held).scalar()
    if got is not None:
        return int(got)
    if not 1 <= first <= last:
        raise ValueError(f"the sandbox uid range {first}..{last} must be within 1.. and not empty")
    never = {0, os.getuid(), os.getgid(), *avoid}
    for _ in range(100):
        top = conn.execute(select(func.max(UID.c.uid)).where(UID.c.uid.between(first, last))).scalar()
        uid = first if top is None else int(top) + 1
        while uid in never:
            uid += 1
        if uid > last:
            count = conn.execute(select(func.count()).select_from(UID).where(UID.c.uid.between(first, last)))
            raise UidsExhausted(f"no free sandbox uid for owner {owner!r}: {count.scalar_one()} owners hold the "
                                f"range {first}..{last}; widen it (setting sandbox_uids)")
        conn.execute(upsert(conn)(UID).values(owner=owner, uid=uid, created_at=now).on_conflict_do_nothing())
        got = conn.execute(held).scalar()
        if got is not None:
            return int(got)
    raise Conflict(f"could not allocate a sandbox uid for owner {owner!r}: too many owners at once; retry")


_UID_OF = select(UID.c.uid)
