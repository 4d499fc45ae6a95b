"""Encrypted API keys: an agent server's key may be kept encrypted (``catalog.Cipher``, when the store has a secret
key) in a column of its own; a backend's is kept in its alias's JSON (``api_key_sealed``), which needs no column.
Keys stored in clear are encrypted when a store opens with a secret key (``catalog.seal_stored``), not here: a
migration does not know the key.

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-28
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("agent_servers", sa.Column("api_key_sealed", sa.Text(), nullable=True))


def downgrade() -> None:
    op.drop_column("agent_servers", "api_key_sealed")
