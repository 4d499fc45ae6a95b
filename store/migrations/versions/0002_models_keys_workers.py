"""Model aliases with their backends, API keys and workers.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-22
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "model_aliases",
        sa.Column("alias", sa.String(256), primary_key=True),
        sa.Column("backends", sa.JSON(), nullable=False),
        sa.Column("version", sa.String(128), nullable=False),
        sa.Column("sampling", sa.JSON(), nullable=True),
        sa.Column("paused", sa.Boolean(), nullable=False),
        sa.Column("created_time", sa.Float(), nullable=False),
        sa.Column("updated_time", sa.Float(), nullable=False),
    )
    op.create_table(
        "api_keys",
        sa.Column("key_id", sa.String(64), primary_key=True),
        sa.Column("key_hash", sa.String(128), nullable=False, unique=True),
        sa.Column("prefix", sa.String(16), nullable=False),
        sa.Column("scope", sa.String(16), nullable=False),
        sa.Column("name", sa.String(256), nullable=True),
        sa.Column("rollout_id", sa.String(128), nullable=True),
        sa.Column("attempt_id", sa.String(64), nullable=True),
        sa.Column("created_time", sa.Float(), nullable=False),
        sa.Column("expires_time", sa.Float(), nullable=True),
        sa.Column("revoked_time", sa.Float(), nullable=True),
    )
    op.create_index("ix_api_keys_rollout_id", "api_keys", ["rollout_id"])
    op.create_table(
        "workers",
        sa.Column("worker_id", sa.String(128), primary_key=True),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("heartbeat_stats", sa.JSON(), nullable=True),
        sa.Column("last_heartbeat_time", sa.Float(), nullable=True),
        sa.Column("last_dequeue_time", sa.Float(), nullable=True),
        sa.Column("last_busy_time", sa.Float(), nullable=True),
        sa.Column("last_idle_time", sa.Float(), nullable=True),
        sa.Column("current_rollout_id", sa.String(128), nullable=True),
        sa.Column("current_attempt_id", sa.String(64), nullable=True),
    )


def downgrade() -> None:
    for table in ("workers", "api_keys", "model_aliases"):
        op.drop_table(table)
