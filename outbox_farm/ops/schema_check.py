"""Compare the live database with the schema the farm needs, and report every difference.

Never run implicitly: a running migration and an always-on check would race, and operators
must be able to roll a schema forward without sending every worker into a crash loop. Run it
between `migrate` and deploy (`outbox-farm check`), or from a health probe.

A schema that a newer release migrated is fine (each migration is one the release before it
keeps working with): when `outbox_farm_migrations` holds a version this release does not ship,
an index or CHECK shaped otherwise than this release expects is a note, never advice to
recreate it the old way. A missing table or column is still a problem.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from ..db.connect import Connection
from ..db.schema import LiveColumn, LiveIndex, read_causes, read_table, recorded_migrations
from ..names import QualifiedName, TableNames
from .migrate import load_migrations

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
    "ordering_key": (VARCHAR, False, False),
    "key_blocked": ("boolean", True, True),
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
    ExpectedIndex(
        "pending index",
        ("queue", "next_attempt_at"),
        False,
        "acquired_token IS NULL AND NOT key_blocked",
    ),
    ExpectedIndex(
        "lease index", ("queue", "lease_expires_at"), False, "acquired_token IS NOT NULL"
    ),
    ExpectedIndex("timer index", ("queue", "timer_id"), True, "timer_id IS NOT NULL"),
    ExpectedIndex(
        "ordering index", ("queue", "ordering_key", "id"), False, "ordering_key IS NOT NULL"
    ),
    ExpectedIndex(
        "blocked rows index (migration 0008)", ("queue", "ordering_key", "id"), False, "key_blocked"
    ),
)
DLQ_INDEXES = (
    ExpectedIndex("failure index", ("queue", "failed_at"), False, None),
    ExpectedIndex("reason index (migration 0007)", ("failure_reason", "id"), False, None),
    ExpectedIndex(
        "queue and reason index (migration 0007)", ("queue", "failure_reason", "id"), False, None
    ),
)
# The statement-level triggers of migration 0009 that keep the DLQ's counts by cause.
CAUSE_TRIGGERS = tuple(
    f"outbox_farm_causes_{op}" for op in ("delete", "insert", "truncate", "update")
)
CAUSES_VERSION = 9
# The operator's controls of each queue, one table for every outbox of the database (migration
# 0011; its limits' columns, 0012): column -> (type, NOT NULL, must have a default).
CONTROLS_TABLE = QualifiedName(None, "outbox_farm_queues")
CONTROL_COLUMNS: dict[str, tuple[str, bool, bool]] = {
    "target": ("text", True, False),
    "queue": (VARCHAR, True, False),
    "paused": ("boolean", True, True),
    "paused_until": (TSTZ, False, False),
    "reason": ("text", False, False),
    "changed_by": ("text", False, False),
    "changed_at": (TSTZ, True, True),
}
LIMIT_COLUMNS: dict[str, tuple[str, bool, bool]] = {
    "rate_count": ("integer", False, False),
    "rate_seconds": ("double precision", False, False),
    "max_running": ("integer", False, False),
    "tokens": ("double precision", False, False),
    "tokens_at": (TSTZ, False, False),
}
# The queue's breaker, kept by the farms in the same row (migration 0012, with the limits).
BREAKER_COLUMNS: dict[str, tuple[str, bool, bool]] = {
    "breaker_failures": ("integer", True, True),
    "breaker_open_since": (TSTZ, False, False),
    "breaker_probe_at": (TSTZ, False, False),
    "breaker_reason": ("text", False, False),
}
CONTROLS_VERSION, LIMITS_VERSION = 11, 12
# The per-key running limit (migration 0014, fair keys), in the same row as the other limits.
KEY_LIMIT_COLUMNS: dict[str, tuple[str, bool, bool]] = {
    "key_max_running": ("integer", False, False)
}
FAIR_KEYS_VERSION = 14
# A fleet's leases (migration 0015), in its home database; a farm that is not a fleet never
# reads them.
FLEET_VERSION = 15
FLEET_TABLES: dict[QualifiedName, dict[str, tuple[str, bool, bool]]] = {
    QualifiedName(None, "outbox_farm_fleet_members"): {
        "fleet": ("text", True, False),
        "member": ("text", True, False),
        "host": ("text", True, False),
        "pid": ("integer", True, False),
        "started_at": (TSTZ, True, True),
        "expires_at": (TSTZ, True, False),
    },
    QualifiedName(None, "outbox_farm_fleet_leases"): {
        "fleet": ("text", True, False),
        "database": ("text", True, False),
        "holder": ("text", True, False),
        "taken_at": (TSTZ, True, True),
        "expires_at": (TSTZ, True, False),
    },
}
# Priorities (migration 0013): a column of the outbox and an index of its due rows above 0. Not
# in OUTBOX_COLUMNS: a farm of this release claims without the column until it is there, so
# `start` must not refuse a schema without it (`missing_columns`); `check` reports it.
PRIORITY_COLUMNS: dict[str, tuple[str, bool, bool]] = {"priority": ("smallint", True, True)}
PRIORITY_INDEX = ExpectedIndex(
    "priority index (migration 0013)",
    ("queue", "priority", "next_attempt_at"),
    False,
    "acquired_token IS NULL AND NOT key_blocked AND priority > 0",
)
PRIORITY_VERSION = 13
# Fair keys (migration 0014): a column of the outbox and an index of its free rows that have
# one. Not in OUTBOX_COLUMNS either: a farm claims without it, and only a publish with a fair
# key needs it (it is refused, saying to migrate, until then).
FAIR_COLUMNS: dict[str, tuple[str, bool, bool]] = {"fair_key": ("text", False, False)}
FAIR_INDEX = ExpectedIndex(
    "fair key index (migration 0014)",
    ("queue", "fair_key", "next_attempt_at"),
    False,
    "acquired_token IS NULL AND NOT key_blocked AND fair_key IS NOT NULL",
)
FIX_HINT = (
    "run `outbox-farm migrate`, or for a drifted index or CHECK drop it and recreate it as "
    "`outbox-farm sql` prints it"
)
# A dropped index of a recorded migration: a plain `migrate` skips the migration, `--repair`
# runs it again.
REPAIR_HINT = "run `outbox-farm migrate --repair` (it makes it again)"


@dataclass(frozen=True)
class Problem:
    table: str
    message: str
    # An index or CHECK of another shape, which a newer release's migration may have made.
    shape: bool = field(default=False, compare=False)

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


@dataclass(frozen=True)
class ExpectedCheck:
    """A CHECK matched by what it mentions (normalised, as pg_get_constraintdef renders it):
    its constants come out in the session's time zone, so the whole text cannot be compared."""

    role: str
    mentions: tuple[str, ...]
    columns: tuple[str, ...]  # one missing or of another type is reported as such, alone

    def found_in(self, definitions: list[str]) -> bool:
        return any(
            all(part in (_normalise(definition) or "") for part in self.mentions)
            for definition in definitions
        )


