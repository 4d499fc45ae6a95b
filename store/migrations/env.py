"""Alembic environment. Rollway runs migrations itself (``store.db.migrate``) on a connection it passes in."""

from __future__ import annotations

from alembic import context
from sqlmodel import SQLModel

import rollway.store.db.models  # noqa: F401  (registers the tables)

connection = context.config.attributes["connection"]
context.configure(
    connection=connection,
    target_metadata=SQLModel.metadata,
    render_as_batch=connection.dialect.name == "sqlite",
)
with context.begin_transaction():
    context.run_migrations()
