"""Test harness: a real PostgreSQL, a migrated template database, one fresh clone per test.

``POSTBOX_TEST_DATABASE_URL`` points at a server (CI: the machine's PostgreSQL); when unset, an
embedded server from ``pgserver`` is started in a temporary folder.
"""

from __future__ import annotations

import os
import tempfile
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from pytest_postgresql.janitor import DatabaseJanitor

from postbox.schema import migrate
from tests.kafka_broker import kafka_broker  # noqa: F401  (the session's Kafka broker, tests/kafka_broker.py)

# Postbox processes started by tests log warnings and errors only (unless a test asks for more):
# several tests read their stderr through a pipe only at the end, and a full pipe would block them.
os.environ.setdefault("POSTBOX_LOG_LEVEL", "warning")


@dataclass(frozen=True)
class Server:
    """Where the test server is, and how to name a database on it."""

    params: dict[str, str]

    def url(self, dbname: str) -> str:
        p = dict(self.params, dbname=dbname)
        return make_conninfo("", **p)

    def janitor(self, dbname: str, template: str | None = None) -> DatabaseJanitor:
        return DatabaseJanitor(
            user=self.params.get("user", "postgres"),
            host=self.params.get("host", "127.0.0.1"),
            port=self.params.get("port", "5432"),
            password=self.params.get("password"),
            dbname=dbname,
            template_dbname=template,
        )


def _conninfo_url(params: dict[str, str]) -> str:
    """A postgresql:// URL (what Settings and Alembic expect) from connection parameters."""
    from urllib.parse import quote

    user = quote(params.get("user", "postgres"), safe="")
    pw = params.get("password")
    auth = f"{user}:{quote(pw, safe='')}@" if pw else f"{user}@"
    host = params.get("host", "127.0.0.1")
    port = params.get("port", "5432")
    db = params.get("dbname", "postgres")
    if host.startswith("/"):
        return f"postgresql://{auth}/{db}?host={quote(host, safe='')}&port={port}"
    return f"postgresql://{auth}{host}:{port}/{db}"


@pytest.fixture(scope="session")
def pg_server() -> Server:
    url = os.environ.get("POSTBOX_TEST_DATABASE_URL")
    if url:
        params = {k: str(v) for k, v in conninfo_to_dict(url).items() if v is not None}
    else:
        from postbox.demo.embedded import embedded_server

        data = Path(tempfile.gettempdir()) / "postbox-tests-pgdata"
        server = embedded_server(data)
        params = {k: str(v) for k, v in conninfo_to_dict(server.get_uri()).items() if v is not None}
        params.setdefault("port", "5432")
    params.pop("dbname", None)
    return Server(params)


@pytest.fixture(scope="session")
def template_db(pg_server: Server) -> Iterator[str]:
    name = f"postbox_tmpl_{os.getpid()}_{uuid.uuid4().hex[:6]}"
    janitor = pg_server.janitor(name)
    janitor.init()
    try:
        migrate.upgrade(_conninfo_url(dict(pg_server.params, dbname=name)))
        yield name
    finally:
        janitor.drop()


@dataclass(frozen=True)
class Database:
    """One test's database: a clone of the migrated template."""

    name: str
    url: str  # postgresql:// URL
    server: Server

    def connect(self, **kwargs: object) -> psycopg.Connection[tuple[object, ...]]:
        return psycopg.connect(self.url, **kwargs)  # type: ignore[arg-type]


def _cloned(server: Server, prefix: str, template: str | None) -> Iterator[Database]:
    name = f"{prefix}_{uuid.uuid4().hex[:12]}"
    janitor = server.janitor(name, template=template)
    janitor.init()
    try:
        yield Database(name, _conninfo_url(dict(server.params, dbname=name)), server)
    finally:
        janitor.drop()


@pytest.fixture
def database(pg_server: Server, template_db: str) -> Iterator[Database]:
    """A fresh clone of the migrated template database."""
    yield from _cloned(pg_server, "postbox_t", template_db)


@pytest.fixture
def empty_database(pg_server: Server) -> Iterator[Database]:
    """A database with nothing in it (for migration tests)."""
    yield from _cloned(pg_server, "postbox_e", None)


@pytest.fixture
def conn(database: Database) -> Iterator[psycopg.Connection[tuple[object, ...]]]:
    with database.connect() as c:
        yield c
