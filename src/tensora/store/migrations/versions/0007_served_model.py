"""replicas.served_model: the model name a replica's server answers to (``/model`` in a sandbox)

Revision ID: 0007
Revises: 0006
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0007'
down_revision = '0006'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('replicas') as batch:
        batch.add_column(sa.Column('served_model', sa.Text(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('replicas') as batch:
        batch.drop_column('served_model')
