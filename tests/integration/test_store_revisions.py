"""The change watermark (migration 0010) on SQLite and PostgreSQL: which writes move it, which do not,
and the migration down and up again."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
from sqlalchemy import Connection, inspect

from tensora.placement.kinds import ReplicaRole, ReplicaState
from tensora.store import changes as changes_repo
from tensora.store import owners as owners_repo
from tensora.store import workloads as workloads_repo
from tensora.store.db import Database, alembic_config
from tensora.store.rows import ReplicaRow

T0 = 1_700_000_000.0



def _workload(conn: Connection, wid: str, region: str = "local", state: str = "queued") -> None:
    workloads_repo.insert_workload(conn, {
        "id": wid, "owner": "alice", "kind": "notebook", "name": wid, "region": region, "gpu_class": "l40s-48gb",
        "requested_class": "l40s-48gb", "placed_class": None, "fallback": [], "fallback_after_s": 0.0,
        "placement": "policy", "state": state, "reason": "queued", "fallback_eligible_at": None,
        "restart_available": False, "restart_reason": "", "replicas": 1, "model": None, "model_params": None,
        "model_bytes": None, "spec": {}, "created_at": T0, "updated_at": T0, "queued_since": T0, "deleted_at": None})


def _replica(conn: Connection) -> None:
    workloads_repo.insert_replica(conn, ReplicaRow("r1", "w1", 0, "l40s-48gb", "g1", "local", ReplicaState.STARTING,
                                         ReplicaRole.PRIMARY, T0, T0))


Write = Callable[[Connection], None]
CASES: dict[str, tuple[Write, bool, bool]] = {  # the write; it moves the region's rows; it moves the quotas
    "a workload created": (lambda c: _workload(c, "w2"), True, False),
    "a workload's state": (lambda c: workloads_repo.update_workload(c, "w1", {"state": "stopped"}), True, False),
    "a workload deleted": (lambda c: workloads_repo.update_workload(c, "w1", {"deleted_at": T0}), True, False),
    "a workload's back-off": (lambda c: workloads_repo.update_workload(c, "w1", {"retry_at": T0 + 10}), True, False),
    "a replica placed": (_replica, True, False),
    "a workload of another region": (lambda c: _workload(c, "w2", region="eu"), False, False),
    "an owner's quota": (lambda c: owners_repo.write_owner(c, "alice", {"quotas": {"running_gpus": 1}}), False, True),
    "a wait's reason (admission's own answer)": (
        lambda c: workloads_repo.set_wait_reasons(c, [("w1", "waiting for l40s-48gb", None)]), False, False),
    "a restart offer (admission's own answer)": (
        lambda c: workloads_repo.update_workload(c, "w1", {"restart_available": True, "restart_reason": "r"}),
        False, False),
    "only updated_at": (lambda c: workloads_repo.update_workload(c, "w1", {"updated_at": T0 + 1}), False, False),
    "an owner's trust flag": (lambda c: owners_repo.write_owner(c, "alice", {"trusted": True}), False, False),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_what_moves_the_watermark(db: Database, case: tuple[Write, bool, bool]) -> None:
    write, rows, quotas = case
    with db.write() as conn:
        _workload(conn, "w1")
        owners_repo.owner_for_update(conn, "alice", T0)
    with db.read() as conn:
        mark = changes_repo.watermark(conn)
        assert changes_repo.moved(conn, "local", mark)[1:] == (False, False)
    with db.write() as conn:
        write(conn)
    with db.read() as conn:
        moved = changes_repo.moved(conn, "local", mark)
        changed = changes_repo.changed_workloads(conn, "local", mark)
    assert (moved.rows, moved.quotas) == (rows, quotas)
    assert changed == ({"w2"} if write is CASES["a workload created"][0] else {"w1"} if rows else set())
    assert _quiet_after(db, moved.mark)  # the mark after: nothing since


def _quiet_after(db: Database, mark: int) -> bool:
    """Nothing moved since ``mark``, or since the mark read with it. On PostgreSQL a mark is its snapshot's xmin,
    which a transaction of the server's own (autovacuum at the tables just written) can hold back for a moment:
    that rereads, never misses, and the next mark passes it (seen once in a loaded run)."""
    for _ in range(50):
        with db.read() as conn:
            now = changes_repo.moved(conn, "local", mark)
        if (now.rows, now.quotas) == (False, False):
            return True
        mark = now.mark
        time.sleep(0.02)
    return False


def test_a_replica_in_another_region_moves_its_owners_use(db: Database) -> None:
    """An owner's quota use spans regions: a replica placed in ``eu`` is news to ``local``'s controller too,
    which learns its owner (not the workload: that is ``eu``'s)."""
    with db.write() as conn:
        _workload(conn, "w1", region="eu")
    with db.read() as conn:
        mark = changes_repo.watermark(conn)
    with db.write() as conn:
        workloads_repo.insert_replica(conn, ReplicaRow("r1", "w1", 0, "l40s-48gb", "g1", "eu", ReplicaState.STARTING,
                                             ReplicaRole.PRIMARY, T0, T0))
    with db.read() as conn:
        assert changes_repo.moved(conn, "local", mark).rows
        assert changes_repo.changed_workloads(conn, "local", mark) == set()
        assert changes_repo.owners_of_changed_replicas(conn, mark) == {"alice"}


def test_the_migration_goes_down_and_up_again(db: Database, db_url: str) -> None:
    from alembic import command

    with db.write() as conn:
        _workload(conn, "w1")

    def to(revision: str, down: bool = False) -> None:
        with db.engine.begin() as conn:
            cfg = alembic_config(db_url)
            cfg.attributes["connection"] = conn
            (command.downgrade if down else command.upgrade)(cfg, revision)

    to("0009", down=True)
    with db.engine.connect() as conn:
        assert "rev" not in {c["name"] for c in inspect(conn).get_columns("workloads")}
        assert "revisions" not in inspect(conn).get_table_names()
    to("head")
    with db.read() as conn:
        mark = changes_repo.watermark(conn)
    with db.write() as conn:
        workloads_repo.update_workload(conn, "w1", {"state": "stopped"})
    with db.read() as conn:
        assert changes_repo.changed_workloads(conn, "local", mark) == {"w1"}
