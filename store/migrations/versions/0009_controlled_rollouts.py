"""Rollouts driven by an outside controller (Agent-lightning 1.0's ``agl-controller``): what the controller set on
each (``controlled_rollouts``), the endpoints its trainer registered (``engine_models``) and the proxy's pause
(``proxy_pause``), so that all of it survives a restart and every process on the database sees the same.

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-03
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "controlled_rollouts",
        sa.Column("rollout_id", sa.String(128), sa.ForeignKey("rollouts.rollout_id"), primary_key=True),
        sa.Column("is_train", sa.Boolean(), nullable=False),
        sa.Column("config", sa.JSON(), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("k8s_job_name", sa.Text(), nullable=True),
        sa.Column("last_attempt_id", sa.String(128), nullable=True),
        sa.Column("error_message", sa.Text(), nullable=True),
        sa.Column("early_events", sa.JSON(), nullable=True),
        sa.Column("created_time", sa.Float(), nullable=False),
        sa.Column("updated_time", sa.Float(), nullable=False),
        sa.Column("terminal_seq", sa.Integer(), nullable=True),
        sa.Column("deleted_time", sa.Float(), nullable=True),
    )
    op.create_index("ix_controlled_rollouts_terminal_seq", "controlled_rollouts", ["terminal_seq"])
    op.create_table(
        "engine_models",
        sa.Column("model", sa.String(256), primary_key=True),
        sa.Column("endpoint", sa.String(2048), primary_key=True),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("created_time", sa.Float(), nullable=False),
    )
    op.create_table(
        "proxy_pause",
        sa.Column("name", sa.String(32), primary_key=True),
        sa.Column("paused", sa.Boolean(), nullable=False),
        sa.Column("retry_after_seconds", sa.Integer(), nullable=False),
        sa.Column("reason", sa.Text(), nullable=True),
        sa.Column("aliases", sa.JSON(), nullable=True),
        sa.Column("updated_time", sa.Float(), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("proxy_pause")
    op.drop_table("engine_models")
    op.drop_table("controlled_rollouts")
