"""initial schema: workloads, replicas, events, usage, nodes, keys, idempotency, leases

Revision ID: 0001
Revises: (none)
Create Date: 2026-12-02 21:51:39.846375
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0001'
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('api_keys',
    sa.Column('id', sa.String(length=32), nullable=False),
    sa.Column('digest', sa.String(length=64), nullable=False),
    sa.Column('hint', sa.String(length=16), nullable=False),
    sa.Column('owner', sa.String(length=128), nullable=False),
    sa.Column('name', sa.String(length=128), nullable=False),
    sa.Column('scopes', sa.JSON(), nullable=False),
    sa.Column('created_at', sa.Float(), nullable=False),
    sa.Column('revoked_at', sa.Float(), nullable=True),
    sa.PrimaryKeyConstraint('id'),
    sa.UniqueConstraint('digest')
    )
    with op.batch_alter_table('api_keys', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_api_keys_owner'), ['owner'], unique=False)

    op.create_table('idempotency_records',
    sa.Column('owner', sa.String(length=128), nullable=False),
    sa.Column('method', sa.String(length=8), nullable=False),
    sa.Column('path', sa.String(length=512), nullable=False),
    sa.Column('key', sa.String(length=255), nullable=False),
    sa.Column('fingerprint', sa.String(length=64), nullable=False),
    sa.Column('state', sa.String(length=16), nullable=False),
    sa.Column('status', sa.Integer(), nullable=True),
    sa.Column('body', sa.Text(), nullable=True),
    sa.Column('created_at', sa.Float(), nullable=False),
    sa.Column('expires_at', sa.Float(), nullable=False),
    sa.PrimaryKeyConstraint('owner', 'method', 'path', 'key')
    )
    with op.batch_alter_table('idempotency_records', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_idempotency_records_expires_at'), ['expires_at'], unique=False)

    op.create_table('leases',
    sa.Column('name', sa.String(length=128), nullable=False),
    sa.Column('holder', sa.String(length=128), nullable=False),
    sa.Column('expires_at', sa.Float(), nullable=False),
    sa.Column('acquired_at', sa.Float(), nullable=False),
    sa.PrimaryKeyConstraint('name')
    )
    op.create_table('nodes',
    sa.Column('name', sa.String(length=253), nullable=False),
    sa.Column('region', sa.String(length=63), nullable=False),
    sa.Column('cpu', sa.Float(), nullable=False),
    sa.Column('memory', sa.BigInteger(), nullable=False),
    sa.Column('gpus', sa.JSON(), nullable=False),
    sa.Column('labels', sa.JSON(), nullable=False),
    sa.Column('schedulable', sa.Boolean(), nullable=False),
    sa.Column('updated_at', sa.Float(), nullable=False),
    sa.PrimaryKeyConstraint('name')
    )
    with op.batch_alter_table('nodes', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_nodes_region'), ['region'], unique=False)

    op.create_table('workloads',
    sa.Column('id', sa.String(length=32), nullable=False),
    sa.Column('owner', sa.String(length=128), nullable=False),
    sa.Column('kind', sa.String(length=16), nullable=False),
    sa.Column('name', sa.String(length=63), nullable=False),
    sa.Column('region', sa.String(length=63), nullable=False),
    sa.Column('gpu_class', sa.String(length=63), nullable=False),
    sa.Column('requested_class', sa.String(length=63), nullable=False),
    sa.Column('placed_class', sa.String(length=63), nullable=True),
    sa.Column('fallback', sa.JSON(), nullable=False),
    sa.Column('fallback_after_s', sa.Float(), nullable=False),
    sa.Column('placement', sa.String(length=16), nullable=False),
    sa.Column('state', sa.String(length=16), nullable=False),
    sa.Column('reason', sa.Text(), nullable=False),
    sa.Column('fallback_eligible_at', sa.Float(), nullable=True),
    sa.Column('restart_available', sa.Boolean(), nullable=False),
    sa.Column('restart_reason', sa.Text(), nullable=False),
    sa.Column('replicas', sa.Integer(), nullable=False),
    sa.Column('model', sa.Text(), nullable=True),
    sa.Column('model_params', sa.BigInteger(), nullable=True),
    sa.Column('model_bytes', sa.BigInteger(), nullable=True),
    sa.Column('spec', sa.JSON(), nullable=False),
    sa.Column('created_at', sa.Float(), nullable=False),
    sa.Column('updated_at', sa.Float(), nullable=False),
    sa.Column('queued_since', sa.Float(), nullable=True),
    sa.Column('deleted_at', sa.Float(), nullable=True),
    sa.PrimaryKeyConstraint('id')
    )
    with op.batch_alter_table('workloads', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_workloads_owner'), ['owner'], unique=False)
        batch_op.create_index('ix_workloads_region_state', ['region', 'state'], unique=False)

    op.create_table('events',
    sa.Column('id', sa.Integer(), autoincrement=True, nullable=False),
    sa.Column('workload_id', sa.String(length=32), nullable=False),
    sa.Column('at', sa.Float(), nullable=False),
    sa.Column('type', sa.String(length=32), nullable=False),
    sa.Column('from_state', sa.String(length=16), nullable=True),
    sa.Column('to_state', sa.String(length=16), nullable=True),
    sa.Column('reason', sa.Text(), nullable=False),
    sa.ForeignKeyConstraint(['workload_id'], ['workloads.id'], ),
    sa.PrimaryKeyConstraint('id')
    )
    with op.batch_alter_table('events', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_events_workload_id'), ['workload_id'], unique=False)

    op.create_table('replicas',
    sa.Column('id', sa.String(length=32), nullable=False),
    sa.Column('workload_id', sa.String(length=32), nullable=False),
    sa.Column('slot', sa.Integer(), nullable=False),
    sa.Column('cls', sa.String(length=63), nullable=False),
    sa.Column('node', sa.String(length=253), nullable=False),
    sa.Column('region', sa.String(length=63), nullable=False),
    sa.Column('state', sa.String(length=16), nullable=False),
    sa.Column('role', sa.String(length=16), nullable=False),
    sa.Column('url', sa.Text(), nullable=True),
    sa.Column('detail', sa.Text(), nullable=False),
    sa.Column('created_at', sa.Float(), nullable=False),
    sa.Column('updated_at', sa.Float(), nullable=False),
    sa.ForeignKeyConstraint(['workload_id'], ['workloads.id'], ),
    sa.PrimaryKeyConstraint('id')
    )
    with op.batch_alter_table('replicas', schema=None) as batch_op:
        batch_op.create_index('ix_replicas_region_state', ['region', 'state'], unique=False)
        batch_op.create_index(batch_op.f('ix_replicas_workload_id'), ['workload_id'], unique=False)

    op.create_table('usage_segments',
    sa.Column('id', sa.Integer(), autoincrement=True, nullable=False),
    sa.Column('workload_id', sa.String(length=32), nullable=False),
    sa.Column('replica_id', sa.String(length=32), nullable=False),
    sa.Column('owner', sa.String(length=128), nullable=False),
    sa.Column('region', sa.String(length=63), nullable=False),
    sa.Column('kind', sa.String(length=16), nullable=False),
    sa.Column('placed_class', sa.String(length=63), nullable=False),
    sa.Column('started_at', sa.Float(), nullable=False),
    sa.Column('ended_at', sa.Float(), nullable=True),
    sa.ForeignKeyConstraint(['workload_id'], ['workloads.id'], ),
    sa.PrimaryKeyConstraint('id'),
    sa.UniqueConstraint('replica_id')
    )
    with op.batch_alter_table('usage_segments', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_usage_segments_owner'), ['owner'], unique=False)
        batch_op.create_index(batch_op.f('ix_usage_segments_workload_id'), ['workload_id'], unique=False)



def downgrade() -> None:
    with op.batch_alter_table('usage_segments', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_usage_segments_workload_id'))
        batch_op.drop_index(batch_op.f('ix_usage_segments_owner'))

    op.drop_table('usage_segments')
    with op.batch_alter_table('replicas', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_replicas_workload_id'))
        batch_op.drop_index('ix_replicas_region_state')

    op.drop_table('replicas')
    with op.batch_alter_table('events', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_events_workload_id'))

    op.drop_table('events')
    with op.batch_alter_table('workloads', schema=None) as batch_op:
        batch_op.drop_index('ix_workloads_region_state')
        batch_op.drop_index(batch_op.f('ix_workloads_owner'))

    op.drop_table('workloads')
    with op.batch_alter_table('nodes', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_nodes_region'))

    op.drop_table('nodes')
    op.drop_table('leases')
    with op.batch_alter_table('idempotency_records', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_idempotency_records_expires_at'))

    op.drop_table('idempotency_records')
    with op.batch_alter_table('api_keys', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_api_keys_owner'))

    op.drop_table('api_keys')
