"""The store's statements and transactions: plain functions of one SQLAlchemy ``Connection`` (or, for a call's
writes on PostgreSQL, of the driver's connection), which ``Store`` runs as one read or one write operation. They
check and change the stored rows; ``store.db`` is how they reach the database."""