OUTBOX_CHECKS = (
    ExpectedCheck(
        "blocked rows CHECK (only a keyed row is key_blocked; migration 0008)",
        ("ordering_key is not null or not key_blocked",),
        ("ordering_key", "key_blocked"),
    ),
    ExpectedCheck(
        "counters CHECK (0 <= deliveries_count, attempts_count < bigint max; migration 0006)",
        (
            "deliveries_count >= 0",
            "deliveries_count < '9223372036854775807'::bigint",
            "attempts_count >= 0",
            "attempts_count < '9223372036854775807'::bigint",
        ),
        ("deliveries_count", "attempts_count"),
    ),
    ExpectedCheck(
        "values CHECK (finite timestamps within the years 1 to 9999, headers an object; "
        "migration 0006)",
        (
            "acquired_token is not null or",
            "created_at >=",
            "created_at <=",
            "next_attempt_at >=",
            "next_attempt_at <=",
            "first_attempt_at is null or",
            "last_attempt_at is null or",
            "headers is null or jsonb_typeof headers = 'object'::text",
        ),
        (
            "acquired_token",
            "created_at",
            "next_attempt_at",
            "first_attempt_at",
            "last_attempt_at",
            "headers",
        ),
    ),
)


def _column_ok(
    live: dict[str, LiveColumn], name: str, columns: dict[str, tuple[str, bool, bool]]
) -> bool:
    """Whether column `name` exists with its expected type: a CHECK on it can exist only then
    (dropping the column, or changing its type, takes the CHECK with it)."""
    return name in live and live[name].type == columns[name][0]


