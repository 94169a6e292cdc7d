"""upload reservations: the bytes each upload in flight holds of its owner's storage quota

Revision ID: 0012
Revises: 0011
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0012'
down_revision = '0011'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('upload_reservations',
    sa.Column('id', sa.String(length=32), nullable=False),
    sa.Column('owner', sa.String(length=128), nullable=False),
    sa.Column('size', sa.BigInteger(), nullable=False),
    sa.Column('expires_at', sa.Float(), nullable=False),
    sa.PrimaryKeyConstraint('id')
    )
    op.create_index('ix_upload_reservations_owner', 'upload_reservations', ['owner'])


def downgrade() -> None:
    op.drop_index('ix_upload_reservations_owner', table_name='upload_reservations')
    op.drop_table('upload_reservations')
