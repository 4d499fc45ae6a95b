"""Gateway replicas: each gateway process reports the calls it has in flight, so a drain sees every replica's.

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-22
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "gateway_replicas",
        sa.Column("replica_id", sa.String(64), primary_key=True),
        sa.Column("host", sa.String(255), nullable=False),
        sa.Column("pid", sa.Integer(), nullable=False),
        sa.Column("started_time", sa.Float(), nullable=False),
        sa.Column("reported_time", sa.Float(), nullable=False),
        sa.Column("revision", sa.BigInteger(), nullable=False),
        sa.Column("in_flight", sa.JSON(), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("gateway_replicas")
