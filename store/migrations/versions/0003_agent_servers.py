"""Remote agent servers (Osmosis protocol) and a queue of their own: runner claims never see their tasks.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-22
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None

QUEUED = "status IN ('queuing', 'requeuing')"
RUNNER_QUEUE = sa.text(f"{QUEUED} AND agent IS NULL")
AGENT_QUEUE = sa.text(f"{QUEUED} AND agent IS NOT NULL")


def upgrade() -> None:
    op.create_table(
        "agent_servers",
        sa.Column("name", sa.String(128), primary_key=True),
        sa.Column("url", sa.String(2048), nullable=False),
        sa.Column("api_key", sa.String(1024), nullable=True),
        sa.Column("max_concurrent", sa.Integer(), nullable=True),
        sa.Column("completion_params", sa.JSON(), nullable=True),
        sa.Column("created_time", sa.Float(), nullable=False),
        sa.Column("updated_time", sa.Float(), nullable=False),
    )
    op.drop_index("ix_rollouts_queue", table_name="rollouts")
    op.create_index(
        "ix_rollouts_queue",
        "rollouts",
        [sa.text("priority DESC"), "queue_time", "pk"],
        sqlite_where=RUNNER_QUEUE,
        postgresql_where=RUNNER_QUEUE,
    )
    op.create_index(
        "ix_rollouts_agent_queue",
        "rollouts",
        ["agent", sa.text("priority DESC"), "queue_time", "pk"],
        sqlite_where=AGENT_QUEUE,
        postgresql_where=AGENT_QUEUE,
    )


def downgrade() -> None:
    op.drop_index("ix_rollouts_agent_queue", table_name="rollouts")
    op.drop_index("ix_rollouts_queue", table_name="rollouts")
    queued = sa.text(QUEUED)
    op.create_index(
        "ix_rollouts_queue",
        "rollouts",
        [sa.text("priority DESC"), "queue_time", "pk"],
        sqlite_where=queued,
        postgresql_where=queued,
    )
    op.drop_table("agent_servers")
