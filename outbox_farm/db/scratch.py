"""Throw-away databases for tests and benchmarks, and what a test's drain reads and moves.

Nothing here runs in a farm: these are the statements of `outbox_farm.testing` (the pytest
plugin's per-test databases, `drain`'s clock) and of our own test and benchmark harnesses.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import NamedTuple

import psycopg
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from ..queries import Queries, load_blocks
from .connect import AsyncConnection, Connection, connect


def with_dbname(dsn: str, name: str) -> str:
    """`dsn` with its database replaced by `name`."""
    params = conninfo_to_dict(dsn)
    params["dbname"] = name
    return make_conninfo(**params)  # type: ignore[arg-type]


def _run(admin: str, block: str, **names: str) -> None:
    statement = sql.SQL(load_blocks()[block]).format(
        **{key: sql.Identifier(value) for key, value in names.items()}
    )
    with connect(admin, autocommit=True) as conn:
        conn.execute(statement)


def create_database(admin: str, name: str, template: str | None = None) -> str:
    """Create database `name` on `admin`'s server (a copy of `template` if given); its DSN."""
    if template is None:
        _run(admin, "create_database", database=name)
    else:
        _run(admin, "create_database_from", database=name, template=template)
    return with_dbname(admin, name)


def drop_database(admin: str, name: str) -> None:
    _run(admin, "drop_database", database=name)


@contextmanager
def scratch_database(
    admin: str,
    prefix: str,
    *,
    template: str | None = None,
    prepare: Callable[[Connection], None] | None = None,
    keep: bool = False,
) -> Iterator[str]:
    """A new database `<prefix><random>` beside `admin`'s (a copy of `template` if given;
    `prepare`d, say migrated), dropped on the way out unless `keep`, whatever happened."""
    name = f"{prefix}{uuid.uuid4().hex[:10]}"
    dsn = create_database(admin, name, template)
    try:
        if prepare is not None:
            with connect(dsn) as conn:
                prepare(conn)
        yield dsn
    finally:
        if not keep:
            drop_database(admin, name)


class DrainState(NamedTuple):
    """`held`: rows of the queues someone holds. `next_in`: seconds until the next claimable
    row is due (<= 0: one is due now; None: none waits). `rows`: all rows of the queues."""

    held: int
    next_in: float | None
    rows: int


async def watch(dsn: str) -> AsyncConnection:
    """An autocommit connection for a drain's reads and clock moves; the caller closes it."""
    return await psycopg.AsyncConnection.connect(dsn, autocommit=True, connect_timeout=10)


async def drain_state(conn: AsyncConnection, queries: Queries, queues: Sequence[str]) -> DrainState:
    cursor = await conn.execute(queries["testing_drain_state"], {"queues": list(queues)})
    held, next_in, rows = await cursor.fetchone() or (0, None, 0)
    return DrainState(held, next_in, rows)


async def advance(
    conn: AsyncConnection, queries: Queries, queues: Sequence[str], seconds: float
) -> None:
    await conn.execute(
        queries["testing_advance"], {"queues": list(queues), "seconds": float(seconds)}
    )
