"""Connections: the types the layers above name without importing the driver, and the one way
the command line opens a connection of its own.

The producer and the admin API never open connections: they take the caller's (a psycopg 3
`Connection` or `AsyncConnection`), typed with the aliases below, and hand it to the storage
functions that run the statements on it.
"""

from __future__ import annotations

from typing import Any, TypeAlias

import psycopg

from ..dsn import redact, scrub
from ..errors import ConnectionLost
from .boundary import boundary

Connection: TypeAlias = psycopg.Connection[Any]
AsyncConnection: TypeAlias = psycopg.AsyncConnection[Any]

CONNECT_TIMEOUT = 10  # seconds: an unreachable host fails the command, not hangs it


def connect(dsn: str, *, autocommit: bool = False, name: str | None = None) -> Connection:
    """A new connection for one command; the caller closes it.

    A refused or unreachable server is a `ConnectionLost` whose message names the server
    (`name`, else the DSN with its password masked) and says what to check; every fragment of
    the DSN's secret is masked in the whole message, libpq's own text included, since libpq
    quotes what it failed to parse.
    """
    try:
        return psycopg.connect(dsn, connect_timeout=CONNECT_TIMEOUT, autocommit=autocommit)
    except psycopg.Error as exc:
        message = (
            f"cannot connect to {name or redact(dsn)}: {str(exc).strip()}\n"
            "Check --dsn / OUTBOX_FARM_DSN (or the file of --dsn-file) and that the server is "
            "running."
        )
        raise ConnectionLost(scrub(message, dsn)) from exc


def bounded(dsn: str, timeout: float) -> Connection:
    """An autocommit connection whose connect and every statement end after `timeout`
    seconds, for a process that must not hang on a database that does not answer (the
    arbiter's hand-backs); driver errors as they are, for the caller's `boundary`."""
    return psycopg.connect(
        dsn,
        autocommit=True,
        connect_timeout=max(int(timeout), 1),
        options=f"-c statement_timeout={int(timeout * 1000)}",
    )


def limit_statements(conn: Connection, seconds: float) -> None:
    """Make the server end any statement of this session that runs longer than `seconds`
    (SQLSTATE 57014, a `DatabaseError`): a caller that serves people (the console) would
    rather say "narrow the filter" than hold a connection for minutes."""
    with boundary():
        conn.execute(
            "SELECT set_config('statement_timeout', %s, false)",
            [f"{max(1, round(seconds * 1000))}ms"],
        )
