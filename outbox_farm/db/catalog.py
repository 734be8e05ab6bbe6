"""The catalog of a fleet: the user's own query, on the home database, naming the databases the
fleet serves; and the check of a DSN that libpq must be able to parse before anyone connects.

The query is the user's configuration, trusted as a DSN is, so it is run as written. It still
runs in a READ ONLY transaction with a statement timeout of its own: a query that was meant to
read a table must not be able to change one, nor hold every process of the fleet for minutes.
Each read opens a connection of its own and closes it: the catalog is read every few seconds
at most, and a connection kept between reads would be one more thing to find broken.
"""

from __future__ import annotations

import psycopg
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict
from psycopg.postgres import types

from ..dsn import redact, scrub
from ..errors import ConfigurationError, DatabaseError
from .boundary import DRIVER_ERRORS, translate
from .connect import CONNECT_TIMEOUT

# The types a name or a DSN may come as: text, varchar, and `name` (what `pg_database.datname`
# is, for a catalog built from the server's own list of databases).
TEXT_TYPES = frozenset(types[name].oid for name in ("text", "varchar", "name"))
# Ten seconds: a catalog is a table of tenants, read in milliseconds; a query that runs longer
# is wrong, and says so by failing rather than by holding the fleet's rounds. (`SET` takes no
# parameter, so the value is in the text.)
LIMIT_STATEMENT = "SET LOCAL statement_timeout = '10s'"

Row = tuple[str | None, str | None]


def check_dsn(dsn: str) -> str | None:
    """Why libpq cannot parse `dsn` (one line, every fragment of its secret masked, since
    libpq quotes what it failed to parse), or None when it can."""
    try:
        conninfo_to_dict(dsn)
    except psycopg.Error as exc:
        lines = str(exc).strip().splitlines()
        return scrub(lines[0] if lines else type(exc).__name__, dsn)
    return None


async def read_catalog(dsn: str, query: str) -> list[Row]:
    """The rows `(name, dsn)` of `query` run on the database of `dsn`, as they are: a NULL in
    either column is the caller's to report, since only the caller knows what a row is for.

    `ConfigurationError` when the query does not return exactly two text columns (it cannot
    be a catalog whatever its rows). Database errors leave as the storage layer's, their
    messages with the secret of `dsn` masked: `ConnectionLost` when the home database cannot
    be reached (the caller keeps what it read last), another `DatabaseError` when the server
    refused the query (a syntax error, a write, the statement timeout).
    """
    try:
        async with await psycopg.AsyncConnection.connect(
            dsn, connect_timeout=CONNECT_TIMEOUT, autocommit=True
        ) as conn:
            await conn.set_read_only(True)
            async with conn.transaction():
                await conn.execute(LIMIT_STATEMENT)
                cursor = await conn.execute(sql.SQL(query))
                _check_shape(cursor.description)
                rows = await cursor.fetchall()
    except DRIVER_ERRORS as exc:
        raise _masked(translate(exc, doing=f"catalog query on {redact(dsn)}"), dsn) from exc
    return [(name, target) for name, target in rows]


def _check_shape(columns: list[psycopg.Column] | None) -> None:
    """Refuse a result that is not `name, dsn` text columns, saying what it is instead."""
    if columns is None:
        found = "no result (it is not a SELECT)"
    elif len(columns) == 2 and all(column.type_code in TEXT_TYPES for column in columns):
        return
    else:
        found = ", ".join(f"{c.name} {_type_name(c.type_code)}" for c in columns)
    raise ConfigurationError(
        f"the catalog query must return two text columns, name and dsn (cast with ::text); "
        f"it returns {found}"
    )


def _type_name(oid: int) -> str:
    info = types.get(oid)
    return info.name if info is not None else f"type {oid}"


def _masked(error: DatabaseError, dsn: str) -> DatabaseError:
    """`error` (its class and SQLSTATE kept) with the secret of `dsn` masked in its message:
    libpq's text of a failed connection may quote the DSN."""
    error.args = (scrub(str(error), dsn),)
    return error
