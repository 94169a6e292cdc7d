"""workloads.released_at: when a deleted workload's storage (a notebook's home) was given back

Revision ID: 0004
Revises: 0003
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0004'
down_revision = '0003'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('workloads') as batch:
        batch.add_column(sa.Column('released_at', sa.Float(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('workloads') as batch:
        batch.drop_column('released_at')
