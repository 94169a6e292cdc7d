"""owners' quotas and limits; idempotency records per calling key; the client's request id beside usage

- ``owners.quotas`` / ``owners.limits``: an admin's overrides of the server's defaults (partial JSON dicts;
  null: all defaults). See ``tensora.placement.quotas``.
- ``idempotency_records`` is keyed by the calling key's id instead of its owner, so another key of the same
  owner cannot replay a response. The table is made anew: its rows are replay caches of at most 24 h, and
  those of key creations held the new keys' secrets in clear, which no row may hold any longer.
- ``token_usage.client_request_id``: the ``X-Request-Id`` the client sent, kept apart from the record's id
  (which the gateway makes), so a client cannot make two requests count as one.

Revision ID: 0008
Revises: 0007
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0008'
down_revision = '0007'
branch_labels = None
depends_on = None


def _idempotency(who: str) -> None:
    op.create_table(
        'idempotency_records',
        sa.Column(who, sa.String(length=128 if who == 'owner' else 32), nullable=False),
        sa.Column('method', sa.String(length=8), nullable=False),
        sa.Column('path', sa.String(length=512), nullable=False),
        sa.Column('key', sa.String(length=255), nullable=False),
        sa.Column('fingerprint', sa.String(length=64), nullable=False),
        sa.Column('state', sa.String(length=16), nullable=False),
        sa.Column('status', sa.Integer(), nullable=True),
        sa.Column('body', sa.Text(), nullable=True),
        sa.Column('created_at', sa.Float(), nullable=False),
        sa.Column('expires_at', sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint(who, 'method', 'path', 'key'),
    )
    op.create_index(op.f('ix_idempotency_records_expires_at'), 'idempotency_records', ['expires_at'])


def upgrade() -> None:
    with op.batch_alter_table('owners') as batch:
        batch.add_column(sa.Column('quotas', sa.JSON(), nullable=True))
        batch.add_column(sa.Column('limits', sa.JSON(), nullable=True))
    op.drop_index(op.f('ix_idempotency_records_expires_at'), table_name='idempotency_records')
    op.drop_table('idempotency_records')
    _idempotency('key_id')
    with op.batch_alter_table('token_usage') as batch:
        batch.add_column(sa.Column('client_request_id', sa.String(length=64), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('token_usage') as batch:
        batch.drop_column('client_request_id')
    op.drop_index(op.f('ix_idempotency_records_expires_at'), table_name='idempotency_records')
    op.drop_table('idempotency_records')
    _idempotency('owner')
    with op.batch_alter_table('owners') as batch:
        batch.drop_column('limits')
        batch.drop_column('quotas')