def _check_columns(
    label: str, live: dict[str, LiveColumn], columns: dict[str, tuple[str, bool, bool]]
) -> list[Problem]:
    problems: list[Problem] = []
    for name, (typ, notnull, needs_default) in columns.items():
        if name not in live:
            problems.append(Problem(label, f"column {name} is missing (expected {typ})"))
            continue
        found = live[name]
        if found.type != typ:
            problems.append(Problem(label, f"column {name} is {found.type}, expected {typ}"))
        if found.not_null != notnull:
            expected = "NOT NULL" if notnull else "nullable"
            problems.append(Problem(label, f"column {name} should be {expected}"))
        if needs_default and not found.has_default:
            problems.append(Problem(label, f"column {name} has lost its default"))
    return problems


def _check_index(
    label: str, want: ExpectedIndex, live_indexes: list[LiveIndex], missing_hint: str = FIX_HINT
) -> Problem | None:
    candidates = [
        (index.name, index.unique, _normalise(index.predicate))
        for index in live_indexes
        if index.columns == want.columns
    ]
    wanted_pred = _normalise(want.predicate)
    if any(u == want.unique and p == wanted_pred for _, u, p in candidates):
        return None
    cols = ", ".join(want.columns)
    if not candidates:
        return Problem(label, f"{want.role} on ({cols}) is missing; {missing_hint}", True)
    index_name, _, pred = candidates[0]
    if pred == wanted_pred:
        issue = "must be UNIQUE" if want.unique else "must not be UNIQUE"
    elif pred is None:
        issue = f"is not partial (expected WHERE {want.predicate})"
    elif wanted_pred is None:
        issue = f"is partial (WHERE {pred}) but must cover every row"
    else:
        issue = f"has predicate WHERE {pred}, expected WHERE {want.predicate}"
    return Problem(label, f"{want.role} {index_name} on ({cols}) {issue}; {FIX_HINT}", True)


def _check_table(
    conn: Connection,
    table: QualifiedName,
    columns: dict[str, tuple[str, bool, bool]],
    indexes: tuple[ExpectedIndex, ...],
    lease_check: bool,
) -> list[Problem]:
    label = str(table)
    live = read_table(conn, table)
    if live is None:
        return [Problem(label, "table does not exist; run `outbox-farm migrate`")]

    problems = _check_columns(label, live.columns, columns)
    if not any(index.primary and index.columns == ("id",) for index in live.indexes):
        problems.append(Problem(label, "primary key on id is missing"))
    problems += [p for want in indexes if (p := _check_index(label, want, live.indexes))]

    if lease_check and not any(_lease_check_ok(definition) for definition in live.checks):
        problems.append(
            Problem(
                label,
                "lease CHECK ((acquired_token IS NULL) = (acquired_at IS NULL)) is missing "
                f"or wrong; {FIX_HINT}",
                True,
            )
        )
    if lease_check:
        problems += [
            Problem(label, f"{want.role} is missing or wrong; {FIX_HINT}", True)
            for want in OUTBOX_CHECKS
            if all(_column_ok(live.columns, name, columns) for name in want.columns)
            and not want.found_in(live.checks)
        ]
    return problems


def _check_causes(conn: Connection, names: TableNames, recorded: bool) -> list[Problem]:
    """Migration 0009's objects beside the DLQ. Without its triggers the counts by cause drift
    from the rows unseen (`stats` and `dlq list --group` show wrong numbers); without the
    function, table or index grouping and `--cause` fail. Once 0009 is recorded, only
    `--repair` runs it again, which also recounts."""
    live = read_causes(conn, names)
    if live is None or names.dlq is None:  # no DLQ: reported by the table's own check
        return []
    label = str(names.dlq)
    if not recorded and not (live.function or live.counts_table or live.triggers or live.index):
        return [
            Problem(
                label,
                "dead letters by cause are not set up (migration 0009: the cause function, "
                "the counts table, its triggers and the index on the cause); run "
                "`outbox-farm migrate`",
            )
        ]
    hint = (
        "run `outbox-farm migrate --repair` (it makes them again and recounts)"
        if recorded
        else "run `outbox-farm migrate`"
    )
    objects = names.cause_objects()
    # While a trigger remains, it fails every write that fires it, the farm's DLQ moves too.
    fails = " (every write to the DLQ fails meanwhile)" if live.triggers else ""
    made = [
        (live.function, f"the cause function {objects['dlq_cause_fn']}(text){fails}"),
        (live.counts_table, f"the cause counts table {objects['dlq_causes']}{fails}"),
        (live.index, f"the index on {objects['dlq_cause_fn']}(last_exception)"),
    ]
    missing = [what for present, what in made if not present]
    found = [Problem(label, f"{what} is missing (migration 0009); {hint}") for what in missing]
    gone = [name for name in CAUSE_TRIGGERS if name not in live.triggers]
    if gone:
        which = f"trigger {gone[0]} is" if len(gone) == 1 else f"triggers {', '.join(gone)} are"
        found.append(
            Problem(
                label,
                f"the cause counts' {which} missing or disabled (migration 0009), so the counts "
                f"drift from the rows; {hint}",
            )
        )
    return found


