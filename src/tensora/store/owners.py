"""Owners: what an admin said of one (trust, quota and limit overrides) and what each holds."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields

from sqlalchemy import Connection, func, select, update

from tensora.store.rows import Overrides, OwnerRow
from tensora.store.tables import F, K, O, Values, W, lock_owner, upsert

_O_ROW = [O.c[f.name] for f in fields(OwnerRow)]  # not ``rev``: the change stamp is the controller's, not a field


@dataclass(slots=True)
class Holdings:
    """What an owner holds against its quotas: live keys, workloads not deleted, bytes of files."""

    keys: int = 0
    workloads: int = 0
    storage_bytes: int = 0


def get_owner(conn: Connection, owner: str) -> OwnerRow | None:
    row = conn.execute(select(*_O_ROW).where(O.c.owner == owner)).first()
    return OwnerRow(*row) if row else None


def trusted_owners(conn: Connection) -> set[str]:
    """The owners an admin marked trusted; everyone else is untrusted."""
    return set(conn.execute(select(O.c.owner).where(O.c.trusted.is_(True))).scalars())


def owner_quotas(conn: Connection) -> dict[str, Overrides]:
    """Every owner's quota overrides an admin set (``tensora.quotas.effective``), in one read."""
    q = select(O.c.owner, O.c.quotas).where(O.c.quotas.is_not(None))
    return {owner: quotas for owner, quotas in conn.execute(q) if quotas}


def list_owners(conn: Connection) -> list[OwnerRow]:
    """The owners the operator has said something of, by name."""
    return [OwnerRow(*r) for r in conn.execute(select(*_O_ROW).order_by(O.c.owner))]


def set_owner(conn: Connection, owner: str, trusted: bool, at: float) -> None:
    """One upsert (INSERT ... ON CONFLICT (owner) DO UPDATE, which SQLite and PostgreSQL both have),
    so two first sets of a new owner at once both succeed and the later one's flag stays."""
    conn.execute(upsert(conn)(O).values(owner=owner, trusted=trusted, updated_at=at)
                 .on_conflict_do_update(index_elements=[O.c.owner], set_={"trusted": trusted, "updated_at": at}))


def owner_for_update(conn: Connection, owner: str, at: float) -> OwnerRow:
    """The owner's row, made if missing (untrusted, no overrides) and locked until the transaction ends
    (PostgreSQL: FOR UPDATE; SQLite's write transactions take turns already), so that two PUTs of
    different fields at once both land: each reads the other's result, never a stale copy."""
    conn.execute(upsert(conn)(O).values(owner=owner, trusted=False, updated_at=at).on_conflict_do_nothing())
    return OwnerRow(*conn.execute(select(*_O_ROW).where(O.c.owner == owner).with_for_update()).one())


def write_owner(conn: Connection, owner: str, values: Values) -> None:
    conn.execute(update(O).where(O.c.owner == owner).values(**values))


def lock_owner_quota(conn: Connection, owner: str) -> None:
    """Until the transaction ends, this owner's creates of keys and workloads wait for this one, so that
    the count against a quota and the insert it allows are one step (two creates at once cannot both take
    the last slot). PostgreSQL: a transaction-scoped advisory lock; SQLite: its writes already take turns."""
    lock_owner(conn, b"tensora-quota:", owner)


def holdings(conn: Connection, owners: Sequence[str]) -> dict[str, Holdings]:
    """Per owner: live keys, workloads not deleted, bytes of files (three grouped counts for any number)."""
    out = {o: Holdings() for o in owners}
    if not owners:
        return out
    names = list(owners)
    for what, q in (
            ("keys", select(K.c.owner, func.count()).where(K.c.owner.in_(names), K.c.revoked_at.is_(None))
             .group_by(K.c.owner)),
            ("workloads", select(W.c.owner, func.count()).where(W.c.owner.in_(names), W.c.deleted_at.is_(None))
             .group_by(W.c.owner)),
            ("storage_bytes", select(F.c.owner, func.sum(F.c.size)).where(F.c.owner.in_(names)).group_by(F.c.owner))):
        for owner, n in conn.execute(q):
            setattr(out[owner], what, int(n or 0))
    return out


def owner_limits(conn: Connection) -> dict[str, Overrides]:
    """Owners' overrides of the default gateway limits (only owners an admin gave some)."""
    q = select(O.c.owner, O.c.limits).where(O.c.limits.is_not(None))
    return {o: lim for o, lim in conn.execute(q) if lim}
