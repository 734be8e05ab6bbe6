"""Whether a database is ready for the farm: what `check` reports, and what `start` refuses
to begin without.

`check` is for an operator between `migrate` and a deploy: every schema difference and
missing privilege at once. `start` looks once, more cheaply, for what would make its workers
fail in a loop (a missing table, a column of a migration this release needs and the schema has
not had, a missing privilege) and stops with the reason, in one line, instead.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from ..db.connect import Connection, connect
from ..db.schema import missing_tables
from ..errors import DatabaseError, OutboxFarmError, SchemaError
from ..names import TableNames
from .migrate import migrate
from .privileges import check_privileges
from .schema_check import assess_schema, missing_columns


@dataclass(frozen=True)
class SchemaReport:
    problems: list[str]  # schema drift and missing privileges, each saying what to run
    notes: list[str]  # fine, but worth knowing


def schema_report(conn: Connection, names: TableNames) -> SchemaReport:
    """The live schema and this role's privileges against what the farm needs."""
    access = check_privileges(conn, names)
    problems: list[str] = []
    notes: list[str] = []
    if not access.schema_usage_missing:  # else the catalog lookups are refused
        found = assess_schema(conn, names)
        problems += [str(problem) for problem in found.problems]
        notes += found.notes
    return SchemaReport(problems + access.problems, notes + access.notes)


def _refuse_older(absent: list[str]) -> None:
    if absent:
        raise SchemaError(
            f"the schema is older than this release (no column {', '.join(absent)}): "
            "run `outbox-farm migrate` first, or start with --migrate"
        )


def refuse_older_schema(dsn: str, names: TableNames) -> None:
    """SchemaError when the tables lack a column this release needs: what `start` refuses,
    for a runtime embedded in an application (`Farm.running`), which has no `start` to look
    first and would otherwise run into failing claims. A server it cannot reach or a catalog
    it cannot read is left to the runtime, which says what is wrong in its own way."""
    try:
        with connect(dsn, autocommit=True) as conn:
            absent = missing_columns(conn, names)
    except DatabaseError:
        return
    _refuse_older(absent)


def check_ready(conn: Connection, names: TableNames, apply: bool, log: logging.Logger) -> None:
    """Migrate if `apply`, then refuse (OutboxFarmError) when the tables are missing, lack a
    column this release needs (an older schema), or the role lacks privileges the workers
    need; the privilege notes are logged. A schema newer than this release is fine."""
    if apply:
        result = migrate(conn, names)
        log.info(
            "migrate: %d applied",
            len(result.applied),
            extra={"event": "migrated", "applied": result.applied},
        )
    access = check_privileges(conn, names)
    missing = [] if access.schema_usage_missing else [str(t) for t in missing_tables(conn, names)]
    if missing:
        raise SchemaError(
            f"table(s) {', '.join(missing)} do not exist: run `outbox-farm migrate` first"
        )
    if not access.schema_usage_missing:
        _refuse_older(missing_columns(conn, names))
    if access.problems:
        raise OutboxFarmError(
            "the database role lacks privileges the farm needs:\n  - "
            + "\n  - ".join(access.problems)
        )
    for note in access.notes:
        log.warning(note, extra={"event": "privileges_note"})
