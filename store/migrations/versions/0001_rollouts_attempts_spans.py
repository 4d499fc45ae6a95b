"""Rollouts, attempts, spans, span sequences, resources and counters.

Revision ID: 0001
Revises:
Create Date: 2026-11-22
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

BIG_ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
QUEUED = sa.text("status IN ('queuing', 'requeuing')")


def upgrade() -> None:
    op.create_table(
        "rollouts",
        sa.Column("pk", sa.Integer(), primary_key=True),
        sa.Column("rollout_id", sa.String(128), nullable=False, unique=True),
        sa.Column("input", sa.JSON(), nullable=True),
        sa.Column("mode", sa.String(16), nullable=True),
        sa.Column("resources_id", sa.String(64), nullable=True),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("config", sa.JSON(), nullable=False),
        sa.Column("metadata", sa.JSON(), nullable=True),
        sa.Column("group_id", sa.String(128), nullable=True),
        sa.Column("group_size", sa.Integer(), nullable=True),
        sa.Column("group_index", sa.Integer(), nullable=True),
        sa.Column("priority", sa.Integer(), nullable=False),
        sa.Column("agent", sa.String(128), nullable=True),
        sa.Column("start_time", sa.Float(), nullable=False),
        sa.Column("end_time", sa.Float(), nullable=True),
        sa.Column("queue_time", sa.Float(), nullable=True),
        sa.Column("finish_seq", sa.BigInteger(), nullable=True),
        sa.Column("attempt_count", sa.Integer(), nullable=False),
        sa.Column("latest_attempt_id", sa.String(64), nullable=True),
        sa.Column("updated_time", sa.Float(), nullable=False),
    )
    op.create_index("ix_rollouts_status", "rollouts", ["status"])
    op.create_index("ix_rollouts_group_id", "rollouts", ["group_id"])
    op.create_index("ix_rollouts_finish_seq", "rollouts", ["finish_seq"])
    op.create_index(
        "ix_rollouts_queue",
        "rollouts",
        [sa.text("priority DESC"), "queue_time", "pk"],
        sqlite_where=QUEUED,
        postgresql_where=QUEUED,
    )
    op.create_table(
        "attempts",
        sa.Column("pk", sa.Integer(), primary_key=True),
        sa.Column("rollout_id", sa.String(128), sa.ForeignKey("rollouts.rollout_id"), nullable=False),
        sa.Column("attempt_id", sa.String(64), nullable=False, unique=True),
        sa.Column("sequence_id", sa.Integer(), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("worker_id", sa.String(128), nullable=True),
        sa.Column("start_time", sa.Float(), nullable=False),
        sa.Column("end_time", sa.Float(), nullable=True),
        sa.Column("last_heartbeat_time", sa.Float(), nullable=True),
        sa.Column("metadata", sa.JSON(), nullable=True),
        sa.UniqueConstraint("rollout_id", "sequence_id", name="uq_attempts_rollout_sequence"),
    )
    op.create_table(
        "spans",
        sa.Column("pk", BIG_ID, primary_key=True),
        sa.Column("rollout_id", sa.String(128), nullable=False),
        sa.Column("attempt_id", sa.String(64), nullable=False),
        sa.Column("sequence_id", sa.Integer(), nullable=False),
        sa.Column("trace_id", sa.String(64), nullable=False),
        sa.Column("span_id", sa.String(64), nullable=False),
        sa.Column("parent_id", sa.String(64), nullable=True),
        sa.Column("name", sa.String(512), nullable=False),
        sa.Column("status_code", sa.String(8), nullable=False),
        sa.Column("status_description", sa.String(), nullable=True),
        sa.Column("start_time", sa.Float(), nullable=True),
        sa.Column("end_time", sa.Float(), nullable=True),
        sa.Column("attributes", sa.JSON(), nullable=True),
        sa.Column("events", sa.JSON(), nullable=True),
        sa.Column("links", sa.JSON(), nullable=True),
        sa.Column("resource", sa.JSON(), nullable=True),
        sa.Column("extra", sa.JSON(), nullable=True),
        sa.Column("input_tokens", sa.Integer(), nullable=True),
        sa.Column("output_tokens", sa.Integer(), nullable=True),
        sa.Column("created_time", sa.Float(), nullable=False),
        sa.UniqueConstraint("rollout_id", "attempt_id", "sequence_id", name="uq_spans_sequence"),
        sa.UniqueConstraint("rollout_id", "attempt_id", "span_id", name="uq_spans_span_id"),
    )
    op.create_table(
        "span_sequences",
        sa.Column("rollout_id", sa.String(128), primary_key=True),
        sa.Column("attempt_id", sa.String(64), primary_key=True),
        sa.Column("last_value", sa.Integer(), nullable=False),
    )
    op.create_table(
        "resources",
        sa.Column("pk", sa.Integer(), primary_key=True),
        sa.Column("resources_id", sa.String(64), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("resources", sa.JSON(), nullable=False),
        sa.Column("create_time", sa.Float(), nullable=False),
        sa.Column("update_time", sa.Float(), nullable=False),
        sa.UniqueConstraint("resources_id", "version", name="uq_resources_version"),
    )
    op.create_index("ix_resources_resources_id", "resources", ["resources_id"])
    op.create_table(
        "counters",
        sa.Column("name", sa.String(64), primary_key=True),
        sa.Column("value", sa.Float(), nullable=False),
    )


def downgrade() -> None:
    for table in ("counters", "resources", "span_sequences", "spans", "attempts", "rollouts"):
        op.drop_table(table)
