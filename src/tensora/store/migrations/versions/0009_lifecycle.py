"""replica lifecycle: a workload's crash-loop back-off; events that coalesce

- ``workloads.failures`` / ``last_failure`` / ``retry_at``: how many times its replicas failed in a row, the
  last one's why, and when admission may place it again (null: now). Kept in the store, so a restart of
  the controller neither forgets a back-off nor starts it over.
- ``events.count`` / ``events.last_at``: an event repeated identically is one row counted, with the time
  of its last repeat (null: it happened once).

Revision ID: 0009
Revises: 0008
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0009'
down_revision = '0008'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('workloads') as t:
        t.add_column(sa.Column('failures', sa.Integer(), nullable=False, server_default='0'))
        t.add_column(sa.Column('last_failure', sa.Text(), nullable=False, server_default=''))
        t.add_column(sa.Column('retry_at', sa.Float(), nullable=True))
    with op.batch_alter_table('events') as t:
        t.add_column(sa.Column('count', sa.Integer(), nullable=False, server_default='1'))
        t.add_column(sa.Column('last_at', sa.Float(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('events') as t:
        t.drop_column('last_at')
        t.drop_column('count')
    with op.batch_alter_table('workloads') as t:
        t.drop_column('retry_at')
        t.drop_column('last_failure')
        t.drop_column('failures')
