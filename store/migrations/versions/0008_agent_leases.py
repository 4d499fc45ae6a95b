"""Osmosis 0.3 polling leases: the attempt an agent server admitted keeps what polling its result needs (the
server's id for it, the lease token, the waits, when it was last polled), so that another gateway process, or
this one restarted, resumes polling within the lease (``rollway.osmosis.v03``). Encrypted with the secret key
when one is set; never part of an attempt as the API shows it.

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-03
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("attempts", sa.Column("agent_lease", sa.Text(), nullable=True))


def downgrade() -> None:
    op.drop_column("attempts", "agent_lease")
