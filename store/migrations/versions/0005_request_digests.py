"""Keyed requests: the rollouts and attempts a request with an idempotency key makes keep a digest of what it
asked for, so the same request sent again is recognised after the rows were edited (``store.sql.replays``).

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-23
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    for table in ("rollouts", "attempts"):
        op.add_column(table, sa.Column("request_digest", sa.String(32), nullable=True))


def downgrade() -> None:
    for table in ("rollouts", "attempts"):
        op.drop_column(table, "request_digest")
