"""What the current role may do with one of the farm's tables, read from the catalogs and tried
in transactions that are rolled back; the GRANT statements an owner runs to give what is missing
(printed, never run by the farm).

The GRANTs are rendered here because they are SQL: identifiers are quoted by
`psycopg.sql.Identifier`, never pasted into the text.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import psycopg
from psycopg import sql

from ..names import QualifiedName, TableNames
from ..queries import Queries, load_blocks
from .boundary import INSUFFICIENT_PRIVILEGE, translate
from .connect import Connection

READ_ONLY = "25006"  # read_only_sql_transaction
# How long a tried write waits for a table's lock: a migration, or a manual LOCK, holding one
# must not hang `check` or `start`.
LOCK_WAIT = "5s"


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
class FailedTry:
    """A write the farm does that failed when it was tried.

    `blocked` is None when the database refuses the write to this role, as it would refuse the
    farm's own: a missing privilege, a read-only transaction, row security, a trigger. Otherwise
    the try proved nothing either way, and `blocked` says what kept it from running (a lock, a
    timeout, a deadlock, or an error of the trial row itself): the same write may pass later.
    """

    write: str  # as the report names it: "INSERT into outbox"
    reason: str  # the error's first line
    sqlstate: str | None
    blocked: str | None


# Errors of a write that waited on others, not of the write: a migration or a long transaction
# holding the table. Each passes by itself, and says nothing of what the role may do.
_CONTENDED = {
    "55P03": "the table is locked (a migration?)",  # lock_not_available: the lock timeout
    "57014": "it was cancelled, by statement_timeout or an operator",  # query_canceled
    "40P01": "it deadlocked with another transaction",  # deadlock_detected
    "40001": "it conflicted with another transaction",  # serialization_failure
}
# Refused as the farm's own writes would be: a privilege (row security's too), read-only.
_REFUSING = (INSUFFICIENT_PRIVILEGE, READ_ONLY)


def _blocked(exc: psycopg.Error) -> str | None:
    """Why the failed try `exc` says nothing of the farm's writes; None when it is a refusal.

    An error raised inside a function (its `context` names one: a trigger, which runs for the
    farm's rows as for the trial row) refuses, and so does PL/pgSQL's class P0 (RAISE, ASSERT).
    Anything else is the trial row's own: it may break a constraint the farm's rows keep.
    """
    sqlstate = exc.sqlstate or ""
    if sqlstate in _CONTENDED:
        return _CONTENDED[sqlstate]
    if sqlstate in _REFUSING or sqlstate.startswith("P0") or exc.diag.context:
        return None
    return "the trial row failed, not for want of a privilege"


def try_writes(conn: Connection, names: TableNames, dlq: bool) -> list[FailedTry]:
    """Each write the farm does on its tables (the DLQ's too if `dlq`), tried in a transaction
    that is rolled back; the ones that failed. Each runs in a savepoint of its own, so one
    failure does not hide the next. A refusal for a read-only transaction
    (`default_transaction_read_only` of the role or database, a standby server) refuses every
    write alike, and is the only one returned. A table found locked is not tried again: its
    other writes would wait as long (LOCK_WAIT), and are named with the first. The catalogs
    answer whether a privilege is granted; this is what else can refuse a write (read-only
    transactions, row security, a trigger, a missing privilege on what a trigger writes)."""
    queries = Queries(names)
    tries = [
        ("INSERT into", names.outbox, "try_outbox_insert"),
        ("UPDATE of", names.outbox, "try_outbox_update"),
        ("DELETE from", names.outbox, "try_outbox_delete"),
    ]
    if dlq and names.dlq is not None:
        tries.append(("INSERT into", names.dlq, "try_dlq_insert"))
    failed: list[FailedTry] = []
    locked: dict[QualifiedName, int] = {}  # a contended table: the index of its failed try
    row_id = -1  # the inserted row's, once there is one; -1 matches nothing yet checks the same
    try:
        with conn.transaction(force_rollback=True):
            conn.execute(queries["try_writes_begin"], {"lock_wait": LOCK_WAIT})
            for verb, table, block in tries:
                if table in locked:
                    first = failed[locked[table]]
                    failed[locked[table]] = replace(first, write=f"{first.write}, {verb} {table}")
                    continue
                try:
                    with conn.transaction():
                        cursor = conn.execute(queries[block], {"id": row_id})
                        inserted = cursor.fetchone() if cursor.description else None
                except psycopg.Error as exc:
                    error = translate(exc)
                    reason = str(error).splitlines()[0]  # not the trigger's CONTEXT lines
                    blocked = _blocked(exc)
                    failed.append(FailedTry(f"{verb} {table}", reason, error.sqlstate, blocked))
                    if error.sqlstate == READ_ONLY:
                        return failed[-1:]
                    if error.sqlstate in _CONTENDED:
                        locked[table] = len(failed) - 1
                    continue
                if inserted is not None and table == names.outbox:
                    row_id = int(inserted[0])
    except psycopg.Error as exc:
        raise translate(exc, doing="trying the farm's writes failed") from exc
    return failed


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
