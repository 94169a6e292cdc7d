"""dashboard_sessions: the dashboard's signed-in browsers, by the SHA-256 of their session ids

The dashboard keeps a session instead of the API key in the browser (``tensora.api.sessions``): a row per
sign-in, with the key it acts as, its absolute expiry, when it was last used (the idle timeout) and when it
was signed out. No row holds a secret.

Revision ID: 0011
Revises: 0010
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0011'
down_revision = '0010'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        'dashboard_sessions',
        sa.Column('id', sa.String(length=64), nullable=False),
        sa.Column('key_id', sa.String(length=32), nullable=False),
        sa.Column('owner', sa.String(length=128), nullable=False),
        sa.Column('created_at', sa.Float(), nullable=False),
        sa.Column('expires_at', sa.Float(), nullable=False),
        sa.Column('last_seen_at', sa.Float(), nullable=False),
        sa.Column('revoked_at', sa.Float(), nullable=True),
        sa.ForeignKeyConstraint(['key_id'], ['api_keys.id']),
        sa.PrimaryKeyConstraint('id'),
    )
    op.create_index(op.f('ix_dashboard_sessions_key_id'), 'dashboard_sessions', ['key_id'])
    op.create_index(op.f('ix_dashboard_sessions_expires_at'), 'dashboard_sessions', ['expires_at'])


def downgrade() -> None:
    op.drop_index(op.f('ix_dashboard_sessions_expires_at'), table_name='dashboard_sessions')
    op.drop_index(op.f('ix_dashboard_sessions_key_id'), table_name='dashboard_sessions')
    op.drop_table('dashboard_sessions')
