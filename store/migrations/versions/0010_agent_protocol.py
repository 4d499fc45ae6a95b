"""The protocol an agent server is registered with: ``v1`` or ``0.3`` (Osmosis), or null to have Rollway tell it
from the server's ``/health`` (``rollway.osmosis.dispatcher``). A server registered with one is never asked.

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-07
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("agent_servers", sa.Column("protocol", sa.String(length=8), nullable=True))


def downgrade() -> None:
    op.drop_column("agent_servers", "protocol")
