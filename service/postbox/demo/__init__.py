"""``postbox demo`` and the embedded PostgreSQL it (and ``make test``) use when no database is given."""
