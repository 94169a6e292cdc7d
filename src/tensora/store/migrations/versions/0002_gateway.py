"""gateway: per-key rate limits, token usage records

Revision ID: 0002
Revises: 0001
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0002'
down_revision = '0001'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('api_keys', schema=None) as batch_op:
        batch_op.add_column(sa.Column('rpm', sa.Integer(), nullable=True))
        batch_op.add_column(sa.Column('tpm', sa.Integer(), nullable=True))
    op.create_table('token_usage',
    sa.Column('id', sa.String(length=64), nullable=False),
    sa.Column('at', sa.Float(), nullable=False),
    sa.Column('owner', sa.String(length=128), nullable=False),
    sa.Column('key_id', sa.String(length=32), nullable=False),
    sa.Column('endpoint', sa.String(length=63), nullable=False),
    sa.Column('endpoint_id', sa.String(length=32), nullable=True),
    sa.Column('product', sa.String(length=32), nullable=False),
    sa.Column('answered_by', sa.String(length=32), nullable=True),
    sa.Column('model', sa.String(length=128), nullable=False),
    sa.Column('served_by', sa.String(length=32), nullable=False),
    sa.Column('region', sa.String(length=63), nullable=False),
    sa.Column('prompt_tokens', sa.Integer(), nullable=False),
    sa.Column('completion_tokens', sa.Integer(), nullable=False),
    sa.Column('status', sa.Integer(), nullable=False),
    sa.PrimaryKeyConstraint('id')
    )
    with op.batch_alter_table('token_usage', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_token_usage_at'), ['at'], unique=False)
        batch_op.create_index(batch_op.f('ix_token_usage_owner'), ['owner'], unique=False)


def downgrade() -> None:
    with op.batch_alter_table('token_usage', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_token_usage_owner'))
        batch_op.drop_index(batch_op.f('ix_token_usage_at'))
    op.drop_table('token_usage')
    with op.batch_alter_table('api_keys', schema=None) as batch_op:
        batch_op.drop_column('tpm')
        batch_op.drop_column('rpm')
