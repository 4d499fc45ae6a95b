"""Weight updates: every change of an alias's weights as one recorded operation (``store.sql.updates``), and on
each alias the open update holding it with the end of its hold.

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "weight_updates",
        sa.Column("update_id", sa.String(64), primary_key=True),
        sa.Column("alias", sa.String(256), nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("form", sa.String(16), nullable=False),
        sa.Column("in_flight", sa.String(8), nullable=False),
        sa.Column("from_version", sa.String(128), nullable=False),
        sa.Column("to_version", sa.String(128), nullable=False),
        sa.Column("by", sa.String(256), nullable=False),
        sa.Column("note", sa.String(1024), nullable=True),
        sa.Column("was_paused", sa.Boolean(), nullable=False),
        sa.Column("begun_time", sa.Float(), nullable=False),
        sa.Column("deadline", sa.Float(), nullable=False),
        sa.Column("finished_time", sa.Float(), nullable=True),
        sa.Column("held_seconds", sa.Float(), nullable=True),
        sa.Column("drained", sa.Boolean(), nullable=True),
        sa.Column("aborted_calls", sa.Integer(), nullable=False),
        sa.Column("steps", sa.JSON(), nullable=True),
        sa.Column("engine_versions", sa.JSON(), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
    )
    op.create_index("ix_weight_updates_alias", "weight_updates", ["alias", "begun_time"])
    op.create_index("ix_weight_updates_state", "weight_updates", ["state"])
    with op.batch_alter_table("model_aliases") as batch:
        batch.add_column(sa.Column("update_id", sa.String(64), nullable=True))
        batch.add_column(sa.Column("hold_until", sa.Float(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("model_aliases") as batch:
        batch.drop_column("hold_until")
        batch.drop_column("update_id")
    op.drop_index("ix_weight_updates_state", "weight_updates")
    op.drop_index("ix_weight_updates_alias", "weight_updates")
    op.drop_table("weight_updates")
