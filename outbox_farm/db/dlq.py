"""The dead-letter table's statements for the operator: list, show, summarise, and the batched
replay and purge.

Replay and purge run keyset batches on id, each batch one statement in its own transaction, so
what a batch did is committed before the next starts and an interrupted run has done whole
batches only. The caller's connection must be in autocommit mode (not inside a transaction).
Every error is a `DatabaseError`; a missing table is a `SchemaError` naming it, and a DLQ
without migration 0009's cause function and counts a `SchemaError` saying to migrate.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import datetime
from typing import Any

import psycopg

from ..errors import SchemaError
from ..names import TableNames
from .boundary import translate
from .connect import Connection
from .operator import AdminSql, Plan

STATEMENT_FAILED = "DLQ statement failed"
UNDEFINED_FUNCTION = "42883"
UNDEFINED_TABLE = "42P01"
CAUSES_MISSING = (
    "this DLQ has no cause function and counts yet (migration 0009): run `outbox-farm "
    "migrate`, then group or filter by cause"
)


@dataclass(frozen=True)
class DlqMatch:
    """Which rows a statement is about; a field left None matches every row. `since` and
    `until` are each a time (`_at`) or seconds before the database's now() (`_ago`)."""

    ids: list[int] | None = None
    queue: str | None = None
    reason: str | None = None
    since_at: datetime | None = None
    since_ago: float | None = None
    until_at: datetime | None = None
    until_ago: float | None = None
    grep: str | None = None
    cause: str | None = None  # a cause exactly as `causes` names it

    @property
    def block(self) -> str:
        """The filter's block: with the cause condition only when a cause is given, so that
        the other filters work on a DLQ migrated before the cause function existed."""
        return "admin_dlq_match" if self.cause is None else "admin_dlq_match_cause"


@dataclass(frozen=True)
class CauseGroup:
    """The DLQ rows of one cause (their `last_exception` normalised, see migration 0009):
    how many, in which queues and for which reasons, and when the newest of them failed
    (None: no row was found to say, the count having moved meanwhile)."""

    cause: str
    rows: int
    queues: tuple[str, ...]
    reasons: tuple[str, ...]
    last_failed_at: datetime | None


@dataclass(frozen=True)
class DlqFacts:
    """What every view of a DLQ row starts with: which message, where, why and when."""

    id: int
    original_id: int
    queue: str
    reason: str
    deliveries_count: int
    created_at: datetime | None  # None: stored as a value no client can load (±infinity...)
    failed_at: datetime


@dataclass(frozen=True)
class DlqRow(DlqFacts):
    """One row as `list` shows it: the exception's first line, the payload's size."""

    payload_bytes: int
    headers: dict[str, Any]
    exception: str


@dataclass(frozen=True)
class DlqRecord(DlqFacts):
    """One row as stored; `payload` whole, or its first bytes when read with a cap
    (`payload_bytes` is the whole size either way)."""

    payload: bytes
    headers: dict[str, Any]
    last_exception: str | None
    timer_id: str | None
    payload_bytes: int


@dataclass(frozen=True)
class SummaryLine:
    queue: str
    reason: str
    rows: int
    first_failed_at: datetime
    last_failed_at: datetime


@dataclass(frozen=True)
class Summary:
    """What a filter matches now, by queue and reason; `upto` is the highest id among them."""

    lines: list[SummaryLine] = field(default_factory=list)
    upto: int = 0

    @property
    def rows(self) -> int:
        return sum(line.rows for line in self.lines)


@dataclass(frozen=True)
class Done:
    """What a replay or purge did."""

    rows: int
    batches: int
    notified: int = 0  # replay: NOTIFYs sent (one per queue and batch with due rows)


NOT_AN_OBJECT = "(not a JSON object)"


def _object(headers: Any) -> dict[str, Any]:
    """Headers as a mapping, whatever another writer stored: a JSON array, string, number or
    null (an `invalid_row` keeps them as they were) is shown under `NOT_AN_OBJECT`."""
    if headers is None:
        return {}
    if isinstance(headers, dict):
        return headers
    return {NOT_AN_OBJECT: headers}


