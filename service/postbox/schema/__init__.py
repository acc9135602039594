"""The database schema: the declared contract, Alembic migrations and the DDL they apply."""
