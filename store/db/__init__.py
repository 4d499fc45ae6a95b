"""The database machinery under the store's statements: engines and their settings, the tables and their
migrations, the write paths, the SQL that differs between SQLite and PostgreSQL, what the columns hold and what
the database's failures are."""