def _causes_missing(exc: psycopg.Error, names: TableNames) -> bool:
    """Whether `exc` says migration 0009's function or counts table is not there."""
    assert names.dlq is not None
    primary = exc.diag.message_primary or ""
    return exc.sqlstate in (UNDEFINED_FUNCTION, UNDEFINED_TABLE) and (
        f"{names.dlq.name}_cause" in primary
    )


def _all(conn: Connection, names: TableNames, statement: str, params: dict[str, Any]) -> list[Any]:
    try:
        return conn.execute(statement, params).fetchall()
    except psycopg.Error as exc:
        if _causes_missing(exc, names):
            raise SchemaError(CAUSES_MISSING) from exc
        raise translate(exc, doing=STATEMENT_FAILED, names=names) from exc


def list_rows(
    conn: Connection, names: TableNames, match: DlqMatch, limit: int, before: int | None = None
) -> list[DlqRow]:
    """The newest `limit` rows matching with ids below `before` (None: any), newest first."""
    statement = AdminSql(names).render("admin_dlq_list", match=match.block)
    rows = _all(conn, names, statement, asdict(match) | {"limit": limit, "before": before})
    return [
        DlqRow(
            rid, original, queue, reason, deliveries, created, failed, size, _object(headers), exc
        )
        for rid, original, queue, reason, deliveries, created, failed, size, headers, exc in rows
    ]


def read_row(
    conn: Connection, names: TableNames, row_id: int, payload_cap: int | None = None
) -> DlqRecord | None:
    """Row `row_id`, with at most `payload_cap` bytes of its payload (None: all of it); None
    when there is none."""
    statement = AdminSql(names).render("admin_dlq_show")
    rows = _all(conn, names, statement, {"id": row_id, "cap": payload_cap})
    if not rows:
        return None
    rid, original, queue, reason, deliveries, created, failed, body, headers, exc, timer, size = (
        rows[0]
    )
    return DlqRecord(
        rid,
        original,
        queue,
        reason,
        deliveries,
        created,
        failed,
        bytes(body),
        _object(headers),
        exc,
        timer,
        int(size),
    )


def read_payload(conn: Connection, names: TableNames, row_id: int) -> bytes | None:
    """Row `row_id`'s payload, whole; None when there is no such row."""
    rows = _all(conn, names, AdminSql(names).render("admin_dlq_payload"), {"id": row_id})
    return bytes(rows[0][0]) if rows else None


def now(conn: Connection, names: TableNames) -> datetime:
    """The database's clock."""
    ((at,),) = _all(conn, names, AdminSql(names).render("admin_now"), {})
    return at  # type: ignore[no-any-return]


def snapshot_xmax(conn: Connection, names: TableNames) -> int:
    """The first transaction id unassigned at this statement's snapshot."""
    ((xmax,),) = _all(conn, names, AdminSql(names).render("admin_snapshot_xmax"), {})
    return int(xmax)


def horizon_passed(conn: Connection, names: TableNames, xmax: int) -> bool:
    """Whether every transaction with an id below `xmax` has ended."""
    statement = AdminSql(names).render("admin_horizon_passed")
    ((passed,),) = _all(conn, names, statement, {"xmax": xmax})
    return bool(passed)


def count_rows(conn: Connection, names: TableNames, match: DlqMatch, cap: int) -> tuple[int, bool]:
    """How many rows match: (count, True) when at most `cap` do, counted one by one; else
    (the planner's estimate, False), so that a page over millions of rows stays fast."""
    sql = AdminSql(names)
    params = asdict(match) | {"cap": cap + 1}
    statement = sql.render("admin_dlq_count", match=match.block)
    ((counted,),) = _all(conn, names, statement, params)
    if counted <= cap:
        return int(counted), True
    explain = sql.render("admin_explain", statement="admin_dlq_count", match=match.block)
    ((explained,),) = _all(conn, names, explain, params)
    return max(Plan.parse(explained).rows, int(counted)), False


