"""Whether a database is ready for the farm: what `check` reports, and what `start` refuses
to begin without.

`check` is for an operator between `migrate` and a deploy: every schema difference and
missing privilege at once. `start` looks once, more cheaply, for what would make its workers
fail in a loop (a missing table, a missing privilege) and stops with the reason instead.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import psycopg

from .errors import DatabaseError, OutboxFarmError, SchemaError
from .migrate import migrate
from .names import TableNames
from .privileges import check_privileges
from .queries import load_blocks
from .schema_check import check_schema


@dataclass(frozen=True)
class SchemaReport:
    problems: list[str]  # schema drift and missing privileges, each saying what to run
    notes: list[str]  # fine, but worth knowing


def schema_report(conn: psycopg.Connection[Any], names: TableNames) -> SchemaReport:
    """The live schema and this role's privileges against what the farm needs."""
    access = check_privileges(conn, names)
    problems: list[str] = []
    if not access.schema_usage_missing:  # else the catalog lookups are refused
        dlq = str(names.dlq) if names.dlq else None
        problems += [str(problem) for problem in check_schema(conn, str(names.outbox), dlq)]
    return SchemaReport(problems + access.problems, access.notes)


def check_ready(
    conn: psycopg.Connection[Any], names: TableNames, apply: bool, log: logging.Logger
) -> None:
    """Migrate if `apply`, then refuse (OutboxFarmError) when the tables are missing or the
    role lacks privileges the workers need; the privilege notes are logged."""
    try:
        if apply:
            result = migrate(conn, names)
            log.info(
                "migrate: %d applied",
                len(result.applied),
                extra={"event": "migrated", "applied": result.applied},
            )
        access = check_privileges(conn, names)
        missing = [] if access.schema_usage_missing else _missing_tables(conn, names)
    except OutboxFarmError:
        raise  # already says what to do (and a DatabaseError is a psycopg.Error too)
    except psycopg.Error as exc:
        raise DatabaseError(f"start-up check failed: {exc}") from None
    if missing:
        raise SchemaError(
            f"table(s) {', '.join(missing)} do not exist: run `outbox-farm migrate` first"
        )
    if access.problems:
        raise OutboxFarmError(
            "the database role lacks privileges the farm needs:\n  - "
            + "\n  - ".join(access.problems)
        )
    for note in access.notes:
        log.warning(note, extra={"event": "privileges_note"})


def _missing_tables(conn: psycopg.Connection[Any], names: TableNames) -> list[str]:
    return [
        str(table)
        for table in (names.outbox, names.dlq)
        if table
        and conn.execute(
            load_blocks()["table_oid"], {"table": table.identifier().as_string(conn)}
        ).fetchone()
        == (None,)
    ]