def _check_controls(conn: Connection, applied: set[int]) -> list[Problem]:
    """The queue controls' table (migrations 0011, 0012 and 0014's per-key limit), which
    `queue pause|resume|limit` write and every farm reads. Without it a farm pauses and limits
    nothing (it says so in its log), and the operator's commands fail; without the 0012
    columns, limits and breakers do; without 0014's, a limit per fair key does (a farm limits
    the rest as before). Once a migration is recorded for the outbox, only `--repair` runs it
    again."""
    label = str(CONTROLS_TABLE)

    def hint(version: int) -> str:
        if version in applied:
            return "run `outbox-farm migrate --repair` (it makes it again)"
        return "run `outbox-farm migrate`"

    live = read_table(conn, CONTROLS_TABLE)
    if live is None:
        return [
            Problem(
                label,
                "table does not exist (migration 0011: queue pauses and limits; without it no "
                f"farm can be paused or limited); {hint(CONTROLS_VERSION)}",
            )
        ]
    found = [
        Problem(p.table, f"{p.message} (migration 0011); {hint(CONTROLS_VERSION)}")
        for p in _check_columns(label, live.columns, CONTROL_COLUMNS)
    ]
    found += [
        Problem(p.table, f"{p.message} (migration 0012: queue limits); {hint(LIMITS_VERSION)}")
        for p in _check_columns(label, live.columns, LIMIT_COLUMNS)
    ]
    found += [
        Problem(p.table, f"{p.message} (migration 0012: breakers); {hint(LIMITS_VERSION)}")
        for p in _check_columns(label, live.columns, BREAKER_COLUMNS)
    ]
    found += [
        Problem(
            p.table,
            f"{p.message} (migration 0014: fair keys; until then a limit per fair key is "
            f"refused); {hint(FAIR_KEYS_VERSION)}",
        )
        for p in _check_columns(label, live.columns, KEY_LIMIT_COLUMNS)
    ]
    return found


@dataclass(frozen=True)
class OutboxAddition:
    """A column a migration added to the outbox, with its index, that no farm needs to run:
    `start` does not look for it (`missing_columns`), `check` does."""

    version: int
    feature: str
    columns: dict[str, tuple[str, bool, bool]]
    index: ExpectedIndex
    until: str  # what does not work while the column is missing


OUTBOX_ADDITIONS = (
    OutboxAddition(
        PRIORITY_VERSION,
        "priorities",
        PRIORITY_COLUMNS,
        PRIORITY_INDEX,
        "a publish with a priority is refused and every row is claimed in due order",
    ),
    OutboxAddition(
        FAIR_KEYS_VERSION,
        "fair keys",
        FAIR_COLUMNS,
        FAIR_INDEX,
        "a publish with a fair key is refused",
    ),
)


def _check_additions(conn: Connection, names: TableNames, applied: set[int]) -> list[Problem]:
    """Migration 0013's and 0014's columns and indexes on the outbox. Without the priority
    column the farms claim as the release before did and a publish with a priority is refused;
    without the fair key column a publish with a fair key is refused. Without the priority
    index the claim's share by priority reads the pending index instead; without the fair key
    index the fair claim reads the queue's free rows once per key waiting. None stops a farm,
    so `start` does not look; an index is looked for only beside its column. Once the migration
    is recorded, only `--repair` makes what it made again."""
    live = read_table(conn, names.outbox)
    if live is None:  # reported by the outbox's own check
        return []
    label = str(names.outbox)
    found: list[Problem] = []
    for added in OUTBOX_ADDITIONS:
        repair = added.version in applied
        hint = "run `outbox-farm migrate --repair`" if repair else "run `outbox-farm migrate`"
        migration = f"migration {added.version:04d}: {added.feature}"
        absent = [name for name in added.columns if name not in live.columns]
        if absent:
            found += [
                Problem(
                    label,
                    f"column {name} is missing (expected {added.columns[name][0]}) "
                    f"({migration}; until then {added.until}); {hint}",
                )
                for name in absent
            ]
            continue
        found += [
            Problem(p.table, f"{p.message} ({migration}); {hint}")
            for p in _check_columns(label, live.columns, added.columns)
        ]
        index = _check_index(label, added.index, live.indexes, REPAIR_HINT if repair else FIX_HINT)
        if index is not None:
            found.append(index)
    return found