def summarize(
    conn: Connection, names: TableNames, match: DlqMatch, upto: int | None = None
) -> Summary:
    """Counts by queue and reason of the rows matching (with ids up to `upto`, None: any),
    and the highest id among them."""
    statement = AdminSql(names).render("admin_dlq_summary", match=match.block)
    rows = _all(conn, names, statement, asdict(match) | {"upto": upto})
    return Summary(
        [
            SummaryLine(queue, reason, count, first, last)
            for queue, reason, count, first, last, _ in rows
        ],
        max((upto for *_, upto in rows), default=0),
    )


# Filters the kept counts answer: the others group the rows they match as they read them.
COUNTED_FILTERS = ("queue", "reason", "cause")


def causes(conn: Connection, names: TableNames, match: DlqMatch, limit: int) -> list[CauseGroup]:
    """The `limit` causes with the most rows matching, most first: from the counts kept by
    migration 0009's triggers when the filter is at most a queue, reason and cause, else
    counted over the matching rows."""
    counted = all(
        getattr(match, name) is None for name in asdict(match) if name not in COUNTED_FILTERS
    )
    sql = AdminSql(names)
    statement = (
        sql.render("admin_dlq_causes")
        if counted
        else sql.render("admin_dlq_causes_scan", match=match.block)
    )
    rows = _all(conn, names, statement, asdict(match) | {"limit": limit})
    return [
        CauseGroup(str(cause), int(n), tuple(sorted(queues)), tuple(sorted(reasons)), last)
        for cause, n, queues, reasons, last in rows
    ]


def counts_kept(conn: Connection, names: TableNames) -> bool:
    """Whether migration 0009's counts table exists (`causes` fails without it)."""
    table = names.identifiers()["dlq_causes"].as_string(conn)
    ((kept,),) = _all(
        conn, names, AdminSql(names).render("admin_dlq_causes_kept"), {"table": table}
    )
    return bool(kept)


def _batches(
    conn: Connection,
    names: TableNames,
    statement: str,
    params: dict[str, Any],
    progress: Callable[[int], None] | None,
) -> Done:
    """Run a keyset-batched statement until it matches nothing, one transaction a batch."""
    after, rows, batches, notified = 0, 0, 0, 0
    while True:
        try:
            with conn.transaction():
                row = conn.execute(statement, params | {"after": after}).fetchone()
        except psycopg.Error as exc:
            raise translate(
                exc,
                doing=f"DLQ batch failed after {rows} row(s) in {batches} batch(es), all "
                "committed; nothing of the failed batch was changed",
                names=names,
            ) from exc
        assert row is not None  # an aggregate: always one row
        last, moved, *woke = row
        if last is None:
            return Done(rows, batches, notified)
        after, rows, batches = last, rows + moved, batches + 1
        notified += woke[0] if woke else 0
        if progress is not None:
            progress(moved)


def replay(
    conn: Connection,
    names: TableNames,
    match: DlqMatch,
    *,
    upto: int,
    batch: int,
    to_queue: str | None,
    delay: float,
    progress: Callable[[int], None] | None,
) -> Done:
    """Move the matching rows with ids up to `upto` into the outbox, `batch` at a time: to
    `to_queue` (None: their own), due `delay` seconds after now(), the farm woken by NOTIFY."""
    params = asdict(match) | {
        "upto": upto,
        "batch": batch,
        "to_queue": to_queue,
        "delay": delay,
        "channel": names.channel,
    }
    statement = AdminSql(names).render("admin_dlq_replay", match=match.block)
    return _batches(conn, names, statement, params, progress)


def purge(
    conn: Connection,
    names: TableNames,
    match: DlqMatch,
    *,
    upto: int,
    batch: int,
    progress: Callable[[int], None] | None,
) -> Done:
    """Delete the matching rows with ids up to `upto`, `batch` at a time."""
    params = asdict(match) | {"upto": upto, "batch": batch}
    statement = AdminSql(names).render("admin_dlq_purge", match=match.block)
    return _batches(conn, names, statement, params, progress)
