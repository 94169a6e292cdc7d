"""owners.trusted replaces owners.untrusted: every owner is untrusted unless an admin marks it trusted

Every row becomes trusted = false, whatever its untrusted was:

- untrusted = true: an admin marked the owner untrusted; it stays untrusted (not trusted).
- untrusted = false: each row was written by an admin's PUT /v1/owners/{owner} (the only writer), so it is
  a recorded choice; but while it was written, false was also what every owner without a row had, and the
  one way to take a mark back (``tensora owners set X --trusted`` after ``--untrusted``). It never said "run
  this owner outside the sandbox" as a decision apart from the default, and trusted now grants exactly that,
  so it is not granted on that evidence: the owner is untrusted, and an admin who means it sets it again.
  ``updated_at`` is kept, so ``tensora owners list`` still shows whom the operator had looked at.
- no row: untrusted, as every owner now is by default.

A downgrade writes untrusted = not trusted (an owner with no row is then trusted again, as 0005 had it).

Revision ID: 0006
Revises: 0005
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0006'
down_revision = '0005'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('owners') as batch:
        batch.add_column(sa.Column('trusted', sa.Boolean(), nullable=False, server_default=sa.false()))
    with op.batch_alter_table('owners') as batch:
        batch.drop_column('untrusted')
        batch.alter_column('trusted', server_default=None)


def downgrade() -> None:
    with op.batch_alter_table('owners') as batch:
        batch.add_column(sa.Column('untrusted', sa.Boolean(), nullable=False, server_default=sa.false()))
    owners = sa.table('owners', sa.column('trusted', sa.Boolean()), sa.column('untrusted', sa.Boolean()))
    op.execute(owners.update().values(untrusted=sa.not_(owners.c.trusted)))
    with op.batch_alter_table('owners') as batch:
        batch.drop_column('trusted')
        batch.alter_column('untrusted', server_default=None)
