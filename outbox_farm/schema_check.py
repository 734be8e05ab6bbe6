"""Compare the live database with the schema the farm needs, and report every difference.

Never run implicitly: a running migration and an always-on check would race, and operators
must be able to roll a schema forward without sending every worker into a crash loop. Run it
between `migrate` and deploy (`outbox-farm check`), or from a health probe.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import psycopg

from .errors import DatabaseError
from .names import QualifiedName, TableNames
from .queries import load_blocks

TSTZ = "timestamp with time zone"
VARCHAR = "character varying(255)"

# column -> (type, NOT NULL, must have a default)
OUTBOX_COLUMNS: dict[str, tuple[str, bool, bool]] = {
    "id": ("bigint", True, True),
    "queue": (VARCHAR, True, False),
    "payload": ("bytea", True, False),
    "headers": ("jsonb", False, False),
    "attempts_count": ("bigint", True, True),
    "deliveries_count": ("bigint", True, True),
    "created_at": (TSTZ, True, True),
    "next_attempt_at": (TSTZ, True, True),
    "first_attempt_at": (TSTZ, False, False),
    "last_attempt_at": (TSTZ, False, False),
    "acquired_at": (TSTZ, False, False),
    "acquired_token": ("uuid", False, False),
    "lease_expires_at": (TSTZ, False, False),
    "timer_id": (VARCHAR, False, False),
}

DLQ_COLUMNS: dict[str, tuple[str, bool, bool]] = {
    "id": ("bigint", True, True),
    "original_id": ("bigint", True, False),
    "queue": (VARCHAR, True, False),
    "payload": ("bytea", True, False),
    "headers": ("jsonb", False, False),
    "deliveries_count": ("bigint", True, False),
    "created_at": (TSTZ, True, False),
    "failed_at": (TSTZ, True, True),
    "failure_reason": ("character varying(64)", True, False),
    "last_exception": ("text", False, False),
    "timer_id": (VARCHAR, False, False),
}


@dataclass(frozen=True)
class ExpectedIndex:
    role: str
    columns: tuple[str, ...]
    unique: bool
    predicate: str | None  # as pg_get_expr renders it, after normalising


OUTBOX_INDEXES = (
    ExpectedIndex("pending index", ("queue", "next_attempt_at"), False, "acquired_token IS NULL"),
    ExpectedIndex(
        "lease index", ("queue", "lease_expires_at"), False, "acquired_token IS NOT NULL"
    ),
    ExpectedIndex("timer index", ("queue", "timer_id"), True, "timer_id IS NOT NULL"),
)
DLQ_INDEXES = (ExpectedIndex("failure index", ("queue", "failed_at"), False, None),)
FIX_HINT = (
    "run `outbox-farm migrate`, or for a drifted index or CHECK drop it and recreate it as "
    "`outbox-farm sql` prints it"
)


@dataclass(frozen=True)
class Problem:
    table: str
    message: str

    def __str__(self) -> str:
        return f"{self.table}: {self.message}"


def _normalise(expr: str | None) -> str | None:
    if expr is None:
        return None
    return re.sub(r"[()\s]+", " ", expr).strip().lower()


def _lease_check_ok(definition: str) -> bool:
    flat = _normalise(definition) or ""
    return flat in {
        "check acquired_token is null = acquired_at is null",
        "check acquired_at is null = acquired_token is null",
    }


def _check_columns(
    label: str, live: dict[str, tuple[str, bool, bool]], columns: dict[str, tuple[str, bool, bool]]
) -> list[Problem]:
    problems: list[Problem] = []
    for name, (typ, notnull, needs_default) in columns.items():
        if name not in live:
            problems.append(Problem(label, f"column {name} is missing (expected {typ})"))
            continue
        live_type, live_notnull, live_default = live[name]
        if live_type != typ:
            problems.append(Problem(label, f"column {name} is {live_type}, expected {typ}"))
        if live_notnull != notnull:
            expected = "NOT NULL" if notnull else "nullable"
            problems.append(Problem(label, f"column {name} should be {expected}"))
        if needs_default and not live_default:
            problems.append(Problem(label, f"column {name} has lost its default"))
    return problems


def _check_index(label: str, want: ExpectedIndex, live_indexes: list[Any]) -> Problem | None:
    candidates = [
        (index_name, unique, _normalise(pred))
        for index_name, index_cols, unique, _, pred in live_indexes
        if tuple(index_cols) == want.columns
    ]
    wanted_pred = _normalise(want.predicate)
    if any(u == want.unique and p == wanted_pred for _, u, p in candidates):
        return None
    cols = ", ".join(want.columns)
    if not candidates:
        return Problem(label, f"{want.role} on ({cols}) is missing; {FIX_HINT}")
    index_name, _, pred = candidates[0]
    if pred == wanted_pred:
        issue = "must be UNIQUE" if want.unique else "must not be UNIQUE"
    elif pred is None:
        issue = f"is not partial (expected WHERE {want.predicate})"
    elif wanted_pred is None:
        issue = f"is partial (WHERE {pred}) but must cover every row"
    else:
        issue = f"has predicate WHERE {pred}, expected WHERE {want.predicate}"
    return Problem(label, f"{want.role} {index_name} on ({cols}) {issue}; {FIX_HINT}")


def _check_table(
    conn: psycopg.Connection[Any],
    table: QualifiedName,
    columns: dict[str, tuple[str, bool, bool]],
    indexes: tuple[ExpectedIndex, ...],
    lease_check: bool,
) -> list[Problem]:
    sql_ = load_blocks()
    label = str(table)
    quoted = table.identifier().as_string(conn)
    row = conn.execute(sql_["table_oid"], {"table": quoted}).fetchone()
    oid = row[0] if row else None
    if oid is None:
        return [Problem(label, "table does not exist; run `outbox-farm migrate`")]

    rows: list[Any] = conn.execute(sql_["columns"], {"oid": oid}).fetchall()
    problems = _check_columns(label, {r[0]: (r[1], r[2], r[3]) for r in rows}, columns)

    live_indexes: list[Any] = conn.execute(sql_["indexes"], {"oid": oid}).fetchall()
    if not any(primary and cols == ["id"] for _, cols, _, primary, _ in live_indexes):
        problems.append(Problem(label, "primary key on id is missing"))
    problems += [p for want in indexes if (p := _check_index(label, want, live_indexes))]

    if lease_check:
        checks: list[Any] = conn.execute(sql_["checks"], {"oid": oid}).fetchall()
        if not any(_lease_check_ok(definition) for _, definition in checks):
            problems.append(
                Problem(
                    label,
                    "lease CHECK ((acquired_token IS NULL) = (acquired_at IS NULL)) is missing "
                    f"or wrong; {FIX_HINT}",
                )
            )
    return problems


def check_schema(
    conn: psycopg.Connection[Any], table: str = "outbox", dlq_table: str | None = None
) -> list[Problem]:
    """Every difference between the live schema and what the farm needs; empty when fine.

    Extra user columns and indexes are allowed. Index and CHECK names do not matter: they are
    matched by columns and predicate, so schemas made by Alembic or Django pass too.
    """
    names = TableNames.build(table, dlq_table)
    try:
        problems = _check_table(conn, names.outbox, OUTBOX_COLUMNS, OUTBOX_INDEXES, True)
        if names.dlq is not None:
            problems += _check_table(conn, names.dlq, DLQ_COLUMNS, DLQ_INDEXES, False)
    except psycopg.Error as exc:
        raise DatabaseError(f"schema check failed: {exc}") from exc
    return problems