def _check_fleet(conn: Connection, applied: set[int]) -> list[Problem]:
    """Migration 0015's tables, once it is recorded: a fleet started on this home database
    refuses to run without them, and `migrate` skips a recorded migration, so a dropped or
    changed one says `--repair`. Before 0015, nothing: only a fleet's home needs them."""
    if FLEET_VERSION not in applied:
        return []
    hint = "(migration 0015: a fleet's leases); run `outbox-farm migrate --repair`"
    found: list[Problem] = []
    for table, columns in FLEET_TABLES.items():
        live = read_table(conn, table)
        if live is None:
            found.append(Problem(str(table), f"table does not exist {hint}"))
            continue
        found += [
            Problem(p.table, f"{p.message} {hint}")
            for p in _check_columns(str(table), live.columns, columns)
        ]
    return found


def _unadvised(message: str) -> str:
    """A shape problem's message without its advice to recreate, for a note."""
    for hint in (FIX_HINT, REPAIR_HINT):
        message = message.removesuffix("; " + hint)
    return message


@dataclass(frozen=True)
class Assessment:
    problems: list[Problem]
    notes: list[str]  # a schema newer than this release, and what of it differs


def assess_schema(conn: Connection, names: TableNames) -> Assessment:
    """Every difference between the live schema and what the farm needs (empty when fine),
    and, on a schema a newer release migrated, notes in place of its index and CHECK shapes.

    Extra user columns and indexes are allowed. Index and CHECK names do not matter: they are
    matched by columns and predicate, so schemas made by Alembic or Django pass too. The DLQ
    is checked only when `names` has one. A failing catalog read is a `DatabaseError`.
    """
    recorded = recorded_migrations(conn, names)
    problems = _check_table(conn, names.outbox, OUTBOX_COLUMNS, OUTBOX_INDEXES, True)
    if names.dlq is not None:
        problems += _check_table(conn, names.dlq, DLQ_COLUMNS, DLQ_INDEXES, False)
        causes_applied = (str(names.dlq), CAUSES_VERSION) in {(t, v) for t, v, _ in recorded}
        problems += _check_causes(conn, names, causes_applied)
    outbox_applied = {v for t, v, _ in recorded if t == str(names.outbox)}
    problems += _check_controls(conn, outbox_applied)
    problems += _check_additions(conn, names, outbox_applied)
    problems += _check_fleet(conn, outbox_applied)
    shipped = max(m.version for m in load_migrations())
    newer = [record for record in recorded if record[1] > shipped]
    if not newer:
        return Assessment(problems, [])
    target, version, name = newer[-1]
    notes = [
        f"the schema is newer than this release (migration {version:04d}_{name} on {target}; "
        f"this release ships up to {shipped:04d}): fine, it works with this release"
    ]
    notes += [
        f"{p.table}: {_unadvised(p.message)}, as a newer migration may have "
        "left it: leave it, and check with the release that migrated"
        for p in problems
        if p.shape
    ]
    return Assessment([p for p in problems if not p.shape], notes)


def check_schema(conn: Connection, names: TableNames) -> list[Problem]:
    """The problems of `assess_schema`: empty when the farm can run on this schema."""
    return assess_schema(conn, names).problems


def missing_columns(conn: Connection, names: TableNames) -> list[str]:
    """`table.column` for each column this release reads or writes that is not there: the
    schema is older than this release, and a farm would fail every claim until it is migrated.
    A missing table is left to the caller (`missing_tables`)."""
    found: list[str] = []
    for table, columns in ((names.outbox, OUTBOX_COLUMNS), (names.dlq, DLQ_COLUMNS)):
        live = None if table is None else read_table(conn, table)
        if live is not None:
            found += [f"{table}.{name}" for name in columns if name not in live.columns]
    return found
