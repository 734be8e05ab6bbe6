"""What the current role may do with one of the farm's tables, read from the catalogs and tried
in transactions that are rolled back; the GRANT statements an owner runs to give what is missing
(printed, never run by the farm); and the runtime's probe of an outcome write it was refused.

The GRANTs are rendered here because they are SQL: identifiers are quoted by
`psycopg.sql.Identifier`, never pasted into the text.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import psycopg
from psycopg import sql

from ..errors import DatabaseError
from ..names import QualifiedName, TableNames
from ..queries import Queries, load_blocks
from .boundary import boundary, translate
from .connect import Connection
from .outcomes import Write
from .pool import Pool

READ_ONLY = "25006"  # read_only_sql_transaction


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


@dataclass(frozen=True)
class Refusal:
    """A write the farm does that the database refused when it was tried."""

    write: str  # as the report names it: "INSERT into outbox"
    reason: str  # the error's first line
    sqlstate: str | None


def try_writes(conn: Connection, names: TableNames, dlq: bool) -> list[Refusal]:
    """Each write the farm does on its tables (the DLQ's too if `dlq`), tried in a transaction
    that is rolled back; the ones refused. Each runs in a savepoint of its own, so one refusal
    does not hide the next; a refusal for a read-only transaction (`default_transaction_read_only`
    of the role or database, a standby server) refuses every write alike, and is the only one
    returned. The catalogs answer whether a privilege is granted; this is what else can refuse a
    write (read-only transactions, row security, a trigger, a missing privilege on what a
    trigger writes)."""
    queries = Queries(names)
    tries = [
        ("INSERT into", names.outbox, "try_outbox_insert"),
        ("UPDATE of", names.outbox, "try_outbox_update"),
        ("DELETE from", names.outbox, "try_outbox_delete"),
    ]
    if dlq and names.dlq is not None:
        tries.append(("INSERT into", names.dlq, "try_dlq_insert"))
    refused: list[Refusal] = []
    row_id = -1  # the inserted row's, once there is one; -1 matches nothing yet checks the same
    try:
        with conn.transaction(force_rollback=True):
            conn.execute(queries["try_writes_begin"])
            for verb, table, block in tries:
                try:
                    with conn.transaction():
                        cursor = conn.execute(queries[block], {"id": row_id})
                        inserted = cursor.fetchone() if cursor.description else None
                except psycopg.Error as exc:
                    error = translate(exc)
                    reason = str(error).splitlines()[0]  # not the trigger's CONTEXT lines
                    refused.append(Refusal(f"{verb} {table}", reason, error.sqlstate))
                    if error.sqlstate == READ_ONLY:
                        return refused[-1:]
                    continue
                if inserted is not None and table == names.outbox:
                    row_id = int(inserted[0])
    except psycopg.Error as exc:
        raise translate(exc, doing="trying the farm's writes failed") from exc
    return refused


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


def role_read_write(role: str) -> str:
    return _grant("role_read_write", role=sql.Identifier(role))


def grant_sequence(sequence: QualifiedName, role: str) -> str:
    return _grant("grant_sequence", sequence=sequence.identifier(), role=sql.Identifier(role))


async def refusal(pool: Pool, queries: Queries, write: Write) -> DatabaseError | None:
    """The error the database gives `write`, an outcome write over no rows; None when it runs.

    Over no rows it changes nothing and locks nothing, yet the server checks the privileges of
    every table it names and refuses it in a read-only transaction, as for any row: the probe
    that tells a queue paused for a refused write when to resume.
    """
    try:
        with boundary():
            async with pool.connection() as conn:
                await conn.execute(queries[write.statement], write.params())
    except DatabaseError as exc:
        return exc
    return None
