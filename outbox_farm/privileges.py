"""Whether the database role may do what the farm does, checked before it runs.

Without this a role lacking privileges passes `check` ("schema OK") and `start`'s start-up
check, and then every worker retries "permission denied" forever. Each missing privilege is
reported with the exact GRANT an owner runs to fix it. Only VACUUM is optional: the farm's own
VACUUM needs ownership (or MAINTAIN on PostgreSQL 17+); without it the farm leaves the table to
autovacuum, which is a note, not a problem.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import psycopg
from psycopg import sql

from .errors import DatabaseError
from .names import QualifiedName, TableNames
from .queries import load_blocks

# What the farm and its producers do: claim (SELECT, UPDATE), ack (DELETE), publish (INSERT).
OUTBOX_NEEDS = ("SELECT", "INSERT", "UPDATE", "DELETE")
# The DLQ move INSERTs ... RETURNING, and the gauges count rows: both need SELECT.
DLQ_NEEDS = ("SELECT", "INSERT")


@dataclass
class PrivilegeReport:
    problems: list[str] = field(default_factory=list)  # each ends with the GRANT to run
    notes: list[str] = field(default_factory=list)  # fine, but worth knowing

    @property
    def schema_usage_missing(self) -> bool:
        """True when a table's schema cannot be used at all (nothing else can be looked at)."""
        return any("USAGE on schema" in problem for problem in self.problems)


def _grant(conn: psycopg.Connection[Any], block: str, **parts: sql.Composable) -> str:
    """A GRANT block as the one line an operator copies: its comment lines left out."""
    lines = [line for line in load_blocks()[block].splitlines() if not line.startswith("--")]
    return sql.SQL(" ".join(lines)).format(**parts).as_string(conn)


def _check_table(
    conn: psycopg.Connection[Any],
    table: QualifiedName,
    needs: tuple[str, ...],
    vacuum: bool,
    report: PrivilegeReport,
) -> None:
    row = conn.execute(
        load_blocks()["table_privileges"], {"schema": table.schema, "name": table.name}
    ).fetchone()
    if row is None:
        return  # missing table: the schema check says so, with what to run
    role, schema, usage, select, insert, update, delete, maintain, seq_schema, seq, seq_ok = row
    who = sql.Identifier(role)
    if not usage:
        grant = _grant(conn, "grant_schema", schema=sql.Identifier(schema), role=who)
        report.problems.append(f"{table}: role {role} lacks USAGE on schema {schema}; run {grant}")
    held = {"SELECT": select, "INSERT": insert, "UPDATE": update, "DELETE": delete}
    lacking = [privilege for privilege in needs if not held[privilege]]
    if lacking:
        grant = _grant(
            conn,
            "grant_table",
            privileges=sql.SQL(", ").join(sql.SQL(p) for p in lacking),
            table=table.identifier(),
            role=who,
        )
        report.problems.append(
            f"{table}: role {role} lacks {', '.join(lacking)} on the table; run {grant}"
        )
    if "INSERT" in needs and not seq_ok:
        grant = _grant(conn, "grant_sequence", sequence=sql.Identifier(seq_schema, seq), role=who)
        report.problems.append(
            f"{table}: role {role} lacks USAGE on the id sequence {seq_schema}.{seq}, which "
            f"every INSERT needs; run {grant}"
        )
    if vacuum and not maintain:
        report.notes.append(
            f"{table}: role {role} neither owns the table nor holds MAINTAIN on it (PostgreSQL "
            "17+), so the farm's own VACUUM will be skipped and the table left to autovacuum "
            "(see --vacuum-interval)"
        )


def check_privileges(conn: psycopg.Connection[Any], names: TableNames) -> PrivilegeReport:
    """Every privilege the current role lacks for the farm's tables, with the GRANT to run."""
    report = PrivilegeReport()
    try:
        _check_table(conn, names.outbox, OUTBOX_NEEDS, True, report)
        if names.dlq is not None:
            _check_table(conn, names.dlq, DLQ_NEEDS, False, report)
    except psycopg.Error as exc:
        raise DatabaseError(f"privilege check failed: {exc}") from exc
    return report
