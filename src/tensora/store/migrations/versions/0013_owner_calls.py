"""owner_calls: the recent costly control-API calls of each owner, which its per-minute rates count

One row per workload create or restart, delete, and file upload, pruned past the one-minute window as calls
come in (an owner's own) and by housekeeping (everyone's). In the store, not in memory, so that the count holds
across API processes and restarts. See ``tensora.api.rates``.

Revision ID: 0013
Revises: 0012
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0013'
down_revision = '0012'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        'owner_calls',
        sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), autoincrement=True, nullable=False),
        sa.Column('owner', sa.String(length=128), nullable=False),
        sa.Column('action', sa.String(length=16), nullable=False),
        sa.Column('at', sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint('id'),
    )
    op.create_index('ix_owner_calls_owner_action_at', 'owner_calls', ['owner', 'action', 'at'])
    op.create_index(op.f('ix_owner_calls_at'), 'owner_calls', ['at'])


def downgrade() -> None:
    op.drop_index(op.f('ix_owner_calls_at'), table_name='owner_calls')
    op.drop_index('ix_owner_calls_owner_action_at', table_name='owner_calls')
    op.drop_table('owner_calls')
