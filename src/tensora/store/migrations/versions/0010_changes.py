"""change watermarks: a cycle with nothing new reads one watermark, not the queue

- ``workloads.rev``, ``replicas.rev``, ``owners.rev``: stamped on every insert, and on every update of a column
  admission reads (``tensora.control.snapshot``); indexed by ``(region, rev)`` (replicas by ``rev`` too: an
  owner's quota use counts every region). A write of only what admission itself writes back (a wait's reason,
  a restart offer, ``updated_at``) leaves ``rev`` alone, so the controller's own answers do not read as news.
- ``revisions``: SQLite's counter (one row), which its triggers advance.

The controller reads ``watermark`` W, the same number each time for a store that did not change, such that
every change committed with a ``rev`` below W was visible when W was read; next cycle it reads the rows with
``rev >= W``. Triggers do the stamping, so every writer (the API, the controller, ``tensora plan`` on a store,
an operator's SQL, the tests' and benchmarks' straight inserts) is covered without a call site to forget:

- SQLite: the next value of a counter, per row written. SQLite's writers take turns (``BEGIN IMMEDIATE``), so
  the counter follows commit order; W is the counter + 1, read in the reader's snapshot.
- PostgreSQL: the writing transaction's id (``pg_current_xact_id``), and W the ``xmin`` of the reader's
  snapshot (every transaction below it has ended). Ids are taken in start order, not commit order: a
  transaction with an older id that commits late still has ``rev >= W`` of any read made before it ended, so
  it is not missed (a counter row would follow commit order too, but its row lock, taken by a row trigger
  after the row's own lock, would deadlock two writers of the same workloads; ids take no lock at all). A
  transaction left open for long keeps W back, and the rows changed since are read again each cycle: correct,
  and no slower than the full read it replaces.

Rows are never deleted (workloads are soft-deleted; replicas end in a state), so no delete needs a tombstone.
Nodes are not stamped: the controller's nodes are its driver's observation, compared in memory each cycle.

Revision ID: 0010
Revises: 0009
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0010'
down_revision = '0009'
branch_labels = None
depends_on = None

ADMISSION_COLUMNS = {
    'workloads': ('owner', 'kind', 'region', 'gpu_class', 'fallback', 'fallback_after_s', 'placement', 'state',
                  'replicas', 'model_params', 'model_bytes', 'created_at', 'queued_since', 'deleted_at',
                  'retry_at'),
    'replicas': ('workload_id', 'slot', 'cls', 'node', 'region', 'state', 'role'),
    'owners': ('quotas',),
}
"""The columns whose update stamps a row: what ``snapshot.take`` and ``snapshot.owner_quotas`` read."""


def _sqlite_triggers(table: str) -> list[str]:
    stamp = (f"BEGIN UPDATE revisions SET rev = rev + 1 WHERE id = 1; "
             f"UPDATE {table} SET rev = (SELECT rev FROM revisions WHERE id = 1) WHERE rowid = NEW.rowid; END")
    # the stamp's own UPDATE names only rev, so it fires neither trigger (recursive_triggers is off, too)
    return [f"CREATE TRIGGER {table}_rev_insert AFTER INSERT ON {table} FOR EACH ROW {stamp}",
            f"CREATE TRIGGER {table}_rev_update AFTER UPDATE OF {', '.join(ADMISSION_COLUMNS[table])} ON {table} "
            f"FOR EACH ROW {stamp}"]


_PG_FUNCTION = """
CREATE FUNCTION tensora_stamp_rev() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  NEW.rev := pg_current_xact_id()::text::bigint;
  RETURN NEW;
END $$
"""


def _pg_trigger(table: str) -> str:
    return (f"CREATE TRIGGER {table}_rev BEFORE INSERT OR UPDATE OF {', '.join(ADMISSION_COLUMNS[table])} "
            f"ON {table} FOR EACH ROW EXECUTE FUNCTION tensora_stamp_rev()")


def upgrade() -> None:
    op.create_table('revisions', sa.Column('id', sa.Integer(), nullable=False),
                    sa.Column('rev', sa.BigInteger(), nullable=False), sa.PrimaryKeyConstraint('id'))
    op.execute("INSERT INTO revisions (id, rev) VALUES (1, 0)")
    for table in ADMISSION_COLUMNS:
        with op.batch_alter_table(table) as t:
            t.add_column(sa.Column('rev', sa.BigInteger(), nullable=False, server_default='0'))
    op.create_index('ix_workloads_region_rev', 'workloads', ['region', 'rev'])
    op.create_index('ix_replicas_region_rev', 'replicas', ['region', 'rev'])
    op.create_index('ix_replicas_rev', 'replicas', ['rev'])
    op.create_index('ix_owners_rev', 'owners', ['rev'])
    if op.get_bind().dialect.name == 'postgresql':
        op.execute(_PG_FUNCTION)
        for table in ADMISSION_COLUMNS:
            op.execute(_pg_trigger(table))
    else:
        for table in ADMISSION_COLUMNS:
            for statement in _sqlite_triggers(table):
                op.execute(statement)


def downgrade() -> None:
    postgres = op.get_bind().dialect.name == 'postgresql'
    for table in ADMISSION_COLUMNS:
        if postgres:
            op.execute(f"DROP TRIGGER {table}_rev ON {table}")
        else:
            op.execute(f"DROP TRIGGER {table}_rev_insert")
            op.execute(f"DROP TRIGGER {table}_rev_update")
    if postgres:
        op.execute("DROP FUNCTION tensora_stamp_rev()")
    op.drop_index('ix_owners_rev', table_name='owners')
    op.drop_index('ix_replicas_rev', table_name='replicas')
    op.drop_index('ix_replicas_region_rev', table_name='replicas')
    op.drop_index('ix_workloads_region_rev', table_name='workloads')
    for table in ADMISSION_COLUMNS:
        with op.batch_alter_table(table) as t:
            t.drop_column('rev')
    op.drop_table('revisions')
