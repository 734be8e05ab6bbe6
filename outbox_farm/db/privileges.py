"""What the current role may do with one of the farm's tables, read from the catalogs, and the
GRANT statements an owner runs to give what is missing (printed, never run by the farm).

The GRANTs are rendered here because they are SQL: identifiers are quoted by
`psycopg.sql.Identifier`, never pasted into the text.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import psycopg
from psycopg import sql

from ..names import QualifiedName
from ..queries import load_blocks
from .boundary import translate
from .connect import Connection


@dataclass(frozen=True)
class TableAccess:
    """The current role's standing on one table, its schema and its id sequence.

    `maintain`: owns the table, or holds MAINTAIN (PostgreSQL 17+), as VACUUM needs.
    `sequence` is None when the id column has no sequence of its own; `sequence_usage` is
    then True.
    """

    role: str
    schema: str
    schema_usage: bool
    select: bool
    insert: bool
    update: bool
    delete: bool
    maintain: bool
    sequence: QualifiedName | None
    sequence_usage: bool


def table_access(conn: Connection, table: QualifiedName) -> TableAccess | None:
    """The role's privileges on `table`; None when there is no such table."""
    try:
        row = conn.execute(
            load_blocks()["table_privileges"], {"schema": table.schema, "name": table.name}
        ).fetchone()
    except psycopg.Error as exc:
        raise translate(exc, doing="privilege check failed") from exc
    if row is None:
        return None
    role, schema, usage, select, insert, update, delete, maintain, seq_schema, seq, seq_ok = row
    sequence = QualifiedName(seq_schema, seq) if seq is not None else None
    return TableAccess(
        role, schema, usage, select, insert, update, delete, maintain, sequence, seq_ok
    )


def _grant(block: str, **parts: sql.Composable) -> str:
    """A GRANT block as the one line an operator copies: its comment lines left out."""
    lines = [line for line in load_blocks()[block].splitlines() if not line.startswith("--")]
    return sql.SQL(" ".join(lines)).format(**parts).as_string(None)


def grant_schema(schema: str, role: str) -> str:
    return _grant("grant_schema", schema=sql.Identifier(schema), role=sql.Identifier(role))


def grant_table(privileges: Sequence[str], table: QualifiedName, role: str) -> str:
    """`privileges` are keywords (SELECT, INSERT, ...) of the caller's own list, not input."""
    return _grant(
        "grant_table",
        privileges=sql.SQL(", ").join(sql.SQL(p) for p in privileges),
        table=table.identifier(),
        role=sql.Identifier(role),
    )


def grant_sequence(sequence: QualifiedName, role: str) -> str:
    return _grant("grant_sequence", sequence=sequence.identifier(), role=sql.Identifier(role))
