"""usage_segments.workload_id without a foreign key: deleted workloads are purged after the retention

Housekeeping deletes a deleted workload's row (with its replicas' rows and events) once the retention has passed
and its storage was given back; its usage stays, so the usage rows may no longer refer to the row by a foreign
key. A downgrade puts the key back and needs every usage row's workload present (it fails otherwise).

Revision ID: 0014
Revises: 0013
"""

from __future__ import annotations

from alembic import op

revision = '0014'
down_revision = '0013'
branch_labels = None
depends_on = None

# SQLite's foreign key (0001 left it unnamed) gets this name for the batch copy that drops it.
_NAMING = {"fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s"}
_SQLITE_FK = 'fk_usage_segments_workload_id_workloads'
_PG_FK = 'usage_segments_workload_id_fkey'  # PostgreSQL's name for 0001's unnamed key


def upgrade() -> None:
    if op.get_bind().dialect.name == 'postgresql':
        op.drop_constraint(_PG_FK, 'usage_segments', type_='foreignkey')
    else:
        with op.batch_alter_table('usage_segments', naming_convention=_NAMING) as batch:
            batch.drop_constraint(_SQLITE_FK, type_='foreignkey')


def downgrade() -> None:
    if op.get_bind().dialect.name == 'postgresql':
        op.create_foreign_key(_PG_FK, 'usage_segments', 'workloads', ['workload_id'], ['id'])
    else:
        with op.batch_alter_table('usage_segments') as batch:
            batch.create_foreign_key(_SQLITE_FK, 'workloads', ['workload_id'], ['id'])
