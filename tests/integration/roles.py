"""A connection acting as a throw-away role with only some privileges, for the tests of what
the farm and the operator tools say when a privilege is missing."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import psycopg
from psycopg import sql


@contextmanager
def acting_as(conn: psycopg.Connection[Any], prefix: str, *grants: str) -> Iterator[str]:
    """Create a role named `prefix_<random>`, run each of `grants` (SQL with one `{}` for the
    role), and make `conn` act as it until the block ends; then drop it and all it owns."""
    role = f"{prefix}_{uuid.uuid4().hex[:8]}"
    ident = sql.Identifier(role)
    conn.execute(sql.SQL("CREATE ROLE {}").format(ident))
    for grant in grants:
        conn.execute(sql.SQL(grant).format(ident))
    conn.execute(sql.SQL("SET ROLE {}").format(ident))
    try:
        yield role
    finally:
        conn.execute("RESET ROLE")
        conn.execute(sql.SQL("DROP OWNED BY {}").format(ident))
        conn.execute(sql.SQL("DROP ROLE {}").format(ident))
