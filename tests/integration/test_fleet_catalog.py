"""A fleet's catalog query on a real home database: its rows are the set, read again on every
read; a query of the wrong shape, a failing one or an unreachable home database keeps the last
good set and says why; the query cannot write; the file and the catalog must agree."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TypeVar

import psycopg
import pytest

from outbox_farm.db.catalog import read_catalog
from outbox_farm.errors import ConfigurationError, ConnectionLost, DatabaseError
from outbox_farm.fleet.databases import CATALOG, Listing, Sources

T = TypeVar("T")
QUERY = "SELECT name, dsn FROM tenants WHERE dsn LIKE 'host=%' ORDER BY name"
ONE = "host=db.internal dbname=tenant_1"
TWO = "host=db.internal dbname=tenant_2"
UNREACHABLE = "host=127.0.0.1 port=1 dbname=home user=fleet password=home-secret-value"


def run(work: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(asyncio.wait_for(work, 60))


@pytest.fixture
def home(empty_dsn: str) -> str:
    """A home database with a `tenants` table holding tenant_1."""
    with psycopg.connect(empty_dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE tenants (name text, dsn text)")
        conn.execute("INSERT INTO tenants VALUES ('tenant_1', %s)", [ONE])
    return empty_dsn


def sql(dsn: str, statement: str, *params: str | None) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(statement, list(params))


def test_the_catalog_is_the_set_and_a_row_added_is_served_next_read(home: str) -> None:
    sources = Sources(None, QUERY, home)

    first = run(sources.read())
    sql(home, "INSERT INTO tenants VALUES ('tenant_2', %s)", TWO)
    second = run(sources.read())

    assert first == Listing({"tenant_1": ONE}, {})
    assert second == Listing({"tenant_1": ONE, "tenant_2": TWO}, {})


def test_a_name_column_of_the_servers_own_catalog_is_text_enough(home: str) -> None:
    rows = run(
        read_catalog(
            home,
            "SELECT datname, 'dbname=' || datname FROM pg_database "
            "WHERE datname = current_database()",
        )
    )

    [(name, dsn)] = rows
    assert dsn == f"dbname={name}"


def test_rows_without_a_usable_name_or_dsn_are_problems_of_their_own(home: str) -> None:
    sql(
        home,
        "INSERT INTO tenants VALUES (NULL, %s), ('bad name', %s), ('tenant_3', NULL), "
        "('tenant_4', %s), ('tenant_5', %s), ('tenant_5', %s), ('tenant_1', %s)",
        TWO,
        TWO,
        "host='unterminated",
        ONE,
        TWO,
        ONE,
    )

    listing = run(Sources(None, "SELECT name, dsn FROM tenants", home).read())

    assert listing.databases == {"tenant_1": ONE}
    assert listing.problems["tenant_3"] == "its DSN is NULL in the catalog"
    assert listing.problems["tenant_4"].startswith("the DSN of the catalog cannot be parsed: ")
    assert listing.problems["tenant_5"] == (
        "the catalog has several rows of it with different DSNs"
    )
    assert listing.problems[CATALOG] == (
        "2 rows skipped: a NULL name; name 'bad name' is not 1 to 63 of A-Z a-z 0-9 _ . -, "
        "starting with a letter or a digit"
    )


def test_a_query_of_the_wrong_shape_is_the_catalogs_problem(home: str) -> None:
    with pytest.raises(ConfigurationError, match="must return two text columns, name and dsn"):
        run(read_catalog(home, "SELECT name, dsn, 1 AS n FROM tenants"))
    sources = Sources(None, "SELECT name, length(dsn) FROM tenants", home)

    listing = run(sources.read())

    assert listing.databases == {}
    assert listing.problems == {
        CATALOG: "the catalog query must return two text columns, name and dsn (cast with "
        "::text); it returns name text, length int4 (nothing read from it yet)"
    }


def test_a_failing_query_keeps_the_last_good_set_until_it_answers(home: str) -> None:
    sources = Sources(None, QUERY, home)
    good = run(sources.read())

    sql(home, "ALTER TABLE tenants RENAME TO renamed")
    failing = run(sources.read())
    sql(home, "ALTER TABLE renamed RENAME TO tenants")
    sql(home, "INSERT INTO tenants VALUES ('tenant_2', %s)", TWO)
    answering = run(sources.read())

    assert good == Listing({"tenant_1": ONE}, {})
    assert failing.databases == good.databases
    assert list(failing.problems) == [CATALOG]
    assert 'relation "tenants" does not exist' in failing.problems[CATALOG]
    assert failing.problems[CATALOG].endswith("(its last good list, 1 database, kept)")
    assert answering == Listing({"tenant_1": ONE, "tenant_2": TWO}, {})


def test_the_query_cannot_write(home: str) -> None:
    deleting = "WITH gone AS (DELETE FROM tenants RETURNING name, dsn) SELECT * FROM gone"

    with pytest.raises(DatabaseError) as caught:
        run(read_catalog(home, deleting))

    assert caught.value.sqlstate == "25006"  # read_only_sql_transaction
    assert not isinstance(caught.value, ConnectionLost)
    assert run(read_catalog(home, "SELECT name, dsn FROM tenants")) == [("tenant_1", ONE)]


def test_an_unreachable_home_is_a_lost_connection_without_its_secret(home: str) -> None:
    with pytest.raises(ConnectionLost) as caught:
        run(read_catalog(UNREACHABLE, QUERY))
    sources = Sources(None, QUERY, home)
    good = run(sources.read())
    sources.home_dsn = UNREACHABLE  # the home database goes away between two reads

    listing = run(sources.read())

    assert "home-secret-value" not in str(caught.value)
    assert "catalog query on" in str(caught.value)
    assert listing.databases == good.databases == {"tenant_1": ONE}
    assert "home-secret-value" not in listing.problems[CATALOG]
    assert "connection" in listing.problems[CATALOG].lower()
    assert listing.problems[CATALOG].endswith("(its last good list, 1 database, kept)")


def test_the_file_and_the_catalog_must_agree_on_a_name(home: str, tmp_path: Path) -> None:
    sql(home, "INSERT INTO tenants VALUES ('tenant_2', %s), ('tenant_3', %s)", TWO, ONE)
    path = tmp_path / "set.toml"
    path.write_text(
        f'[databases]\ntenant_1 = "{ONE}"\ntenant_3 = "{TWO}"\nfile_only = "{ONE}"\n',
        encoding="utf-8",
    )

    listing = run(Sources(path, "SELECT name, dsn FROM tenants", home).read())

    assert listing.databases == {"tenant_1": ONE, "tenant_2": TWO, "file_only": ONE}
    assert listing.problems == {
        "tenant_3": "the file and the catalog give it different DSNs; make them agree"
    }
