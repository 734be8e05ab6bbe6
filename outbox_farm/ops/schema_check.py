"""Compare the live database with the schema the farm needs, and report every difference.

Never run implicitly: a running migration and an always-on check would race, and operators
must be able to roll a schema forward without sending every worker into a crash loop. Run it
between `migrate` and deploy (`outbox-farm check`), or from a health probe.

A schema that a newer release migrated is fine (each migration is one the release before it
keeps working with): when `outbox_farm_migrations` holds a version this release does not ship,
an index or CHECK shaped otherwise than this release expects is a note, never advice to
recreate it the old way. A missing table or column is still a problem.

What the farm needs is in `schema_expected`; the verdict and its advice, in `schema_report`.
"""

from __future__ import annotations

from ..db.connect import Connection
from ..db.schema import LiveColumn, LiveIndex, read_causes, read_table, recorded_migrations
from ..names import QualifiedName, TableNames
from .schema_expected import (
    BREAKER_COLUMNS,
    CAUSE_TRIGGERS,
    CAUSES_VERSION,
    CONTROL_COLUMNS,
    CONTROLS_TABLE,
    CONTROLS_VERSION,
    DLQ_COLUMNS,
    DLQ_INDEXES,
    FAIR_KEYS_VERSION,
    FLEET_TABLES,
    FLEET_VERSION,
    KEY_LIMIT_COLUMNS,
    LIMIT_COLUMNS,
    LIMITS_VERSION,
    OUTBOX_ADDITIONS,
    OUTBOX_CHECKS,
    OUTBOX_COLUMNS,
    OUTBOX_INDEXES,
    ExpectedIndex,
    normalise,
)
from .schema_report import FIX_HINT, REPAIR_HINT, Assessment, Problem, assessment


def _lease_check_ok(definition: str) -> bool:
    flat = normalise(definition) or ""
    return flat in {
        "check acquired_token is null = acquired_at is null",
        "check acquired_at is null = acquired_token is null",
    }


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
        (index.name, index.unique, normalise(index.predicate))
        for index in live_indexes
        if index.columns == want.columns
    ]
    wanted_pred = normalise(want.predicate)
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
    return assessment(problems, recorded)


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
