"""owner storage and sandbox uids: files (an owner's uploaded files) and owner_uids (one uid per owner)

Revision ID: 0005
Revises: 0004
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0005'
down_revision = '0004'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('files',
    sa.Column('owner', sa.String(length=128), nullable=False),
    sa.Column('path', sa.String(length=512), nullable=False),
    sa.Column('size', sa.BigInteger(), nullable=False),
    sa.Column('sha256', sa.String(length=64), nullable=False),
    sa.Column('created_at', sa.Float(), nullable=False),
    sa.PrimaryKeyConstraint('owner', 'path')
    )
    op.create_table('owner_uids',
    sa.Column('owner', sa.String(length=128), nullable=False),
    sa.Column('uid', sa.Integer(), nullable=False),
    sa.Column('created_at', sa.Float(), nullable=False),
    sa.PrimaryKeyConstraint('owner'),
    sa.UniqueConstraint('uid')
    )


def downgrade() -> None:
    op.drop_table('owner_uids')
    op.drop_table('files')
