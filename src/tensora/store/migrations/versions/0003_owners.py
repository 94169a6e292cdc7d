"""owners: the per-owner untrusted flag (Kata on Kubernetes)

Revision ID: 0003
Revises: 0002
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0003'
down_revision = '0002'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('owners',
    sa.Column('owner', sa.String(length=128), nullable=False),
    sa.Column('untrusted', sa.Boolean(), nullable=False),
    sa.Column('updated_at', sa.Float(), nullable=False),
    sa.PrimaryKeyConstraint('owner')
    )


def downgrade() -> None:
    op.drop_table('owners')
