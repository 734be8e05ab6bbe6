"""Whether the database role may do what the farm does, checked before it runs.

Without this a role lacking privileges passes `check` ("schema OK") and `start`'s start-up
check, and then every worker retries "permission denied" forever. Each missing privilege is
reported with the exact GRANT an owner runs to fix it. Only VACUUM is optional: the farm's own
VACUUM needs ownership (or MAINTAIN on PostgreSQL 17+); without it the farm leaves the table to
autovacuum, which is a note, not a problem.

A granted privilege is not yet a write that passes: a role or database whose transactions are
read-only, a standby server, row security or a trigger refuse writes the catalogs allow. So once
the catalogs show every privilege, the farm's writes are tried in a transaction that is rolled
back (`try_writes`), and each refusal is a problem of its own, saying what was refused and why.
A try that could not run (a migration holds the table locked, a timeout, a deadlock) is a note:
it says nothing of the role, and `start` must not refuse to begin beside a migration.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..db.connect import Connection
from ..db.privileges import (
    READ_ONLY,
    FailedTry,
    grant_schema,
    grant_sequence,
    grant_table,
    role_read_write,
    table_access,
    try_writes,
)
from ..names import QualifiedName, TableNames

# What the farm and its producers do: claim (SELECT, UPDATE), ack (DELETE), publish (INSERT).
OUTBOX_NEEDS = ("SELECT", "INSERT", "UPDATE", "DELETE")
# The DLQ move INSERTs ... RETURNING, and the gauges count rows: both need SELECT.
DLQ_NEEDS = ("SELECT", "INSERT")
# Each process renews its report (upsert), any process deletes expired ones, the housekeeper reads.
CODE_TABLE = QualifiedName(None, "outbox_farm_code")
CODE_NEEDS = ("SELECT", "INSERT", "UPDATE", "DELETE")


@dataclass
class PrivilegeReport:
    problems: list[str] = field(default_factory=list)  # each ends with the GRANT to run
    notes: list[str] = field(default_factory=list)  # fine, but worth knowing

    @property
    def schema_usage_missing(self) -> bool:
        """True when a table's schema cannot be used at all (nothing else can be looked at)."""
        return any("USAGE on schema" in problem for problem in self.problems)


def _check_table(
    conn: Connection,
    table: QualifiedName,
    needs: tuple[str, ...],
    vacuum: bool,
    report: PrivilegeReport,
) -> str | None:
    """The role's name, once `table` was found (None: no such table)."""
    access = table_access(conn, table)
    if access is None:
        return None  # missing table: the schema check says so, with what to run
    role = access.role
    if not access.schema_usage:
        grant = grant_schema(access.schema, role)
        report.problems.append(
            f"{table}: role {role} lacks USAGE on schema {access.schema}; run {grant}"
        )
    held = {
        "SELECT": access.select,
        "INSERT": access.insert,
        "UPDATE": access.update,
        "DELETE": access.delete,
    }
    lacking = [privilege for privilege in needs if not held[privilege]]
    if lacking:
        grant = grant_table(lacking, table, role)
        report.problems.append(
            f"{table}: role {role} lacks {', '.join(lacking)} on the table; run {grant}"
        )
    if "INSERT" in needs and access.sequence is not None and not access.sequence_usage:
        grant = grant_sequence(access.sequence, role)
        report.problems.append(
            f"{table}: role {role} lacks USAGE on the id sequence {access.sequence}, which "
            f"every INSERT needs; run {grant}"
        )
    if vacuum and not access.maintain:
        report.notes.append(
            f"{table}: role {role} neither owns the table nor holds MAINTAIN on it (PostgreSQL "
            "17+), so the farm's own VACUUM will be skipped and the table left to autovacuum "
            "(see --vacuum-interval)"
        )
    return role


def _refused(refusal: FailedTry, role: str) -> str:
    if refusal.sqlstate == READ_ONLY:
        return (
            f"the transactions of role {role} are read-only ({refusal.reason}): the farm could "
            "claim rows but never ack, retry or dead-letter them. Connect to the primary "
            f"server, and run {role_read_write(role)} (or ALTER DATABASE for the database's "
            "setting)"
        )
    return (
        f"{refusal.write} was refused although the privileges are granted ({refusal.reason}): "
        "look for row security policies or triggers on the table, and for what they need"
    )


def check_privileges(conn: Connection, names: TableNames) -> PrivilegeReport:
    """Every privilege the current role lacks for the farm's tables, with the GRANT to run.

    A failing catalog read is a `DatabaseError`.
    """
    report = PrivilegeReport()
    role = _check_table(conn, names.outbox, OUTBOX_NEEDS, True, report)
    dlq_found = names.dlq is not None and _check_table(conn, names.dlq, DLQ_NEEDS, False, report)
    if role is not None and not report.problems:
        for failed in try_writes(conn, names, bool(dlq_found)):
            if failed.blocked is None:
                report.problems.append(_refused(failed, role))
            else:
                report.notes.append(
                    f"{failed.write} could not be tried: {failed.blocked} ({failed.reason}); "
                    "not counted as refused: run `outbox-farm check` again later to try it again"
                )
    # Optional: without it the farms cannot compare their code, and run on (`chores.farm_code`).
    code = PrivilegeReport()
    if _check_table(conn, CODE_TABLE, CODE_NEEDS, False, code) is None:
        code.problems.append(
            f"{CODE_TABLE} does not exist; run `outbox-farm migrate` (with --repair if its "
            "migration, 0010, was applied and the table dropped since)"
        )
    report.notes += [
        f"the farms cannot tell when they run different code: {problem}"
        for problem in code.problems
    ]
    return report
